//! Runner tests with a fake trainer: sums, padding, error kinds, aborts,
//! and the thread protocol (configure → ready, plan → result, checkpoint).

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::step::{run_step, StepOutcome};
use super::*;
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::collective::Solo;
use crate::collective::{Collective, CollectiveError};
use crate::error::StepError;
use crate::train::{CheckpointWrite, StepStats};
use crate::train::{Checkpointing, Membership, Passes, Trainer};
use crate::wire;
use crate::wire::worker_message::Msg;

#[derive(Debug, Default, Clone)]
struct Calls {
    microbatches: Vec<(usize, u64)>,
    zero_grads: usize,
    steps: Vec<f64>,
}

/// Loss 2.0 per loss token (tokens after the first of each sequence).
struct Fake {
    calls: Arc<Mutex<Calls>>,
    /// Microbatch `i` fails with the error `f` makes.
    fail_at: Option<(usize, fn() -> anyhow::Error)>,
    fail_optimizer: bool,
    delay: Duration,
    /// The generation's collective, once configured with one.
    coll: Option<Box<dyn Collective>>,
    solo: Solo,
}

impl Fake {
    fn new() -> (Fake, Arc<Mutex<Calls>>) {
        let calls = Arc::new(Mutex::new(Calls::default()));
        (
            Fake {
                calls: calls.clone(),
                fail_at: None,
                fail_optimizer: false,
                delay: Duration::ZERO,
                coll: None,
                solo: Solo,
            },
            calls,
        )
    }
}

impl Passes for Fake {
    fn train_microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        _: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let global = norms.loss_tokens;
        std::thread::sleep(self.delay);
        if let Some((i, error)) = self.fail_at {
            if i == index {
                return Err(error());
            }
        }
        self.calls
            .lock()
            .unwrap()
            .microbatches
            .push((index, global));
        let loss_tokens = mb.labels.iter().filter(|&&l| l != -100).count() as u64;
        Ok(MicrobatchOutcome {
            loss_sum: 2.0 * loss_tokens as f64,
            loss_tokens,
            tokens: mb.labels.len() as u64,
            ..Default::default()
        })
    }

    fn zero_grad(&mut self) {
        self.calls.lock().unwrap().zero_grads += 1;
    }

    fn grads_finite(&self) -> bool {
        true
    }
}

impl Membership for Fake {
    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        self.coll = Some(coll);
        Ok(())
    }

    fn group(&mut self) -> &mut dyn Collective {
        match &mut self.coll {
            Some(c) => c.as_mut(),
            None => &mut self.solo,
        }
    }
}

impl Checkpointing for Fake {
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        Ok(Box::new(|dir: &Path| {
            std::fs::write(dir.join("model.safetensors"), b"fake")?;
            Ok(vec!["model.safetensors".to_string()])
        }))
    }
}

impl Trainer for Fake {
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        if self.fail_optimizer {
            return Err(StepError::non_finite("gradient norm NaN"));
        }
        self.calls.lock().unwrap().steps.push(lr);
        Ok(StepStats { grad_norm: 0.75 })
    }
}

fn mb(docs: &[(&str, usize)]) -> wire::Microbatch {
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    let mut cu = vec![0u32];
    let mut seqs = Vec::new();
    for (doc, len) in docs {
        for t in 0..*len {
            ids.push(t as u32);
            labels.push(if t == 0 { -100 } else { t as i32 });
        }
        cu.push(ids.len() as u32);
        // A doc id's second sequence is its pair's rejected side (role 1).
        let role = seqs
            .iter()
            .filter(|s: &&wire::PackedSequence| s.doc_id == *doc)
            .count() as u32;
        seqs.push(wire::PackedSequence {
            doc_id: (*doc).into(),
            role,
            ..Default::default()
        });
    }
    wire::Microbatch {
        routing: Default::default(),
        ref_logprobs: Vec::new(),
        token_ids: accrue_proto::pack_u32(&ids),
        labels: accrue_proto::pack_i32(&labels),
        cu_seq_lens: cu,
        sequences: seqs,
        old_logprobs: Vec::new(),
        source: 0,
        loss_mask: Vec::new(),
    }
}

fn plan(step: u64, mbs: Vec<wire::Microbatch>) -> wire::StepPlan {
    wire::StepPlan {
        replay: false,
        job_id: "j".into(),
        generation: 1,
        step,
        rank: 0,
        lr: 0.01,
        normalizers: Some(wire::Normalizers {
            loss_tokens: 99,
            ..Default::default()
        }),
        microbatches: mbs,
        cursor_after: None,
        kind: wire::PlanKind::Train as i32,
        max_tokens: 16,
    }
}

#[test]
fn a_plan_reports_sums_and_counts_padding_microbatches() {
    let (mut fake, calls) = Fake::new();
    // A DPO-like pair puts one doc id in two sequences (roles 0 and 1):
    // counted once.
    let p = plan(
        3,
        vec![
            mb(&[("a:1", 5), ("b:2", 3)]),
            wire::Microbatch::default(),
            mb(&[("c:3", 4), ("c:3", 2)]),
        ],
    );
    let StepOutcome::Done(s) = run_step(&mut fake, &p, 0.5, &|| false) else {
        panic!("step failed");
    };
    assert_eq!(s.tokens, 14);
    assert_eq!(s.loss_tokens, 10, "one unlabelled first token per sequence");
    assert_eq!(s.loss_sum, 20.0);
    assert_eq!(s.documents, 3);
    assert_eq!(s.microbatches, 3, "the padding microbatch counts");
    assert_eq!(s.padding_tokens, (16 - 8) + (16 - 6));
    assert_eq!(s.grad_norm, 0.75);
    assert_eq!(s.idle_s, 0.5);
    let c = calls.lock().unwrap();
    assert_eq!(
        c.microbatches,
        vec![(0, 99), (2, 99)],
        "empty microbatch skipped; every call gets the step's global T"
    );
    assert_eq!(c.steps, vec![0.01]);
    assert_eq!(c.zero_grads, 0);
}

#[test]
fn a_non_finite_loss_fails_the_step_naming_step_and_microbatch() {
    let (mut fake, calls) = Fake::new();
    fake.fail_at = Some((1, || StepError::non_finite("loss NaN in loss chunk 0")));
    let p = plan(7, vec![mb(&[("a:1", 3)]), mb(&[("b:1", 3)])]);
    let StepOutcome::Failed(e) = run_step(&mut fake, &p, 0.0, &|| false) else {
        panic!("expected a failure");
    };
    assert_eq!(e.kind, wire::ErrorKind::NonFinite as i32);
    assert!(e.message.contains("step 7, microbatch 1"), "{}", e.message);
    assert_eq!((e.step, e.generation), (7, 1));
    let c = calls.lock().unwrap();
    assert!(c.steps.is_empty(), "no optimizer step after a failure");
    assert_eq!(c.zero_grads, 1, "the partial gradients are dropped");
}

/// The kind comes from the error's type, never its words.
#[test]
fn failures_carry_their_typed_kind_and_optimizer_failures_name_the_step() {
    let p = plan(2, vec![mb(&[("a:1", 3)])]);
    let kind_of = |error: fn() -> anyhow::Error| {
        let (mut fake, _) = Fake::new();
        fake.fail_at = Some((0, error));
        match run_step(&mut fake, &p, 0.0, &|| false) {
            StepOutcome::Failed(e) => wire::ErrorKind::try_from(e.kind).unwrap(),
            other => panic!("expected a failure, got {other:?}"),
        }
    };
    assert_eq!(
        kind_of(|| anyhow::anyhow!("a non-finite out of memory in the data")),
        wire::ErrorKind::Internal,
        "words alone classify nothing"
    );
    assert_eq!(
        kind_of(|| StepError::OutOfMemory("2 GiB".into()).into()),
        wire::ErrorKind::OutOfMemory
    );
    assert_eq!(
        kind_of(|| StepError::data("token 900 outside the vocabulary")),
        wire::ErrorKind::Data
    );
    // A microbatch the plan got wrong is refused before the trainer runs.
    let (mut fake, calls) = Fake::new();
    let mut bad = plan(2, vec![mb(&[("a:1", 3)])]);
    bad.microbatches[0].cu_seq_lens = vec![0, 2];
    let StepOutcome::Failed(e) = run_step(&mut fake, &bad, 0.0, &|| false) else {
        panic!("expected a failure");
    };
    assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
    assert!(e.message.contains("cu_seq_lens"), "{}", e.message);
    assert!(calls.lock().unwrap().microbatches.is_empty());

    let (mut fake, _) = Fake::new();
    fake.fail_optimizer = true;
    let StepOutcome::Failed(e) = run_step(&mut fake, &p, 0.0, &|| false) else {
        panic!("expected a failure");
    };
    assert_eq!(e.kind, wire::ErrorKind::NonFinite as i32);
    assert!(
        e.message.starts_with("step 2, optimizer step"),
        "{}",
        e.message
    );
}

#[test]
fn an_abort_between_microbatches_drops_the_gradients() {
    let (mut fake, calls) = Fake::new();
    let seen = AtomicBool::new(false);
    // Aborted once the first microbatch has run.
    let aborted = || seen.swap(true, Ordering::SeqCst);
    let p = plan(4, vec![mb(&[("a:1", 3)]), mb(&[("b:1", 3)])]);
    assert_eq!(run_step(&mut fake, &p, 0.0, &aborted), StepOutcome::Aborted);
    let c = calls.lock().unwrap();
    assert_eq!(c.microbatches.len(), 1);
    assert!(c.steps.is_empty());
    assert_eq!(c.zero_grads, 1);
}

/// Regression (issue 13): after `accrue set --max-tokens` the worker
/// counted padding against the submitted value; the plan's budget is the
/// one its step was packed with.
#[test]
fn padding_is_counted_against_the_plans_max_tokens() {
    let (mut fake, _) = Fake::new();
    let mut p = plan(3, vec![mb(&[("a:1", 5), ("b:2", 3)])]);
    let padding = |fake: &mut Fake, p: &wire::StepPlan| match run_step(fake, p, 0.0, &|| false) {
        StepOutcome::Done(s) => s.padding_tokens,
        other => panic!("step failed: {other:?}"),
    };
    assert_eq!(padding(&mut fake, &p), 16 - 8);
    p.max_tokens = 64;
    assert_eq!(padding(&mut fake, &p), 64 - 8);
}

/// A plan without normalisers is refused, not run with zeros.
#[test]
fn a_plan_without_normalizers_is_an_invalid_plan() {
    let (mut fake, calls) = Fake::new();
    let mut p = plan(3, vec![mb(&[("a:1", 5)])]);
    p.normalizers = None;
    let StepOutcome::Failed(e) = run_step(&mut fake, &p, 0.0, &|| false) else {
        panic!("expected a failure");
    };
    assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
    assert!(e.message.contains("normalizers"), "{}", e.message);
    assert!(calls.lock().unwrap().microbatches.is_empty(), "nothing ran");
}

fn msg(rx: &mut tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>) -> Msg {
    for _ in 0..500 {
        if let Ok(m) = rx.try_recv() {
            return m.msg.unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no message from the runner");
}

#[test]
fn the_thread_configures_runs_checkpoints_and_drains_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(Mutex::new(Calls::default()));
    let c2 = calls.clone();
    let restores = Arc::new(Mutex::new(Vec::new()));
    let r2 = restores.clone();
    let factory: Factory = Arc::new(move |cfg, restore, _| {
        assert_eq!(cfg.name, "t");
        r2.lock().unwrap().push(restore.map(Path::to_path_buf));
        Ok(Box::new(Fake {
            calls: c2.clone(),
            fail_at: None,
            fail_optimizer: false,
            delay: Duration::from_millis(50),
            coll: None,
            solo: Solo,
        }) as Box<dyn Trainer>)
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(factory, tx);
    let ckpt5 = dir.path().join("step-5");
    super::recovery_tests::complete_checkpoint(&ckpt5, 5);
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 1,
        world_size: 1,
        job: Some(crate::convert::testing::definition()),
        step: 5,
        restore_from: ckpt5.display().to_string(),
        ..Default::default()
    })));
    assert!(matches!(msg(&mut rx), Msg::Ready(r) if r.step == 5 && r.generation == 1));
    assert_eq!(*restores.lock().unwrap(), vec![Some(ckpt5)]);

    let mut p6 = plan(6, vec![mb(&[("a:1", 4)])]);
    p6.max_tokens = 32;
    runner.submit(Work::Plan(Box::new(p6)));
    let ckpt = dir.path().join("step-6");
    runner.submit(Work::Checkpoint(wire::CheckpointRequest {
        job_id: "j".into(),
        step: 6,
        dir: ckpt.display().to_string(),
        cursor: Some(wire::DataCursor {
            epoch: 1,
            position: 8,
            overflow: vec![3],
            ..Default::default()
        }),
    }));
    // Shutting down still finishes the queued plan and checkpoint.
    runner.shutdown();
    let Msg::StepResult(r) = msg(&mut rx) else {
        panic!("expected a step result");
    };
    let s = r.sums.unwrap();
    assert_eq!((r.step, s.padding_tokens), (6, 28));
    assert!(matches!(msg(&mut rx), Msg::CheckpointDone(c) if c.step == 6));
    let m: accrue_checkpoint::Manifest =
        serde_json::from_slice(&std::fs::read(ckpt.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        m,
        accrue_checkpoint::Manifest {
            job: "j".into(),
            name: "t".into(),
            step: 6,
            cursor: accrue_checkpoint::Cursor {
                epoch: 1,
                position: 8,
                overflow: vec![3],
                ..Default::default()
            },
            world_size: 1,
            generation: 1,
        }
    );
    assert!(ckpt.join("model.safetensors").is_file());
    accrue_checkpoint::verify(&ckpt).expect("a complete checkpoint");
}

#[test]
fn reconfiguring_at_the_held_step_keeps_the_replica() {
    let builds = Arc::new(AtomicU64::new(0));
    let b2 = builds.clone();
    let factory: Factory = Arc::new(move |_, _, _| {
        b2.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(Fake::new().0) as Box<dyn Trainer>)
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(factory, tx);
    let configure = |generation, step| {
        Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation,
            world_size: 1,
            job: Some(crate::convert::testing::definition()),
            step,
            ..Default::default()
        }))
    };
    runner.submit(configure(1, 0));
    msg(&mut rx);
    runner.submit(Work::Plan(Box::new(plan(1, vec![mb(&[("a:1", 4)])]))));
    msg(&mut rx);
    runner.submit(configure(2, 1));
    assert!(matches!(msg(&mut rx), Msg::Ready(r) if r.generation == 2 && r.step == 1));
    assert_eq!(
        builds.load(Ordering::SeqCst),
        1,
        "same job, same step: kept"
    );
    runner.submit(configure(3, 0));
    msg(&mut rx);
    assert_eq!(builds.load(Ordering::SeqCst), 2, "an older step: rebuilt");
    assert_eq!(runner.progress().generation.load(Ordering::SeqCst), 3);
    runner.shutdown();
}

#[test]
fn a_missing_or_incomplete_job_is_an_invalid_plan_error() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(default_factory(), tx);
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        ..Default::default()
    })));
    let Msg::Error(e) = msg(&mut rx) else {
        panic!("expected an error");
    };
    assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
    assert!(e.message.contains("job: missing"), "{}", e.message);
    let mut job = crate::convert::testing::definition();
    job.sharding = wire::Sharding::Unspecified as i32;
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        job: Some(job),
        ..Default::default()
    })));
    let Msg::Error(e) = msg(&mut rx) else {
        panic!("expected an error");
    };
    assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
    assert!(e.message.contains("job.sharding"), "{}", e.message);
    runner.shutdown();
}

#[test]
fn more_than_one_rank_with_bad_peers_fails_configure_naming_the_collective() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut cfg = RunnerConfig::new(default_factory());
    cfg.listener = Some(TcpListener::bind("127.0.0.1:0").unwrap());
    let runner = Runner::start(cfg, tx);
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 4,
        world_size: 2,
        rank: 1,
        job: Some(crate::convert::testing::definition()),
        ..Default::default()
    })));
    let Msg::Error(e) = msg(&mut rx) else {
        panic!("expected an error");
    };
    assert_eq!(e.kind, wire::ErrorKind::CollectiveTimeout as i32);
    assert!(
        e.message.contains("generation 4 as rank 1 of 2") && e.message.contains("0 peers"),
        "{}",
        e.message
    );
    runner.shutdown();
}

/// In-process ranks handed out by rank, as a connector.
fn local_connector(world: usize) -> Connector {
    let ranks: Vec<Option<crate::collective::local::LocalRank>> =
        crate::collective::local::LocalGroup::new(world)
            .into_iter()
            .map(Some)
            .collect();
    let ranks = Mutex::new(ranks);
    Arc::new(move |_, c| {
        let r = ranks.lock().unwrap()[c.rank as usize]
            .take()
            .ok_or_else(|| CollectiveError::Setup(format!("rank {} taken twice", c.rank)))?;
        Ok(Box::new(r) as Box<dyn Collective>)
    })
}

#[test]
fn each_rank_gets_its_collective_and_a_failed_collective_blames_the_peer() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    struct Failing(Solo);
    impl Passes for Failing {
        fn train_microbatch(
            &mut self,
            _: usize,
            _: &PackedBatch,
            _: &MicrobatchMeta,
            _: &StepNorms,
        ) -> anyhow::Result<MicrobatchOutcome> {
            Ok(MicrobatchOutcome::default())
        }

        fn zero_grad(&mut self) {}

        fn grads_finite(&self) -> bool {
            true
        }
    }

    impl Membership for Failing {
        fn set_collective(&mut self, _: Box<dyn Collective>) -> anyhow::Result<()> {
            Ok(())
        }

        fn group(&mut self) -> &mut dyn Collective {
            &mut self.0
        }
    }

    impl Checkpointing for Failing {
        fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
            Ok(Box::new(|_: &Path| Ok(Vec::new())))
        }
    }

    impl Trainer for Failing {
        fn optimizer_step(&mut self, _: f64) -> anyhow::Result<StepStats> {
            Err(anyhow::Error::new(CollectiveError::Timeout {
                op: "all_reduce",
                seq: 3,
                peer: 0,
                secs: 5.0,
            })
            .context("reducing gradients"))
        }
    }
    let factory: Factory = Arc::new(move |_, _, coll| {
        s2.lock().unwrap().push((coll.rank(), coll.world_size()));
        Ok(Box::new(Failing(Solo)) as Box<dyn Trainer>)
    });
    let connector = local_connector(2);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = |tx| {
        Runner::start(
            RunnerConfig {
                factory: factory.clone(),
                connector: connector.clone(),
                listener: Some(TcpListener::bind("127.0.0.1:0").unwrap()),
                device: tch::Device::Cpu,
            },
            tx,
        )
    };
    let runners = [start(tx.clone()), start(tx)];
    for (rank, r) in runners.iter().enumerate() {
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 1,
            world_size: 2,
            rank: rank as u32,
            job: Some(crate::convert::testing::definition()),
            ..Default::default()
        })));
    }
    for _ in 0..2 {
        assert!(matches!(msg(&mut rx), Msg::Ready(_)));
    }
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![(0, 2), (1, 2)]);
    runners[1].submit(Work::Plan(Box::new(plan(1, vec![mb(&[("a:1", 4)])]))));
    let Msg::Error(e) = msg(&mut rx) else {
        panic!("expected an error");
    };
    assert_eq!(e.kind, wire::ErrorKind::CollectiveTimeout as i32);
    assert_eq!(e.peer_rank, Some(0));
    assert!(e.message.contains("timed out"), "{}", e.message);
    for r in runners {
        r.shutdown();
    }
}

/// A trainer with collectives per microbatch (fsdp) runs a reference
/// plan's empty microbatches too (its ranks stay in lockstep); another
/// trainer skips them. Both report the same sums.
#[test]
fn reference_plans_run_empty_microbatches_for_lockstep_trainers() {
    struct Ref {
        lockstep: bool,
        seen: Vec<usize>,
        solo: Solo,
    }
    impl Passes for Ref {
        fn train_microbatch(
            &mut self,
            _: usize,
            _: &PackedBatch,
            _: &MicrobatchMeta,
            _: &StepNorms,
        ) -> anyhow::Result<MicrobatchOutcome> {
            anyhow::bail!("a reference plan trains nothing")
        }

        fn reference_logps(
            &mut self,
            index: usize,
            mb: &PackedBatch,
        ) -> anyhow::Result<Vec<SequenceLogp>> {
            self.seen.push(index);
            let one = SequenceLogp {
                logp: -1.5,
                loss_tokens: 2,
                tokens: Vec::new(),
            };
            Ok(vec![one; mb.documents()])
        }

        fn zero_grad(&mut self) {}

        fn grads_finite(&self) -> bool {
            true
        }

        fn collective_per_microbatch(&self) -> bool {
            self.lockstep
        }
    }

    impl Membership for Ref {
        fn set_collective(&mut self, _: Box<dyn Collective>) -> anyhow::Result<()> {
            Ok(())
        }

        fn group(&mut self) -> &mut dyn Collective {
            &mut self.solo
        }
    }

    impl Checkpointing for Ref {
        fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
            anyhow::bail!("no checkpoint")
        }
    }

    impl Trainer for Ref {
        fn optimizer_step(&mut self, _: f64) -> anyhow::Result<StepStats> {
            anyhow::bail!("a reference plan steps nothing")
        }
    }
    let mut p = plan(
        0,
        vec![
            mb(&[("a", 3)]),
            wire::Microbatch::default(),
            mb(&[("b", 4), ("c", 2)]),
        ],
    );
    // As the coordinator sends it: the document by number, no text.
    let numbered = &mut p.microbatches[2].sequences[0];
    (numbered.doc_id, numbered.doc_file, numbered.doc_line) = (String::new(), 3, 17);
    for (lockstep, want) in [(false, vec![0, 2]), (true, vec![0, 1, 2])] {
        let mut e = Ref {
            lockstep,
            seen: Vec::new(),
            solo: Solo,
        };
        let (sums, logps) = reference::run_reference(&mut e, &p).unwrap();
        assert_eq!(e.seen, want, "lockstep {lockstep}");
        let ids: Vec<&str> = logps.iter().map(|l| l.doc_id.as_str()).collect();
        assert_eq!(
            ids,
            ["a", "3:17", "c"],
            "each log-prob names its document as text"
        );
        assert_eq!((sums.microbatches, sums.documents), (3, 3));
        assert_eq!((sums.tokens, sums.loss_tokens), (9, 6));
    }
}

#[test]
fn a_probe_flags_its_non_finite_microbatches_and_never_steps() {
    let (mut fake, calls) = Fake::new();
    fake.fail_at = Some((1, || StepError::non_finite("loss NaN in loss chunk 0")));
    let mut p = plan(
        4,
        vec![
            mb(&[("a:1", 3)]),
            mb(&[("b:1", 3)]),
            wire::Microbatch::default(),
            mb(&[("c:1", 3), ("d:1", 2)]),
        ],
    );
    p.kind = wire::PlanKind::Probe as i32;
    let (sums, flagged) = super::probe::run_probe(&mut fake, &p, &|| false)
        .unwrap()
        .expect("not aborted");
    assert_eq!(flagged, vec![1]);
    assert_eq!(sums.tokens, 8, "the finite microbatches' tokens");
    let c = calls.lock().unwrap();
    assert!(c.steps.is_empty(), "a probe never steps the optimizer");
    assert_eq!(
        c.microbatches,
        vec![(0, 99), (3, 99)],
        "each microbatch alone, with the failed step's normalisers"
    );
    assert_eq!(c.zero_grads, 4, "zeroed before each microbatch and after");
}

#[test]
fn a_probe_fails_on_anything_but_a_non_finite_value() {
    let (mut fake, calls) = Fake::new();
    fake.fail_at = Some((0, || StepError::data("token 900 outside the vocabulary")));
    let mut p = plan(4, vec![mb(&[("a:1", 3)]), mb(&[("b:1", 3)])]);
    p.kind = wire::PlanKind::Probe as i32;
    let e = super::probe::run_probe(&mut fake, &p, &|| false).unwrap_err();
    assert_eq!(e.kind, wire::ErrorKind::Data as i32);
    assert!(
        e.message.contains("probe of step 4, microbatch 0"),
        "{}",
        e.message
    );
    assert!(calls.lock().unwrap().steps.is_empty());
    // Aborted between microbatches: no answer at all.
    let (mut fake, _) = Fake::new();
    assert_eq!(
        super::probe::run_probe(&mut fake, &p, &|| true).unwrap(),
        None
    );
}

/// Two runners on a real TCP ring, configured with `gather_results`;
/// their answers arrive on the returned receiver.
fn gathering_pair() -> (
    [Runner; 2],
    tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>,
) {
    let factory: Factory = Arc::new(|_, _, coll| {
        let (mut f, _) = Fake::new();
        f.coll = Some(coll);
        Ok(Box::new(f) as Box<dyn Trainer>)
    });
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runners: Vec<Runner> = listeners
        .into_iter()
        .map(|l| {
            Runner::start(
                RunnerConfig {
                    factory: factory.clone(),
                    connector: default_connector(tch::Device::Cpu),
                    listener: Some(l),
                    device: tch::Device::Cpu,
                },
                tx.clone(),
            )
        })
        .collect();
    let runners: [Runner; 2] = runners.try_into().unwrap_or_else(|_| panic!("two runners"));
    for (rank, r) in runners.iter().enumerate() {
        let next = (rank + 1) % 2;
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 1,
            world_size: 2,
            rank: rank as u32,
            next: Some(wire::Peer {
                rank: next as u32,
                worker_id: format!("w{next}"),
                collective_addr: addrs[next].clone(),
                prior: None,
            }),
            job: Some(crate::convert::testing::definition()),
            gather_results: true,
            ..Default::default()
        })));
    }
    for _ in 0..2 {
        assert!(matches!(msg(&mut rx), Msg::Ready(_)));
    }
    (runners, rx)
}

/// Waits until `r` has no work queued or running (at most `limit`).
fn idle_within(r: &Runner, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while r.pending() > 0 {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
fn gathered_train_results_come_once_from_rank_0_with_every_ranks_own_sums() {
    let (runners, mut rx) = gathering_pair();
    let plans = [
        plan(1, vec![mb(&[("a:1", 4), ("a:2", 3)])]),
        wire::StepPlan {
            rank: 1,
            ..plan(1, vec![mb(&[("a:3", 6)]), mb(&[])])
        },
    ];
    // What each rank reports when it sends its own result.
    let own: Vec<wire::MetricSums> = plans
        .iter()
        .map(|p| match run_step(&mut Fake::new().0, p, 0.0, &|| false) {
            StepOutcome::Done(s) => s,
            other => panic!("{other:?}"),
        })
        .collect();
    for (r, p) in runners.iter().zip(&plans) {
        r.submit(Work::Plan(Box::new(p.clone())));
    }
    let Msg::StepResults(b) = msg(&mut rx) else {
        panic!("expected the gathered results");
    };
    assert_eq!((b.job_id.as_str(), b.generation, b.step), ("j", 1, 1));
    assert_eq!(b.results.iter().map(|r| r.rank).collect::<Vec<_>>(), [0, 1]);
    for (got, want) in b.results.iter().zip(&own) {
        let got = got.sums.as_ref().unwrap();
        // Timings differ run to run; every count and sum is the rank's own.
        let counts = |s: &wire::MetricSums| {
            (
                s.loss_sum,
                s.loss_tokens,
                s.tokens,
                s.documents,
                s.microbatches,
                s.grad_norm,
            )
        };
        assert_eq!(counts(got), counts(want));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(rx.try_recv().is_err(), "rank 1 sends nothing of its own");
    for r in runners {
        r.shutdown();
    }
}

#[test]
fn an_abort_interrupts_a_gather_waiting_on_a_rank_that_never_ran_the_step() {
    let (runners, mut rx) = gathering_pair();
    // Only rank 0 gets the step: it trains, then waits in the gather.
    runners[0].submit(Work::Plan(Box::new(plan(1, vec![mb(&[("a:1", 4)])]))));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "nothing is sent before every rank's result is in"
    );
    runners[0].submit(Work::Abort(wire::Abort {
        job_id: "j".into(),
        generation: 1,
        step: 1,
        ..Default::default()
    }));
    // The gather ends at once and the step counts as aborted: no result,
    // no error (a configure of the next generation would be taken next).
    assert!(idle_within(&runners[0], Duration::from_secs(5)));
    assert!(rx.try_recv().is_err(), "an aborted gather reports nothing");
    for r in runners {
        r.shutdown();
    }
}
