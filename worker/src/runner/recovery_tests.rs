//! Runner tests of recovery (issue 6) with fake trainers: restore
//! verification (RESTORE_FAILED naming the file), checkpoints written in
//! the background while training goes on, an abort interrupting a step
//! blocked in a ring collective on a frozen peer, held-state mismatch.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, StepNorms};
use crate::collective::Collective;
use crate::train::{CheckpointWrite, StepStats};
use crate::train::{Checkpointing, Membership, Passes, Trainer};
use crate::wire;
use crate::wire::worker_message::Msg;

/// A complete one-rank checkpoint of `step` (fake model file, marker,
/// manifest) in `dir`.
pub(super) fn complete_checkpoint(dir: &Path, step: u64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), b"weights").unwrap();
    accrue_checkpoint::write_marker(dir, 0, 1, &["model.safetensors".into()]).unwrap();
    let m = accrue_checkpoint::Manifest {
        job: "j".into(),
        name: "t".into(),
        step,
        cursor: accrue_checkpoint::Cursor::default(),
        world_size: 1,
        generation: 1,
    };
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
}

/// Sleeps `compute` per microbatch (optionally in an all-reduce on its
/// collective), writes checkpoints slowly; counts what happened.
struct Slow {
    coll: Option<Box<dyn Collective>>,
    reduce: bool,
    write_delay: Duration,
    zero_grads: Arc<AtomicUsize>,
    steps: Arc<AtomicUsize>,
    /// A bug outside any plan: the snapshot panics.
    panic_on_checkpoint: bool,
}

impl Passes for Slow {
    fn train_microbatch(
        &mut self,
        _: usize,
        _: &PackedBatch,
        _: &MicrobatchMeta,
        _: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        if self.reduce {
            let mut t = tch::Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
            if let Some(c) = self.coll.as_mut() {
                c.all_reduce_sum(&mut t)?;
            }
        }
        Ok(MicrobatchOutcome {
            loss_tokens: 1,
            tokens: 2,
            loss_sum: 1.0,
            ..Default::default()
        })
    }

    fn zero_grad(&mut self) {
        self.zero_grads.fetch_add(1, Ordering::SeqCst);
    }

    fn grads_finite(&self) -> bool {
        true
    }
}

impl Membership for Slow {
    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        self.coll = Some(coll);
        Ok(())
    }

    fn group(&mut self) -> &mut dyn Collective {
        self.coll.as_deref_mut().expect("a collective")
    }
}

impl Checkpointing for Slow {
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        assert!(
            !self.panic_on_checkpoint,
            "index out of range in the snapshot"
        );
        let delay = self.write_delay;
        Ok(Box::new(move |dir: &Path| {
            std::thread::sleep(delay);
            std::fs::write(dir.join("model.safetensors"), b"w")?;
            Ok(vec!["model.safetensors".into()])
        }))
    }
}

impl Trainer for Slow {
    fn optimizer_step(&mut self, _: f64) -> anyhow::Result<StepStats> {
        self.steps.fetch_add(1, Ordering::SeqCst);
        Ok(StepStats { grad_norm: 1.0 })
    }
}

struct Counters {
    zero_grads: Arc<AtomicUsize>,
    steps: Arc<AtomicUsize>,
}

fn slow_factory(reduce: bool, write_delay: Duration) -> (Factory, Counters) {
    factory_of(reduce, write_delay, false)
}

fn factory_of(
    reduce: bool,
    write_delay: Duration,
    panic_on_checkpoint: bool,
) -> (Factory, Counters) {
    let c = Counters {
        zero_grads: Arc::default(),
        steps: Arc::default(),
    };
    let (z, s) = (c.zero_grads.clone(), c.steps.clone());
    let f: Factory = Arc::new(move |_, _, coll| {
        Ok(Box::new(Slow {
            coll: Some(coll),
            reduce,
            write_delay,
            zero_grads: z.clone(),
            steps: s.clone(),
            panic_on_checkpoint,
        }) as Box<dyn Trainer>)
    });
    (f, c)
}

fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>) -> Msg {
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        if let Ok(m) = rx.try_recv() {
            return m.msg.unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("no message from the runner");
}

fn one_mb_plan(generation: u64, step: u64) -> wire::StepPlan {
    let mb = wire::Microbatch {
        token_ids: accrue_proto::pack_u32(&[1, 2]),
        labels: accrue_proto::pack_i32(&[-100, 2]),
        cu_seq_lens: vec![0, 2],
        sequences: vec![wire::PackedSequence {
            doc_id: format!("d:{step}"),
            ..Default::default()
        }],
        ..Default::default()
    };
    wire::StepPlan {
        job_id: "j".into(),
        generation,
        step,
        lr: 0.1,
        normalizers: Some(wire::Normalizers {
            loss_tokens: 1,
            ..Default::default()
        }),
        microbatches: vec![mb],
        kind: wire::PlanKind::Train as i32,
        ..Default::default()
    }
}

fn configure(step: u64, restore_from: &str) -> Work {
    Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 1,
        world_size: 1,
        job: Some(crate::convert::testing::definition()),
        step,
        restore_from: restore_from.into(),
        ..Default::default()
    }))
}

#[test]
fn restoring_from_an_incomplete_or_corrupt_checkpoint_is_restore_failed_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (f, _) = slow_factory(false, Duration::ZERO);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(f, tx);
    let expect_failure = |rx: &mut _, needle: &str| {
        let Msg::Error(e) = next(rx) else {
            panic!("expected RESTORE_FAILED");
        };
        assert_eq!(
            e.kind,
            wire::ErrorKind::RestoreFailed as i32,
            "{}",
            e.message
        );
        assert_eq!(e.step, 4);
        assert!(e.message.contains(needle), "{needle}: {}", e.message);
    };
    // No manifest (a crash before rank 0 finished): incomplete.
    let a = dir.path().join("step-4a");
    complete_checkpoint(&a, 4);
    std::fs::remove_file(a.join("manifest.json")).unwrap();
    runner.submit(configure(4, &a.display().to_string()));
    expect_failure(&mut rx, "manifest.json");
    // A rank's marker missing: incomplete.
    let b = dir.path().join("step-4b");
    complete_checkpoint(&b, 4);
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(b.join("manifest.json")).unwrap()).unwrap();
    m["world_size"] = 2.into();
    std::fs::write(b.join("manifest.json"), m.to_string()).unwrap();
    runner.submit(configure(4, &b.display().to_string()));
    expect_failure(&mut rx, "rank-1.json");
    // A corrupted shard: named, with what is wrong.
    let c = dir.path().join("step-4c");
    complete_checkpoint(&c, 4);
    std::fs::write(c.join("model.safetensors"), b"weighTs").unwrap();
    runner.submit(configure(4, &c.display().to_string()));
    expect_failure(&mut rx, "model.safetensors: checksum");
    assert!(
        runner.progress().held().is_none(),
        "no replica after a failed restore"
    );
    // The good one restores.
    let d = dir.path().join("step-4d");
    complete_checkpoint(&d, 4);
    runner.submit(configure(4, &d.display().to_string()));
    assert!(matches!(next(&mut rx), Msg::Ready(r) if r.step == 4));
    let held = runner.progress().held().unwrap();
    assert_eq!(
        (held.job_id.as_str(), held.step, held.world_size),
        ("j", 4, 1)
    );
    runner.shutdown();
}

#[test]
fn training_goes_on_while_a_checkpoint_is_written_and_shutdown_waits_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let (f, counters) = slow_factory(false, Duration::from_millis(1500));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(f, tx);
    runner.submit(configure(0, ""));
    assert!(matches!(next(&mut rx), Msg::Ready(_)));
    let ck = dir.path().join("step-0");
    runner.submit(Work::Checkpoint(wire::CheckpointRequest {
        job_id: "j".into(),
        step: 0,
        dir: ck.display().to_string(),
        cursor: None,
    }));
    let asked = Instant::now();
    for step in 1..=3 {
        runner.submit(Work::Plan(Box::new(one_mb_plan(1, step))));
    }
    for step in 1..=3 {
        let Msg::StepResult(r) = next(&mut rx) else {
            panic!("expected step {step}'s result before the checkpoint is written");
        };
        assert_eq!(r.step, step);
    }
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "three steps ran during the write"
    );
    assert!(
        !ck.join("rank-0.json").exists(),
        "the write is still in flight"
    );
    assert!(runner.pending() > 0, "a write in flight counts as pending");
    runner.shutdown();
    assert!(matches!(next(&mut rx), Msg::CheckpointDone(c) if c.step == 0));
    accrue_checkpoint::verify(&ck).unwrap();
    assert_eq!(counters.steps.load(Ordering::SeqCst), 3);
}

#[test]
fn an_abort_interrupts_a_collective_blocked_on_a_frozen_peer() {
    // Rank 1 joins the generation (the ring and the members' exchange)
    // and then freezes, as a SIGSTOPped worker would.
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let peers = vec![
        l0.local_addr().unwrap().to_string(),
        l1.local_addr().unwrap().to_string(),
    ];
    let p1 = peers.clone();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let frozen = std::thread::spawn(move || {
        let join = crate::collective::join::Join {
            rank: 1,
            world: 2,
            peers: &p1,
            generation: 7,
            timeout: Duration::from_secs(60),
            device: tch::Device::Cpu,
            choice: crate::config::CollectiveChoice::Auto,
            link: crate::runner::work::link_key(&wire::Configure {
                link_key: vec![9; 32],
                ..Default::default()
            })
            .unwrap(),
        };
        let ring = crate::collective::join::join(&l1, &join).unwrap();
        let _ = release_rx.recv();
        drop(ring);
    });
    let (f, counters) = slow_factory(true, Duration::ZERO);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut cfg = RunnerConfig::new(f);
    cfg.listener = Some(l0);
    let runner = Runner::start(cfg, tx);
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 7,
        world_size: 2,
        rank: 0,
        peers: peers
            .iter()
            .enumerate()
            .map(|(r, a)| wire::Peer {
                rank: r as u32,
                collective_addr: a.clone(),
                ..Default::default()
            })
            .collect(),
        job: Some(crate::convert::testing::definition()),
        ..Default::default()
    })));
    assert!(matches!(next(&mut rx), Msg::Ready(r) if r.generation == 7));
    runner.submit(Work::Plan(Box::new(one_mb_plan(7, 1))));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(runner.pending(), 1, "blocked in the all-reduce");
    let at = Instant::now();
    runner.submit(Work::Abort(wire::Abort {
        job_id: "j".into(),
        generation: 7,
        step: 1,
        detail: "peer lost".into(),
        reason: wire::AbortReason::WorkerLost as i32,
    }));
    while runner.pending() > 0 {
        assert!(
            at.elapsed() < Duration::from_secs(2),
            "the abort did not interrupt the step"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = at.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(rx.try_recv().is_err(), "an aborted step reports nothing");
    assert_eq!(
        counters.steps.load(Ordering::SeqCst),
        0,
        "parameters untouched"
    );
    assert!(
        counters.zero_grads.load(Ordering::SeqCst) >= 2,
        "gradients dropped"
    );
    release_tx.send(()).unwrap();
    frozen.join().unwrap();
    runner.shutdown();
}

#[test]
fn a_holder_whose_state_does_not_match_its_prior_is_a_state_sync_error() {
    let (f, _) = slow_factory(false, Duration::ZERO);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(f, tx);
    runner.submit(configure(0, ""));
    assert!(matches!(next(&mut rx), Msg::Ready(_)));
    runner.submit(Work::Plan(Box::new(one_mb_plan(1, 1))));
    assert!(matches!(next(&mut rx), Msg::StepResult(_)));
    // The coordinator believes this worker holds step 2.
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 2,
        world_size: 1,
        job: Some(crate::convert::testing::definition()),
        step: 2,
        peers: vec![wire::Peer {
            rank: 0,
            prior: Some(wire::HeldState {
                job_id: "j".into(),
                step: 2,
                world_size: 1,
                rank: 0,
                generation: 1,
            }),
            ..Default::default()
        }],
        ..Default::default()
    })));
    let Msg::Error(e) = next(&mut rx) else {
        panic!("expected STATE_SYNC");
    };
    assert_eq!(e.kind, wire::ErrorKind::StateSync as i32, "{}", e.message);
    assert!(
        e.message.contains("holds job j step 2") && e.message.contains("but it holds job j step 1"),
        "{}",
        e.message
    );
    runner.shutdown();
}

/// Steps and generations restart at 1 for every job: a worker kept across
/// jobs (`--exit-on-release false`) must not take the previous job's
/// abort of (generation 1, step 1) for the next job's step 1, or that step
/// would be silently dropped and the job would wait for it forever.
#[test]
fn an_abort_of_one_jobs_step_does_not_abort_the_same_step_of_the_next_job() {
    let (f, counters) = slow_factory(false, Duration::ZERO);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(f, tx);
    let configure_job = |job: &str| {
        Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: job.into(),
            generation: 1,
            world_size: 1,
            job: Some(crate::convert::testing::definition()),
            ..Default::default()
        }))
    };
    runner.submit(configure_job("first"));
    assert!(matches!(next(&mut rx), Msg::Ready(_)));
    runner.submit(Work::Abort(wire::Abort {
        job_id: "first".into(),
        generation: 1,
        step: 1,
        detail: "job failed".into(),
        reason: wire::AbortReason::JobFailed as i32,
    }));
    runner.submit(configure_job("second"));
    assert!(matches!(next(&mut rx), Msg::Ready(r) if r.job_id == "second"));
    let mut plan = one_mb_plan(1, 1);
    plan.job_id = "second".into();
    runner.submit(Work::Plan(Box::new(plan)));
    let Msg::StepResult(r) = next(&mut rx) else {
        panic!("the second job's step 1 must run and report");
    };
    assert_eq!((r.job_id.as_str(), r.step), ("second", 1));
    assert_eq!(counters.steps.load(Ordering::SeqCst), 1);
    runner.shutdown();
}

/// A panic outside a plan (here in a checkpoint snapshot) is reported as
/// the job's error naming what was being done, and the runner says it died
/// (the session then exits the process non-zero): never a worker that
/// heartbeats with a dead training thread.
#[test]
fn a_panic_outside_a_plan_is_reported_and_the_runner_says_it_died() {
    let (f, _) = factory_of(false, Duration::ZERO, true);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(f, tx);
    runner.submit(configure(0, ""));
    assert!(matches!(next(&mut rx), Msg::Ready(_)));
    assert_eq!(runner.died(), None);
    runner.submit(Work::Checkpoint(wire::CheckpointRequest {
        job_id: "j".into(),
        step: 0,
        dir: "/nonexistent/step-0".into(),
        cursor: None,
    }));
    let Msg::Error(e) = next(&mut rx) else {
        panic!("expected the job's error");
    };
    assert_eq!(e.kind, wire::ErrorKind::Internal as i32);
    assert!(
        e.message
            .contains("panicked handling the checkpoint of step 0"),
        "{}",
        e.message
    );
    assert!(
        e.message.contains("index out of range in the snapshot"),
        "{}",
        e.message
    );
    let until = Instant::now() + Duration::from_secs(5);
    while runner.died().is_none() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(runner.died().unwrap().contains("checkpoint of step 0"));
    assert!(
        runner.progress().held().is_none(),
        "no replica is reported held"
    );
    runner.shutdown();
}
