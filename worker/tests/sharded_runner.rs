//! Two runner threads with the real trainer, joined through an injected
//! connector (in-process `LocalGroup` ranks, one group per generation):
//! configure at world 2, a zero2 step whose results agree across ranks and
//! match one rank training all documents, a checkpoint written in the
//! background (each rank's marker, rank 0's manifest) that verifies, a new
//! generation at the same step that keeps the replicas and rebuilds the
//! collective, and a third worker joining through state sync (the zero2
//! shards move from 2 to 3 ranks) after which a step and a checkpoint
//! match one rank training the same documents.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accrue_worker::batch::PackedBatch;
use accrue_worker::collective::local::{LocalGroup, LocalRank};
use accrue_worker::collective::{Collective, CollectiveError};
use accrue_worker::runner::{default_factory, Connector, Runner, RunnerConfig, Work};
use accrue_worker::train::{ReplicatedTrainer, Trainer};
use accrue_worker::wire;
use accrue_worker::wire::worker_message::Msg;

/// Hands out the ranks of one in-process group per generation.
fn connector(builds: Arc<Mutex<Vec<(u64, u32)>>>) -> Connector {
    let groups: Mutex<HashMap<u64, Vec<Option<LocalRank>>>> = Mutex::default();
    Arc::new(move |_, c: &wire::Configure| {
        builds.lock().unwrap().push((c.generation, c.rank));
        let mut g = groups.lock().unwrap();
        let ranks = g.entry(c.generation).or_insert_with(|| {
            LocalGroup::new(c.world_size as usize)
                .into_iter()
                .map(Some)
                .collect()
        });
        let r = ranks[c.rank as usize]
            .take()
            .ok_or_else(|| CollectiveError::Setup(format!("rank {} joined twice", c.rank)))?;
        Ok(Box::new(r) as Box<dyn Collective>)
    })
}

fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>) -> Msg {
    for _ in 0..3000 {
        if let Ok(m) = rx.try_recv() {
            return m.msg.unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no message from the runners");
}

#[test]
fn two_runners_train_checkpoint_and_rejoin_a_new_generation() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("config.json");
    std::fs::write(&cfg_path, common::TINY_CONFIG).unwrap();
    let job = common::job_definition(
        "random",
        &format!(
            "config = \"{}\"\n[parallel]\nsharding = \"zero2\"\n[data]\nmax_tokens = 256\n",
            cfg_path.display()
        ),
    );
    let builds = Arc::new(Mutex::new(Vec::new()));
    let conn = connector(builds.clone());
    let models = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = models.clone();
    let inner = default_factory();
    let factory: accrue_worker::runner::Factory = Arc::new(move |cfg, restore, coll| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        inner(cfg, restore, coll)
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runners: Vec<Runner> = (0..2)
        .map(|_| {
            Runner::start(
                RunnerConfig {
                    factory: factory.clone(),
                    connector: conn.clone(),
                    listener: Some(std::net::TcpListener::bind("127.0.0.1:0").unwrap()),
                    device: tch::Device::Cpu,
                },
                tx.clone(),
            )
        })
        .collect();
    let configure = |generation: u64, step: u64| {
        for (rank, r) in runners.iter().enumerate() {
            r.submit(Work::Configure(Box::new(wire::Configure {
                link_key: vec![9; 32],
                job_id: "j".into(),
                generation,
                rank: rank as u32,
                world_size: 2,
                job: Some(job.clone()),
                step,
                ..Default::default()
            })));
        }
    };
    configure(1, 0);
    for _ in 0..2 {
        assert!(matches!(recv(&mut rx), Msg::Ready(r) if r.generation == 1));
    }

    let docs = common::synthetic_documents(&[30, 11, 25, 7, 40], 9);
    let total = PackedBatch::from_documents(&docs).loss_tokens();
    for (rank, r) in runners.iter().enumerate() {
        r.submit(Work::Plan(Box::new(wire::StepPlan {
            replay: false,
            job_id: "j".into(),
            generation: 1,
            step: 1,
            rank: rank as u32,
            lr: 1e-3,
            normalizers: Some(wire::Normalizers {
                loss_tokens: total,
                ..Default::default()
            }),
            // Rank 1 also runs a padding microbatch; rank 0 one more real.
            microbatches: if rank == 0 {
                vec![common::to_wire(&docs[..1]), common::to_wire(&docs[1..2])]
            } else {
                vec![common::to_wire(&docs[2..]), wire::Microbatch::default()]
            },
            cursor_after: None,
            kind: wire::PlanKind::Train as i32,
            max_tokens: 256,
        })));
    }
    let mut sums = Vec::new();
    for _ in 0..2 {
        let Msg::StepResult(r) = recv(&mut rx) else {
            panic!("expected a step result");
        };
        sums.push(r.sums.unwrap());
    }
    assert_eq!(sums[0].grad_norm, sums[1].grad_norm, "one global norm");
    let loss: f64 = sums.iter().map(|s| s.loss_sum).sum();
    assert_eq!(sums.iter().map(|s| s.loss_tokens).sum::<u64>(), total);

    // One rank, all documents in one microbatch: the same loss and norm.
    let cfg = accrue_worker::convert::job_config(&job).unwrap();
    let mut single = ReplicatedTrainer::single(&cfg, None).unwrap();
    let s = single
        .microbatch(0, &PackedBatch::from_documents(&docs), total)
        .unwrap();
    let norm = single.optimizer_step(1e-3).unwrap().grad_norm;
    assert!(
        (s.loss_sum - loss).abs() <= 1e-5 * loss,
        "{} vs {loss}",
        s.loss_sum
    );
    assert!(
        (norm - sums[0].grad_norm).abs() <= 1e-5 * norm,
        "{norm} vs {}",
        sums[0].grad_norm
    );

    let ckpt = dir.path().join("step-1");
    for r in &runners {
        r.submit(Work::Checkpoint(wire::CheckpointRequest {
            job_id: "j".into(),
            step: 1,
            dir: ckpt.display().to_string(),
            cursor: None,
        }));
    }
    for _ in 0..2 {
        assert!(matches!(recv(&mut rx), Msg::CheckpointDone(c) if c.step == 1));
    }
    accrue_checkpoint::verify(&ckpt).unwrap();
    for f in [
        "manifest.json",
        "rank-0.json",
        "rank-1.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors",
        "optimizer-00002-of-00002.safetensors",
    ] {
        assert!(ckpt.join(f).is_file(), "{f} missing");
    }
    let restored = ReplicatedTrainer::single(&cfg, Some(&ckpt)).unwrap();
    let (w, n) = common::worst_rel(
        &restored.named_parameters(),
        &common::snapshot(&single.named_parameters()),
    );
    assert!(
        w <= 1e-5,
        "checkpoint parameter {n} differs from one rank's by {w:e}"
    );

    // A new generation at the same step: replicas kept, collective rebuilt.
    configure(2, 1);
    for _ in 0..2 {
        assert!(matches!(recv(&mut rx), Msg::Ready(r) if r.generation == 2 && r.step == 1));
    }
    let mut b = builds.lock().unwrap().clone();
    b.sort();
    assert_eq!(b, vec![(1, 0), (1, 1), (2, 0), (2, 1)]);
    assert_eq!(
        models.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "replicas kept"
    );

    // Generation 3: a third worker joins at step 1 and gets the state from
    // the two holders over the collective (no restore_from).
    let third = Runner::start(
        RunnerConfig {
            factory: factory.clone(),
            connector: conn.clone(),
            listener: Some(std::net::TcpListener::bind("127.0.0.1:0").unwrap()),
            device: tch::Device::Cpu,
        },
        tx.clone(),
    );
    let all: Vec<&Runner> = runners.iter().chain([&third]).collect();
    let peers: Vec<wire::Peer> = (0..3)
        .map(|r| wire::Peer {
            rank: r,
            prior: (r < 2).then(|| wire::HeldState {
                job_id: "j".into(),
                step: 1,
                world_size: 2,
                rank: r,
                generation: 2,
            }),
            ..Default::default()
        })
        .collect();
    for (rank, r) in all.iter().enumerate() {
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 3,
            rank: rank as u32,
            world_size: 3,
            peers: peers.clone(),
            job: Some(job.clone()),
            step: 1,
            ..Default::default()
        })));
    }
    for _ in 0..3 {
        match recv(&mut rx) {
            Msg::Ready(r) => assert_eq!((r.generation, r.step), (3, 1)),
            other => panic!("expected ready, got {other:?}"),
        }
    }
    assert_eq!(
        models.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "only the joiner built a model"
    );
    let docs2 = common::synthetic_documents(&[12, 33, 20, 9, 15, 28], 10);
    let total2 = PackedBatch::from_documents(&docs2).loss_tokens();
    for (rank, r) in all.iter().enumerate() {
        let mine: Vec<_> = docs2.iter().skip(rank).step_by(3).cloned().collect();
        r.submit(Work::Plan(Box::new(wire::StepPlan {
            job_id: "j".into(),
            generation: 3,
            step: 2,
            rank: rank as u32,
            lr: 1e-3,
            normalizers: Some(wire::Normalizers {
                loss_tokens: total2,
                ..Default::default()
            }),
            microbatches: vec![common::to_wire(&mine)],
            kind: wire::PlanKind::Train as i32,
            ..Default::default()
        })));
    }
    let mut norms = Vec::new();
    for _ in 0..3 {
        let Msg::StepResult(r) = recv(&mut rx) else {
            panic!("expected a step result");
        };
        norms.push(r.sums.unwrap().grad_norm);
    }
    single
        .microbatch(0, &PackedBatch::from_documents(&docs2), total2)
        .unwrap();
    let norm2 = single.optimizer_step(1e-3).unwrap().grad_norm;
    for n in &norms {
        assert!((n - norm2).abs() <= 1e-5 * norm2, "{n} vs {norm2}");
    }
    let ckpt2 = dir.path().join("step-2");
    for r in &all {
        r.submit(Work::Checkpoint(wire::CheckpointRequest {
            job_id: "j".into(),
            step: 2,
            dir: ckpt2.display().to_string(),
            cursor: None,
        }));
    }
    for _ in 0..3 {
        assert!(matches!(recv(&mut rx), Msg::CheckpointDone(c) if c.step == 2));
    }
    accrue_checkpoint::verify(&ckpt2).unwrap();
    let restored = ReplicatedTrainer::single(&cfg, Some(&ckpt2)).unwrap();
    let (w, n) = common::worst_rel(
        &restored.named_parameters(),
        &common::snapshot(&single.named_parameters()),
    );
    assert!(w <= 1e-5, "after the join, parameter {n} differs by {w:e}");
    third.shutdown();
    for r in runners {
        r.shutdown();
    }
}

/// Generation on two fsdp runners (issue 17): every rank gets the round's
/// plan, rank 1 with nothing to generate; both gather the model, rank 0
/// answers with what the job's initial weights give, rank 1 with nothing.
/// A round that rank 1 refuses (another policy version) fails on both
/// ranks, naming why, instead of leaving rank 0 waiting in the gather.
#[test]
fn two_fsdp_runners_gather_the_policy_for_a_round_and_fail_together() {
    use accrue_worker::generate::{generate, Request, SamplingParams};
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("config.json");
    std::fs::write(&cfg_path, common::TINY_CONFIG).unwrap();
    let extra = format!(
        "config = \"{}\"\n[parallel]\nsharding = \"fsdp\"\n",
        cfg_path.display()
    );
    let job = common::job_definition("random", &extra);
    let conn = connector(Arc::new(Mutex::new(Vec::new())));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runners: Vec<Runner> = (0..2)
        .map(|_| {
            Runner::start(
                RunnerConfig {
                    factory: default_factory(),
                    connector: conn.clone(),
                    listener: Some(std::net::TcpListener::bind("127.0.0.1:0").unwrap()),
                    device: tch::Device::Cpu,
                },
                tx.clone(),
            )
        })
        .collect();
    for (rank, r) in runners.iter().enumerate() {
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 1,
            rank: rank as u32,
            world_size: 2,
            job: Some(job.clone()),
            step: 0,
            ..Default::default()
        })));
    }
    for _ in 0..2 {
        assert!(matches!(recv(&mut rx), Msg::Ready(r) if r.generation == 1));
    }
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 33, 2], vec![250], vec![9, 9, 120, 7, 64, 3]];
    let plan = |rank: u32, policy_version: u64, prompts: &[Vec<u32>]| wire::GeneratePlan {
        job_id: "j".into(),
        generation: 1,
        round: 2,
        rank,
        policy_version,
        sampling: Some(wire::SamplingParams {
            max_new_tokens: 5,
            max_batch: 2,
            ..Default::default()
        }),
        requests: prompts
            .iter()
            .enumerate()
            .map(|(i, p)| wire::GenerateRequest {
                prompt_id: format!("p:{i}"),
                sample: 0,
                prompt_ids: accrue_proto::pack_u32(p),
                seed: 3 + i as u64,
            })
            .collect(),
    };
    runners[0].submit(Work::Generate(Box::new(plan(0, 0, &prompts))));
    runners[1].submit(Work::Generate(Box::new(plan(1, 0, &[]))));
    let mut results = [None, None];
    for _ in 0..2 {
        match recv(&mut rx) {
            Msg::GenerateResult(r) => {
                let rank = r.rank as usize;
                results[rank] = Some(r);
            }
            m => panic!("expected a generate result, got {m:?}"),
        }
    }
    let [Some(r0), Some(r1)] = results else {
        panic!("both ranks answer");
    };
    assert!(r1.completions.is_empty());
    let cfg = common::random_job(dir.path(), "");
    let single = ReplicatedTrainer::single(&cfg, None).unwrap();
    let reqs: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.iter().map(|&t| i64::from(t)).collect(),
            seed: 3 + i as u64,
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: 5,
        max_batch: 2,
        ..SamplingParams::default()
    };
    let want = generate(single.model(), &params, &reqs).unwrap();
    assert_eq!(r0.completions.len(), 3);
    for (c, w) in r0.completions.iter().zip(&want) {
        let ids: Vec<i64> = accrue_proto::unpack_u32(&c.token_ids)
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect();
        assert_eq!(ids, w.tokens, "{}", c.prompt_id);
    }

    runners[0].submit(Work::Generate(Box::new(plan(0, 0, &prompts))));
    runners[1].submit(Work::Generate(Box::new(plan(1, 5, &prompts[..1]))));
    let mut errors = [None, None];
    for _ in 0..2 {
        match recv(&mut rx) {
            Msg::Error(e) => {
                let rank = usize::from(e.message.contains("policy version 5"));
                errors[rank] = Some(e);
            }
            m => panic!("expected an error, got {m:?}"),
        }
    }
    let [Some(e0), Some(e1)] = errors else {
        panic!("both ranks fail: {errors:?}");
    };
    assert_eq!(e1.kind, wire::ErrorKind::InvalidPlan as i32);
    assert!(e0.message.contains("1 other rank"), "{}", e0.message);
    assert_eq!((e0.step, e1.step), (2, 2), "errors carry the round");
    for r in runners {
        r.shutdown();
    }
}
