//! Scenario tests of the state machine: loops over `handle`, no sockets, no
//! clock. Simulated workers answer Configure with Ready and plans with
//! results computed from the plan itself.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use super::*;
use crate::doc::{DocBody, DocId, Document, Sequence};
use crate::spec::JobSpec;

fn docs(n: usize) -> Arc<[Document]> {
    (0..n)
        .map(|i| {
            let len = 5 + (i * 37) % 60;
            Document {
                id: DocId {
                    file: 0,
                    line: i as u64 + 1,
                },
                body: DocBody::Sft(Sequence {
                    input_ids: vec![7; len],
                    labels: vec![7; len],
                }),
            }
        })
        .collect::<Vec<_>>()
        .into()
}

fn spec(extra_job: &str, batch: &str, min: u32, max: u32) -> JobSpec {
    let text = format!(
        r#"
[job]
name = "t"
seed = 3
output_dir = "/tmp/accrue-core-test"
{extra_job}
[model]
init = "random"
config = "/dev/null"
[data]
train = ["/dev/null"]
format = "sft"
max_tokens = 128
[batch]
{batch}
[parallel]
min_workers = {min}
max_workers = {max}
[checkpoint]
every_steps = 2
"#
    );
    toml::from_str(&text).unwrap()
}

/// A coordinator plus simulated workers that answer what they are sent.
struct Sim {
    c: Coordinator,
    now: i64,
    /// Messages sent to workers, not yet answered.
    inbox: VecDeque<(WorkerId, ToWorker)>,
    committed: Vec<(StepMetrics, Vec<DocId>)>,
    persisted: Vec<JobRecord>,
    /// Workers that have died: they answer nothing.
    dead: Vec<WorkerId>,
    /// Reference log-probs the shell would have stored.
    stored_ref: BTreeMap<DocId, [f64; 2]>,
    /// Every plan sent (rank 0's copy).
    plans: Vec<Arc<PlannedStep>>,
}

/// The log-prob a simulated worker reports in a reference pass.
fn fake_logp(doc: DocId, role: u32) -> f64 {
    -(doc.line as f64) - 0.5 * role as f64
}

impl Sim {
    fn new() -> Self {
        Sim {
            c: Coordinator::new(CoordinatorOptions::default()),
            now: 1_000,
            inbox: VecDeque::new(),
            committed: Vec::new(),
            persisted: Vec::new(),
            dead: Vec::new(),
            stored_ref: BTreeMap::new(),
            plans: Vec::new(),
        }
    }

    fn handle(&mut self, e: Event) -> Result<()> {
        self.now += 10;
        let fx = self.c.handle(e, self.now)?;
        for f in fx {
            match f {
                Effect::Send { worker, msg } => {
                    if let ToWorker::Plan {
                        rank: 0, planned, ..
                    } = &msg
                    {
                        self.plans.push(planned.clone());
                    }
                    self.inbox.push_back((worker, msg))
                }
                Effect::StoreReference { entries, .. } => self.stored_ref.extend(entries),
                Effect::CommitStep { rec, metrics, docs } => {
                    self.persisted.push(*rec);
                    self.committed.push((*metrics, docs));
                }
                Effect::PersistJob(rec) => self.persisted.push(rec),
                Effect::AppendMetrics { .. } | Effect::Publish { .. } => {}
            }
        }
        Ok(())
    }

    fn worker(&mut self, id: &str) {
        self.handle(Event::RegisterWorker {
            id: id.into(),
            reg: Registration {
                hostname: "h".into(),
                collective_addr: format!("127.0.0.1:1{id}"),
                ..Default::default()
            },
        })
        .unwrap();
        self.handle(Event::SessionOpened { worker: id.into() })
            .unwrap();
    }

    fn submit(&mut self, spec: JobSpec, docs: Arc<[Document]>) {
        self.handle(Event::SubmitJob {
            id: "job".into(),
            spec: Box::new(spec),
            spec_toml: String::new(),
            docs,
            start: None,
        })
        .unwrap();
    }

    /// Answers one message; returns false when the inbox is empty.
    fn step_once(&mut self) -> bool {
        let Some((w, msg)) = self.inbox.pop_front() else {
            return false;
        };
        if self.dead.contains(&w) {
            return true;
        }
        let ev = match msg {
            ToWorker::Configure {
                job,
                generation,
                step,
                ..
            } => Event::Ready {
                worker: w,
                job,
                generation,
                step,
            },
            ToWorker::Plan {
                job,
                generation,
                rank,
                planned,
            } => {
                let mbs = &planned.ranks[rank as usize];
                let tokens: u64 = mbs.iter().map(|m| m.token_ids.len() as u64).sum();
                let loss_tokens: u64 = mbs
                    .iter()
                    .flat_map(|m| {
                        m.cu_seq_lens
                            .windows(2)
                            .map(move |w| (m, w[0] as usize, w[1] as usize))
                    })
                    .map(|(m, a, b)| {
                        Sequence {
                            input_ids: vec![],
                            labels: m.labels[a..b].to_vec(),
                        }
                        .loss_tokens()
                    })
                    .sum();
                let documents = mbs.iter().flat_map(|m| &m.seqs).count() as u64;
                let logps = if planned.kind == PlanKind::Reference {
                    mbs.iter()
                        .flat_map(|m| &m.seqs)
                        .map(|q| SeqLogp {
                            doc: q.doc,
                            role: q.role,
                            logp: fake_logp(q.doc, q.role),
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                Event::StepResult {
                    logps,
                    worker: w,
                    job,
                    generation,
                    step: planned.step,
                    sums: MetricSums {
                        loss_sum: loss_tokens as f64 * 2.0,
                        loss_tokens,
                        tokens,
                        documents,
                        microbatches: mbs.len() as u32,
                        grad_norm: 1.0,
                        ..Default::default()
                    },
                }
            }
            ToWorker::Checkpoint { job, step, .. } => Event::CheckpointDone {
                worker: w,
                job,
                step,
            },
            ToWorker::Abort { .. } | ToWorker::Release { .. } => return true,
        };
        self.handle(ev).unwrap();
        true
    }

    fn run(&mut self) {
        while self.step_once() {}
    }

    fn state(&self) -> JobState {
        self.c.job("job").unwrap().rec.state
    }
}

#[test]
fn job_waits_pending_until_min_workers() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 2, 4), docs(20));
    s.worker("a");
    assert_eq!(s.state(), JobState::Pending);
    assert!(s
        .c
        .job("job")
        .unwrap()
        .rec
        .reason
        .contains("min_workers = 2"));
    assert!(
        s.inbox.is_empty(),
        "nothing is configured below min_workers"
    );
    s.worker("b");
    let ranks: Vec<u32> = s
        .inbox
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Configure { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect();
    assert_eq!(ranks, vec![0, 1]);
    assert_eq!(s.state(), JobState::Running);
}

#[test]
fn every_document_is_trained_exactly_once_per_epoch() {
    let mut s = Sim::new();
    let d = docs(23);
    s.submit(spec("epochs = 2", "docs_per_step = 5", 1, 4), d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let trained: Vec<DocId> = s
        .committed
        .iter()
        .flat_map(|(_, docs)| docs.clone())
        .collect();
    assert_eq!(trained.len(), 46);
    let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
    for id in &trained {
        *counts.entry(*id).or_default() += 1;
    }
    assert!(d.iter().all(|doc| counts[&doc.id] == 2), "{counts:?}");
    // Steps are consecutive and the loss is the token-weighted mean.
    for (i, (m, docs)) in s.committed.iter().enumerate() {
        assert_eq!(m.step, i as u64 + 1);
        assert_eq!(m.docs, docs.len() as u64);
        assert!((m.loss - 2.0).abs() < 1e-12);
    }
    // 46 docs at 5 per step: the last step is short.
    assert_eq!(s.committed.len(), 10);
    let last = s.persisted.last().unwrap();
    assert_eq!(last.state, JobState::Completed);
    assert_eq!(last.step, 10);
    assert_eq!(
        last.last_checkpoint,
        Some(10),
        "a final checkpoint is written"
    );
}

#[test]
fn lost_worker_aborts_step_and_replans_same_documents() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 4", "docs_per_step = 6", 1, 4), docs(30));
    // Answer the Configures, then capture step 1's plan without answering.
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    let first: Vec<Arc<PlannedStep>> = s
        .inbox
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Plan { planned, .. } => Some(planned.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(first.len(), 2);
    s.inbox.clear();
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    // The survivor is told to abort and is re-configured into generation 2.
    assert!(s
        .inbox
        .iter()
        .any(|(w, m)| w == "a" && matches!(m, ToWorker::Abort { step: 1, .. })));
    assert!(s
        .inbox
        .iter()
        .any(|(w, m)| w == "a" && matches!(m, ToWorker::Configure { generation: 2, .. })));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let (m1, docs1) = &s.committed[0];
    assert_eq!(m1.world_size, 1);
    assert_eq!(
        docs1, &first[0].docs,
        "the aborted step is re-planned with the same documents"
    );
}

#[test]
fn results_from_a_stale_generation_are_ignored() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(10));
    s.worker("a");
    s.step_once(); // Configure → Ready; step 1 dispatched
    s.handle(Event::StepResult {
        worker: "a".into(),
        job: "job".into(),
        generation: 99,
        step: 1,
        sums: MetricSums::default(),
        logps: Vec::new(),
    })
    .unwrap();
    assert!(s.committed.is_empty());
    s.run();
    assert_eq!(s.committed.len(), 2);
}

#[test]
fn heartbeat_timeout_declares_worker_lost() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 2), docs(10));
    s.worker("a");
    s.now += 1_500;
    s.handle(Event::Heartbeat { worker: "a".into() }).unwrap();
    s.now += 1_500;
    s.handle(Event::Tick).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Configuring);
    s.now += 2_500;
    s.handle(Event::Tick).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_eq!(s.state(), JobState::Pending);
}

#[test]
fn pause_takes_effect_at_the_step_boundary_and_resume_continues() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once(); // Ready → step 1 in flight
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    assert_eq!(
        s.state(),
        JobState::Running,
        "the in-flight step finishes first"
    );
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    assert_eq!(s.committed.len(), 1);
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 3);
}

#[test]
fn cancel_releases_workers_and_is_final() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once();
    s.handle(Event::CancelJob { job: "job".into() }).unwrap();
    assert_eq!(s.state(), JobState::Cancelled);
    assert!(s
        .inbox
        .iter()
        .any(|(_, m)| matches!(m, ToWorker::Release { .. })));
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Idle);
    let err = s
        .handle(Event::CancelJob { job: "job".into() })
        .unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert!(matches!(
        s.handle(Event::PauseJob { job: "nope".into() }),
        Err(CoreError::JobNotFound(_))
    ));
}

#[test]
fn non_finite_loss_fails_the_job_naming_the_step() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 1,
        kind: WorkerErrorKind::NonFinite,
        message: "loss is NaN in microbatch 2".into(),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("step 1") && reason.contains("microbatch 2"),
        "{reason}"
    );
    assert!(s.committed.is_empty());
}

#[test]
fn drained_worker_leaves_at_the_boundary() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 2), docs(20));
    s.step_once();
    s.step_once(); // both ready → step 1 in flight
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].0.world_size, 2, "step 1 finished with both");
    assert!(s.committed[1..].iter().all(|(m, _)| m.world_size == 1));
    assert!(
        s.committed.iter().all(|(m, _)| m.docs == 4),
        "no step lost documents"
    );
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Draining);
}

#[test]
fn restored_running_job_waits_for_workers_at_its_cursor() {
    let mut s = Sim::new();
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    for _ in 0..4 {
        s.step_once();
    }
    let rec = s.c.job("job").unwrap().rec.clone();
    assert!(rec.step >= 1);
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec.clone()),
        spec: Box::new(spec("steps = 4", "docs_per_step = 4", 1, 1)),
        docs: docs(20),
        reference: Default::default(),
    })
    .unwrap();
    let job = r.c.job("job").unwrap();
    assert_eq!(job.rec.state, JobState::Pending);
    assert_eq!(job.rec.cursor, rec.cursor);
    r.worker("z");
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    assert_eq!(r.committed.first().unwrap().0.step, rec.step + 1);
}

#[test]
fn a_joining_worker_enters_at_the_next_step_boundary() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(spec("steps = 3", "docs_per_step = 6", 1, 4), docs(30));
    s.step_once(); // Ready → step 1 in flight with one rank
    s.worker("b");
    assert!(
        !s.inbox.iter().any(|(w, _)| w == "b"),
        "nothing is sent to the joiner while step 1 is in flight"
    );
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
    assert_eq!(worlds, vec![1, 2, 2]);
    assert!(s.committed.iter().all(|(m, _)| m.docs == 6));
    // The joiner restored from a checkpoint of step 1, written before the
    // new generation formed.
    let rec = s.persisted.iter().find(|r| r.generation == 2).unwrap();
    assert_eq!(rec.last_checkpoint, Some(1));
    assert_eq!(rec.step, 1);
}

/// Every step mode, end to end through planner and cursor: each document of
/// each epoch is trained exactly once, whatever carries over.
#[test]
fn every_step_mode_trains_each_document_once_per_epoch() {
    for batch in [
        "docs_per_step = 7",
        "tokens_per_step = 300",
        "microbatches_per_rank = 2",
    ] {
        let mut s = Sim::new();
        s.worker("a");
        s.worker("b");
        let d = docs(57);
        s.submit(spec("epochs = 2", batch, 1, 2), d.clone());
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{batch}");
        let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
        for (_, ids) in &s.committed {
            for id in ids {
                *counts.entry(*id).or_default() += 1;
            }
        }
        assert_eq!(counts.len(), d.len(), "{batch}");
        assert!(counts.values().all(|&c| c == 2), "{batch}: {counts:?}");
    }
}

#[test]
fn a_job_resumed_from_a_checkpoint_continues_at_its_step_and_cursor() {
    // Reference: six uninterrupted steps.
    let mut full = Sim::new();
    full.submit(spec("steps = 6", "docs_per_step = 4", 1, 1), docs(30));
    full.worker("a");
    full.run();
    assert_eq!(full.committed.len(), 6);
    let at3 = full.committed[2].0.cursor.clone();

    // The same job resumed from the step-3 checkpoint's manifest.
    let mut s = Sim::new();
    s.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Box::new(spec("steps = 6", "docs_per_step = 4", 1, 1)),
        spec_toml: String::new(),
        docs: docs(30),
        start: Some(JobStart {
            step: 3,
            cursor: at3,
            dir: "/ckpt/step-3".into(),
        }),
    })
    .unwrap();
    s.worker("a");
    let configure = s.inbox.front().map(|(_, m)| m.clone());
    let Some(ToWorker::Configure {
        step, restore_from, ..
    }) = configure
    else {
        panic!("expected a configure, got {configure:?}");
    };
    assert_eq!(step, 3);
    assert_eq!(restore_from, Some(PathBuf::from("/ckpt/step-3")));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let steps: Vec<u64> = s.committed.iter().map(|(m, _)| m.step).collect();
    assert_eq!(steps, vec![4, 5, 6]);
    for (resumed, reference) in s.committed.iter().zip(&full.committed[3..]) {
        assert_eq!(
            resumed.1, reference.1,
            "step {}: same documents",
            resumed.0.step
        );
        assert_eq!(resumed.0.cursor, reference.0.cursor);
    }
}

fn pairs(n: usize) -> Arc<[Document]> {
    let seq = |len: usize| Sequence {
        input_ids: vec![7; len],
        labels: vec![7; len],
    };
    (0..n)
        .map(|i| Document {
            id: DocId {
                file: 0,
                line: i as u64 + 1,
            },
            body: DocBody::Pair {
                chosen: seq(5 + (i * 13) % 40),
                rejected: seq(3 + (i * 29) % 50),
            },
        })
        .collect::<Vec<_>>()
        .into()
}

fn dpo_spec(extra_job: &str) -> JobSpec {
    let mut s = spec(extra_job, "docs_per_step = 8", 1, 4);
    s.data.format = crate::spec::DataFormat::Dpo;
    s.objective.kind = crate::objective::ObjectiveKind::Dpo;
    s
}

#[test]
fn dpo_reference_pass_runs_first_and_training_plans_carry_its_logps() {
    let mut s = Sim::new();
    let d = pairs(150);
    s.submit(dpo_spec("steps = 3"), d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Every pair cached exactly as the workers reported it.
    assert_eq!(s.stored_ref.len(), d.len());
    for doc in d.iter() {
        assert_eq!(
            s.stored_ref[&doc.id],
            [fake_logp(doc.id, 0), fake_logp(doc.id, 1)]
        );
    }
    let kinds: Vec<PlanKind> = s.plans.iter().map(|p| p.kind).collect();
    let first_train = kinds.iter().position(|&k| k == PlanKind::Train).unwrap();
    assert!(first_train >= 1, "reference chunks come first: {kinds:?}");
    assert!(kinds[first_train..].iter().all(|&k| k == PlanKind::Train));
    // Training steps are numbered from 1 and carry ref_logp per sequence.
    assert_eq!(s.committed.len(), 3);
    assert_eq!(s.committed[0].0.step, 1);
    for p in &s.plans[first_train..] {
        for q in p.ranks.iter().flatten().flat_map(|m| &m.seqs) {
            let got = q.scalars.iter().find(|(k, _)| k == "ref_logp").unwrap().1;
            assert_eq!(got, fake_logp(q.doc, q.role));
        }
    }
}

#[test]
fn dpo_reference_pass_resumes_from_the_store_and_survives_a_lost_worker() {
    let mut s = Sim::new();
    let d = pairs(150);
    s.submit(dpo_spec("steps = 2"), d.clone());
    s.worker("a");
    s.worker("b");
    // Run until the first chunk is cached, then kill a worker mid-chunk.
    while s.stored_ref.is_empty() {
        assert!(s.step_once());
    }
    let cached = s.stored_ref.clone();
    assert!(cached.len() < d.len());
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.stored_ref.len(), d.len());

    // A restarted coordinator with a partial cache plans only the rest.
    let rec = s.c.job("job").unwrap().rec.clone();
    let mut r = Sim::new();
    let mut rec0 = rec.clone();
    rec0.state = JobState::Running;
    rec0.step = 0;
    rec0.cursor = Default::default();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec0),
        spec: Box::new(dpo_spec("steps = 2")),
        docs: d.clone(),
        reference: cached.clone(),
    })
    .unwrap();
    r.worker("z");
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    let planned_again: Vec<DocId> = r
        .plans
        .iter()
        .filter(|p| p.kind == PlanKind::Reference)
        .flat_map(|p| p.docs.clone())
        .collect();
    assert_eq!(planned_again.len(), d.len() - cached.len());
    assert!(planned_again.iter().all(|id| !cached.contains_key(id)));

    // A complete cache skips the pass.
    let mut q = Sim::new();
    let mut rec1 = rec;
    rec1.state = JobState::Running;
    rec1.step = 0;
    rec1.cursor = Default::default();
    q.handle(Event::RestoreJob {
        rec: Box::new(rec1),
        spec: Box::new(dpo_spec("steps = 2")),
        docs: d,
        reference: s.stored_ref.clone(),
    })
    .unwrap();
    q.worker("y");
    q.run();
    assert!(q.plans.iter().all(|p| p.kind == PlanKind::Train));
    assert_eq!(q.committed.len(), 2);
}

fn rollouts(groups: usize, size: usize) -> Arc<[Document]> {
    let mut out = Vec::new();
    for g in 0..groups {
        for k in 0..size {
            let line = (out.len() + 1) as u64;
            // Every third group has equal rewards (no signal).
            let reward = if g % 3 == 2 { 1.0 } else { k as f64 };
            out.push(Document {
                id: DocId { file: 0, line },
                body: DocBody::Rollout(crate::doc::Rollout {
                    seq: Sequence {
                        input_ids: vec![7; 6 + (line as usize * 7) % 30],
                        labels: vec![7; 6 + (line as usize * 7) % 30],
                    },
                    reward,
                    group: format!("g{g}"),
                    policy_version: 0,
                    old_logprobs: None,
                }),
            });
        }
    }
    out.into()
}

#[test]
fn pg_steps_take_whole_groups_and_train_every_kept_rollout_once() {
    let mut s = Sim::new();
    let d = rollouts(9, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 6", 1, 4);
    sp.data.format = crate::spec::DataFormat::Rollouts;
    sp.objective.kind = crate::objective::ObjectiveKind::Pg;
    s.submit(sp, d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let group_of = |id: &DocId| (id.line - 1) / 4;
    let mut seen = Vec::new();
    for (m, docs) in &s.committed {
        // Whole groups only: every group present has all 4 rollouts.
        let mut counts = BTreeMap::new();
        for id in docs {
            *counts.entry(group_of(id)).or_insert(0) += 1;
        }
        assert!(
            counts.values().all(|&c| c == 4),
            "step {}: {counts:?}",
            m.step
        );
        assert!(docs.len() >= 6 || m.step == s.committed.len() as u64);
        assert_eq!(m.extra["count/zero_variance_groups"], 3.0);
        assert_eq!(m.extra["staleness/max"], (m.step - 1) as f64);
        seen.extend(docs.iter().copied());
    }
    seen.sort();
    let kept: Vec<DocId> = d
        .iter()
        .filter(|doc| group_of(&doc.id) % 3 != 2)
        .map(|doc| doc.id)
        .collect();
    assert_eq!(
        seen, kept,
        "each kept rollout exactly once, flat groups never"
    );
    for p in &s.plans {
        for q in p.ranks.iter().flatten().flat_map(|m| &m.seqs) {
            assert!(q.scalars.iter().any(|(k, _)| k == "advantage"));
        }
    }
}

#[test]
fn a_result_from_an_older_generation_changes_nothing() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 2", "docs_per_step = 6", 1, 4), docs(30));
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    s.inbox.clear();
    // b dies with step 1 of generation 1 in flight: generation 2 forms.
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    let before = (
        s.inbox.len(),
        s.persisted.len(),
        s.c.job("job").unwrap().rec.clone(),
    );
    assert_eq!(before.2.generation, 2);
    // a's answer to generation 1's plan arrives late: it is ignored.
    s.handle(Event::StepResult {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 1,
        sums: MetricSums {
            loss_sum: 1.0,
            loss_tokens: 1,
            ..Default::default()
        },
        logps: Vec::new(),
    })
    .unwrap();
    assert!(s.committed.is_empty());
    assert_eq!((s.inbox.len(), s.persisted.len()), (before.0, before.1));
    let after = &s.c.job("job").unwrap().rec;
    assert_eq!(
        (after.step, after.generation),
        (before.2.step, before.2.generation)
    );
    assert_eq!(after.cursor, before.2.cursor);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].0.world_size, 1, "step 1 ran in generation 2");
}
