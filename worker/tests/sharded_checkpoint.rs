//! Parallel checkpoints of a 2-rank job (ddp and zero2): every rank writes
//! its shard of a Hugging Face sharded checkpoint at once; the checkpoint
//! restores at world 1 and at world 2 to the same parameters and AdamW
//! moments, and transformers loads it. Also: a non-finite gradient on one
//! rank makes every rank refuse the step, parameters untouched.

mod common;

use std::path::Path;

use accrue_worker::collective::local::LocalGroup;
use accrue_worker::config::JobConfig;
use accrue_worker::train::{Checkpointing, ReplicatedTrainer, Trainer};
use tch::Tensor;

type Named = Vec<(String, Tensor)>;
type Moments = (u64, Vec<(String, Tensor, Tensor)>);

fn config(dir: &Path, sharding: &str) -> JobConfig {
    common::random_job(
        dir,
        &format!(
            "[optimizer]\nweight_decay = 0.1\n[parallel]\nsharding = \"{sharding}\"\n\
             [runtime]\nloss_chunk_tokens = 32\n"
        ),
    )
}

/// Runs `f` on every rank of a `world`-rank group (threads) and returns
/// the ranks' results in rank order.
fn on_ranks<R, F>(world: usize, cfg: &JobConfig, restore: Option<&Path>, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(usize, &mut ReplicatedTrainer) -> R + Send + Clone + 'static,
{
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let cfg = cfg.clone();
            let restore = restore.map(Path::to_path_buf);
            let f = f.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let mut t =
                    ReplicatedTrainer::new(&cfg, restore.as_deref(), Box::new(coll)).unwrap();
                f(rank, &mut t)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn state(t: &mut ReplicatedTrainer) -> (Named, Moments) {
    let params = common::snapshot(&t.named_parameters());
    let (step, m) = t.optimizer_state().unwrap();
    let m = m
        .into_iter()
        .map(|(n, a, s)| (n, a.copy(), s.copy()))
        .collect();
    (params, (step, m))
}

fn assert_same(what: &str, a: &(Named, Moments), b: &(Named, Moments)) {
    let (w, n) = common::worst_rel(&a.0, &b.0);
    assert_eq!(w, 0.0, "{what}: parameter {n} differs by {w:e}");
    assert_eq!(a.1 .0, b.1 .0, "{what}: optimizer step");
    let split = |m: &Moments, k: usize| -> Named {
        m.1.iter()
            .map(|(n, a, s)| (n.clone(), if k == 0 { a.copy() } else { s.copy() }))
            .collect()
    };
    for k in 0..2 {
        let (w, n) = common::worst_rel(&split(&a.1, k), &split(&b.1, k));
        assert_eq!(w, 0.0, "{what}: moment {k} of {n} differs by {w:e}");
    }
}

/// Two steps on both ranks, then a parallel checkpoint to `dir`.
fn train_and_save(rank: usize, t: &mut ReplicatedTrainer, dir: &Path) -> (Named, Moments) {
    let docs = common::synthetic_documents(&[23, 9, 31, 14], 11 + rank as u64);
    let total = 2 * common::batch(&docs).loss_tokens();
    for _ in 0..2 {
        t.microbatch(0, &common::batch(&docs), total).unwrap();
        t.optimizer_step(1e-3).unwrap();
    }
    t.save_checkpoint(dir).unwrap();
    state(t)
}

#[test]
fn two_rank_checkpoint_restores_at_world_1_and_2_and_loads_in_transformers() {
    for sharding in ["ddp", "zero2"] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), sharding);
        let ckpt = dir.path().join("ckpt");
        let to = ckpt.clone();
        let saved = on_ranks(2, &cfg, None, move |r, t| train_and_save(r, t, &to));
        assert_same(
            &format!("{sharding}: rank 1 vs rank 0"),
            &saved[1],
            &saved[0],
        );
        for f in [
            "config.json",
            "trainer.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "optimizer-00001-of-00002.safetensors",
            "optimizer-00002-of-00002.safetensors",
        ] {
            assert!(ckpt.join(f).is_file(), "{sharding}: {f} missing");
        }
        assert!(!ckpt.join("model.safetensors").exists());

        let mut one = ReplicatedTrainer::single(&cfg, Some(&ckpt)).unwrap();
        assert_same(&format!("{sharding}: world 1"), &state(&mut one), &saved[0]);
        let two = on_ranks(2, &cfg, Some(&ckpt), |_, t| state(t));
        for (r, s) in two.iter().enumerate() {
            assert_same(&format!("{sharding}: world 2 rank {r}"), s, &saved[0]);
        }

        let out = std::process::Command::new(common::repo_root().join(".venv/bin/python"))
            .arg(common::repo_root().join("scripts/reference/load_checkpoint.py"))
            .arg(&ckpt)
            .args(["5", "17", "42", "99", "3"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{sharding}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line: serde_json::Value = serde_json::from_str(stdout.trim().lines().last().unwrap())
            .unwrap_or_else(|e| panic!("{e}: {stdout}"));
        let ours: i64 = saved[0].0.iter().map(|(_, t)| t.numel() as i64).sum();
        assert_eq!(line["finite"], true, "{sharding}: {line}");
        assert_eq!(line["params"].as_i64(), Some(ours), "{sharding}: {line}");
    }
}

#[test]
fn a_non_finite_gradient_on_one_rank_is_refused_by_every_rank() {
    for sharding in ["ddp", "zero2"] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), sharding);
        let out = on_ranks(2, &cfg, None, |rank, t| {
            let docs = common::synthetic_documents(&[12, 20], 5 + rank as u64);
            let before = common::snapshot(&t.named_parameters());
            t.microbatch(0, &common::batch(&docs), 40).unwrap();
            if rank == 1 {
                // The first gradient this rank holds (at zero2 its shard
                // covers only some parameters).
                let (_, mut g) = t
                    .named_grads()
                    .into_iter()
                    .find(|(_, g)| g.numel() > 0)
                    .unwrap();
                let _ = g.fill_(f64::INFINITY);
            }
            let err = t.optimizer_step(1e-3).unwrap_err().to_string();
            let (w, _) = common::worst_rel(&t.named_parameters(), &before);
            (err, w)
        });
        for (rank, (err, w)) in out.iter().enumerate() {
            assert!(
                err.contains("non-finite gradient norm"),
                "{sharding} rank {rank}: {err}"
            );
            assert_eq!(*w, 0.0, "{sharding} rank {rank}: parameters moved");
        }
    }
}
