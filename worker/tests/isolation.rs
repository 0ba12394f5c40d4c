//! Trainers in one process share nothing that changes their numbers
//! (issue 13, the state_sync flake): a seeded init must come out bit for
//! bit the same while other threads draw from libtorch's process-global
//! generator, load models from checkpoints and build trainers of their
//! own. Before the fix, loading a checkpoint (whose model was first built
//! with a random init) or any `randn` on another thread consumed draws of
//! the global generator between `manual_seed` and the init, and a
//! scenario's model came out an independent random draw.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use accrue_worker::train::{Checkpointing, Passes, ReplicatedTrainer};
use tch::{Device, Kind, Tensor};

#[test]
fn a_seeded_init_does_not_depend_on_what_other_threads_draw() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(dir.path(), "");
    let want = common::snapshot(
        &ReplicatedTrainer::single(&cfg, None)
            .unwrap()
            .named_parameters(),
    );
    // A checkpoint for the loader thread (a different seed: other weights).
    let mut other_cfg = cfg.clone();
    other_cfg.seed = 99;
    let ckpt = dir.path().join("other");
    ReplicatedTrainer::single(&other_cfg, None)
        .unwrap()
        .save_checkpoint(&ckpt)
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let mut noise = Vec::new();
    {
        let stop = stop.clone();
        noise.push(std::thread::spawn(move || {
            let mut draws = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = Tensor::randn([4096], (Kind::Float, Device::Cpu));
                draws += 1;
            }
            draws
        }));
    }
    {
        let (stop, cfg, ckpt) = (stop.clone(), other_cfg.clone(), ckpt.clone());
        noise.push(std::thread::spawn(move || {
            let mut loads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                ReplicatedTrainer::single(&cfg, Some(&ckpt)).unwrap();
                loads += 1;
            }
            loads
        }));
    }
    let builders: Vec<_> = (0..3)
        .map(|_| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                (0..4)
                    .map(|_| {
                        common::snapshot(
                            &ReplicatedTrainer::single(&cfg, None)
                                .unwrap()
                                .named_parameters(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let built: Vec<_> = builders
        .into_iter()
        .flat_map(|b| b.join().unwrap())
        .collect();
    stop.store(true, Ordering::Relaxed);
    let activity: Vec<u64> = noise.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        activity.iter().all(|&n| n > 0),
        "the noise threads ran: {activity:?}"
    );
    for (i, got) in built.iter().enumerate() {
        for ((n, a), (_, b)) in got.iter().zip(&want) {
            assert!(
                a.equal(b),
                "build {i}: parameter {n} differs from the quiet build"
            );
        }
    }
}

/// What a probe plan relies on (issue 14): with one embedding row NaN, a
/// microbatch using that token fails as non-finite and one without it
/// trains with finite gradients (the row is never read).
#[test]
fn a_nan_embedding_row_poisons_only_the_documents_that_use_it() {
    use accrue_worker::batch::{MicrobatchMeta, PackedBatch, StepNorms};
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(dir.path(), "");
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    for (name, p) in t.named_parameters() {
        if name.ends_with("embed_tokens.weight") {
            tch::no_grad(|| {
                let _ = p.get(7).fill_(f64::NAN);
            });
        }
    }
    let batch = |ids: Vec<i64>| PackedBatch {
        cu_seq_lens: vec![0, ids.len() as i64],
        labels: ids.clone(),
        input_ids: ids,
        ..Default::default()
    };
    let norms = StepNorms {
        loss_tokens: 8,
        ..Default::default()
    };
    let meta = MicrobatchMeta {
        seqs: vec![accrue_worker::batch::SeqMeta {
            doc_id: "0:1".into(),
            role: 0,
            advantage: None,
            ref_logp: None,
        }],
        ..Default::default()
    };
    t.zero_grad();
    let clean = t.train_microbatch(0, &batch(vec![1, 2, 3, 4, 5, 6, 8, 9]), &meta, &norms);
    assert!(clean.unwrap().loss_sum.is_finite());
    assert!(t.grads_finite(), "the NaN row is never read");
    t.zero_grad();
    let poisoned = t.train_microbatch(1, &batch(vec![1, 2, 7, 4]), &meta, &norms);
    let e = poisoned.expect_err("a NaN embedding makes the loss NaN");
    assert_eq!(
        accrue_worker::error::classify(&e).0,
        accrue_worker::wire::ErrorKind::NonFinite,
        "{e:#}"
    );
}
