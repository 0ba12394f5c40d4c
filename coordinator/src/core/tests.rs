//! Scenario tests of the state machine: loops over `handle`, no sockets, no
//! clock. Simulated workers answer Configure with Ready and plans with
//! results computed from the plan itself.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use super::job_data::{HISTORY_LOAD_STEPS, HISTORY_WINDOW};
use super::*;
use crate::job::spec::JobSpec;
use crate::rl::rounds as generate;
use crate::rl::stream::RolloutWrite;
use crate::stream::doc::{DocBody, DocId, Document, Sequence};

#[path = "stream_tests.rs"]
mod stream_tests;

#[path = "fault_tests.rs"]
mod fault_tests;

#[path = "mixture_tests.rs"]
mod mixture_tests;

#[path = "loop_tests.rs"]
mod loop_tests;

#[path = "engine_tests.rs"]
mod engine_tests;

#[path = "disagg_tests.rs"]
mod disagg_tests;

/// A heartbeat that carries no send time (read as late as the backlog).
fn heartbeat(worker: WorkerId) -> Event {
    Event::Heartbeat {
        worker,
        lag_ms: None,
    }
}

fn docs(n: usize) -> Arc<[Document]> {
    (0..n)
        .map(|i| {
            let len = 5 + (i * 37) % 60;
            Document {
                id: DocId {
                    file: 0,
                    line: i as u64 + 1,
                },
                body: DocBody::Sft(Sequence::new(vec![7; len], vec![7; len])),
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
    /// Train results travel as workers with `Configure.gather_results`
    /// send them: held until every rank has one, then one
    /// `Event::StepResults` from rank 0's worker.
    gather: bool,
    /// Held results by (generation, step): (rank, result).
    gathered: BTreeMap<(u64, u64), Vec<(u32, RankResult)>>,
    /// Every stored-history load the core asked for: (from, to); the
    /// unanswered ones are answered from `committed` by `step_once`.
    history_loads: Vec<(u64, u64)>,
    history_unanswered: VecDeque<(JobId, u64, u64)>,
    /// Answer history loads with this error instead.
    history_error: Option<String>,
    /// Messages sent to workers, not yet answered.
    inbox: VecDeque<(WorkerId, ToWorker)>,
    committed: Vec<(StepMetrics, Vec<DocId>)>,
    persisted: Vec<JobRecord>,
    /// Workers that have died: they answer nothing.
    dead: Vec<WorkerId>,
    /// Reference log-probs the shell would have stored.
    stored_ref: BTreeMap<DocId, RefEntry>,
    /// Every plan sent (rank 0's copy).
    plans: Vec<Arc<PlannedStep>>,
    /// Every Configure sent.
    configures: Vec<(WorkerId, ToWorker)>,
    /// Watch events published: (kind, message).
    events: Vec<(String, String)>,
    /// Checkpoint steps requested (rank 0's copy).
    checkpoints: Vec<u64>,
    /// Every relay sent: (its hub, messages in it).
    relayed: Vec<(WorkerId, usize)>,
    /// Every plan relayed: (rank, step).
    relayed_plans: Vec<(u32, u64)>,
    /// Policies workers were asked to publish: (worker, step, dir).
    publish_requests: Vec<(WorkerId, u64, std::path::PathBuf)>,
    /// Rollout store writes of streamed jobs, in order.
    rollout_writes: Vec<RolloutWrite>,
    /// The manifest of every committed step.
    manifests: Vec<crate::core::manifest::StepManifest>,
    /// Every Abort sent: (worker, step).
    aborts: Vec<(WorkerId, u64)>,
    /// Every Release sent: the worker.
    releases: Vec<WorkerId>,
    /// Workers whose session the coordinator ended (declared lost).
    ended_sessions: Vec<WorkerId>,
    /// Every Checkpoint message sent (all ranks, duplicates counted).
    checkpoint_msgs: usize,
    /// Checkpoint directories the shell was asked to delete, by step.
    removed_checkpoints: Vec<u64>,
    /// Directories the core asked the shell to write tokenizer files into.
    tokenizer_dirs: Vec<PathBuf>,
    /// When set, Checkpoint messages wait here instead of being answered.
    held_checkpoints: Option<Vec<(WorkerId, ToWorker)>>,
    /// Documents whose loss is NaN: a training plan holding one fails as
    /// non-finite on the rank that has it; a probe flags its microbatch.
    poison: Vec<DocId>,
    /// Evaluations written, in order.
    evals: Vec<EvalMetrics>,
    /// Every generation round plan sent (rank, plan).
    rounds: Vec<(u32, Arc<generate::RoundPlan>)>,
    /// Rounds the core asked the shell to score, not yet answered.
    to_score: Vec<generate::RoundToScore>,
    /// Whether `run` scores rounds itself (else a test answers them).
    auto_score: bool,
    /// Rounds for the external engine (`rl.engine`), not yet answered.
    engine_rounds: Vec<generate::EngineRound>,
    /// Engine reloads asked: (step, dir).
    engine_reloads: Vec<(u64, std::path::PathBuf)>,
    /// Per engine round: whether a step was in flight when it was planned.
    engine_overlap: Vec<bool>,
    /// How many of those a test has answered.
    answered_rounds: usize,
    answered_reloads: usize,
    /// Every weight sync sent: (worker, version).
    syncs: Vec<(WorkerId, u64)>,
    /// Per Generate plan sent: its worker, and whether a training step
    /// was in flight then.
    round_workers: Vec<(WorkerId, bool)>,
    /// The step whose weights each worker will hold when it takes its
    /// next message: its Configure's step, then each training plan's.
    /// A policy publication must name exactly that step.
    will_hold: BTreeMap<WorkerId, u64>,
}

/// The log-prob a simulated worker reports in a reference pass.
fn fake_logp(doc: DocId, role: u32) -> f64 {
    -(doc.line as f64) - 0.5 * role as f64
}

/// A reference pass's per-token log-prob of token `j` of `doc` (0 at the
/// first token, which nothing predicts).
fn fake_token_logp(doc: DocId, j: usize) -> f32 {
    if j == 0 {
        0.0
    } else {
        -(doc.line as f32) * 0.01 - j as f32 * 0.001
    }
}

/// Every scenario's workers can relay, and generations of this many relay
/// (`core::relay`): 2, so every scenario of two or more workers routes its
/// followers' messages through hubs, as `Sim::forward_relays` delivers them.
const SIM_RELAY_MIN_WORLD: u32 = 2;

impl Sim {
    fn new() -> Self {
        Sim {
            c: Coordinator::new(CoordinatorOptions {
                relay_min_world: SIM_RELAY_MIN_WORLD,
                ..CoordinatorOptions::default()
            }),
            now: 1_000,
            gather: false,
            gathered: BTreeMap::new(),
            history_loads: Vec::new(),
            history_unanswered: VecDeque::new(),
            history_error: None,
            inbox: VecDeque::new(),
            committed: Vec::new(),
            persisted: Vec::new(),
            dead: Vec::new(),
            stored_ref: BTreeMap::new(),
            plans: Vec::new(),
            configures: Vec::new(),
            events: Vec::new(),
            checkpoints: Vec::new(),
            relayed: Vec::new(),
            relayed_plans: Vec::new(),
            publish_requests: Vec::new(),
            rollout_writes: Vec::new(),
            manifests: Vec::new(),
            aborts: Vec::new(),
            releases: Vec::new(),
            ended_sessions: Vec::new(),
            checkpoint_msgs: 0,
            removed_checkpoints: Vec::new(),
            tokenizer_dirs: Vec::new(),
            held_checkpoints: None,
            poison: Vec::new(),
            evals: Vec::new(),
            rounds: Vec::new(),
            to_score: Vec::new(),
            auto_score: true,
            engine_rounds: Vec::new(),
            engine_reloads: Vec::new(),
            engine_overlap: Vec::new(),
            answered_rounds: 0,
            answered_reloads: 0,
            syncs: Vec::new(),
            round_workers: Vec::new(),
            will_hold: BTreeMap::new(),
        }
    }

    /// Each `ToWorker::Relay` as the messages its hub forwards; one for a
    /// generation no longer current reaches nobody (its hub was configured
    /// again, and drops it). Counts the relays in `relayed`.
    fn forward_relays(&mut self, fx: Vec<Effect>) -> Vec<Effect> {
        let mut out = Vec::with_capacity(fx.len());
        for f in fx {
            let Effect::Send {
                worker: hub,
                msg:
                    ToWorker::Relay {
                        job,
                        generation,
                        messages,
                    },
            } = f
            else {
                out.push(f);
                continue;
            };
            self.relayed.push((hub, messages.len()));
            for (rank, m) in &messages {
                if let ToWorker::Plan { planned, .. } = m {
                    self.relayed_plans.push((*rank, planned.step));
                }
            }
            let members = self
                .c
                .job(&job)
                .ok()
                .and_then(|j| j.active())
                .filter(|a| a.gen.id == generation)
                .map(|a| a.gen.members.clone())
                .unwrap_or_default();
            for (rank, msg) in messages {
                if let Some(worker) = members.get(rank as usize) {
                    out.push(Effect::Send {
                        worker: worker.clone(),
                        msg,
                    });
                }
            }
        }
        out
    }

    fn handle(&mut self, e: Event) -> Result<()> {
        self.now += 10;
        let (persists, fx) = self.c.handle(e, self.now)?.into_parts();
        for p in persists {
            match p {
                Persist::Reference { entries, .. } => self.stored_ref.extend(entries),
                Persist::Step {
                    rec,
                    metrics,
                    docs,
                    manifest,
                } => {
                    self.manifests.push(*manifest);
                    self.persisted.push(*rec);
                    self.committed.push((*metrics, docs));
                }
                Persist::Job(rec) => self.persisted.push(*rec),
                Persist::Rollouts(w) => self.rollout_writes.push(*w),
            }
        }
        // A hub forwards its followers' messages (accrue-relay): they
        // arrive as if sent to each, after the call's other messages.
        let fx = self.forward_relays(fx);
        // As the shell does: once a step's plans are out, the next step is
        // planned ahead (and dispatch, in a debug build, checks it against
        // planning it again: every scenario here checks that).
        let mut dispatched: Vec<JobId> = Vec::new();
        for f in fx {
            match f {
                Effect::Send { worker, msg } => {
                    if let ToWorker::Plan {
                        rank: 0,
                        planned,
                        job,
                        ..
                    } = &msg
                    {
                        self.plans.push(planned.clone());
                        if !dispatched.contains(job) {
                            dispatched.push(job.clone());
                        }
                    }
                    if let ToWorker::Configure { .. } = &msg {
                        self.configures.push((worker.clone(), msg.clone()));
                    }
                    if let ToWorker::Release { .. } = &msg {
                        self.releases.push(worker.clone());
                    }
                    if let ToWorker::Checkpoint { step, .. } = &msg {
                        self.checkpoint_msgs += 1;
                        if self.checkpoints.last() != Some(step) {
                            self.checkpoints.push(*step);
                        }
                    }
                    if let ToWorker::PublishPolicy { step, dir, .. } = &msg {
                        self.publish_requests.push((
                            worker.clone(),
                            *step,
                            dir.clone().unwrap_or_default(),
                        ));
                    }
                    if let ToWorker::Abort { step, .. } = &msg {
                        self.aborts.push((worker.clone(), *step));
                    }
                    if let ToWorker::Generate {
                        rank, plan, job, ..
                    } = &msg
                    {
                        self.rounds.push((*rank, plan.clone()));
                        let busy = self.c.job(job).is_ok_and(|j| j.inflight().is_some());
                        self.round_workers.push((worker.clone(), busy));
                    }
                    if let ToWorker::SyncWeights { version, .. } = &msg {
                        self.syncs.push((worker.clone(), *version));
                    }
                    match &msg {
                        ToWorker::Configure { step, .. } => {
                            self.will_hold.insert(worker.clone(), *step);
                        }
                        ToWorker::Plan { planned, .. } if planned.kind == PlanKind::Train => {
                            self.will_hold.insert(worker.clone(), planned.step);
                        }
                        ToWorker::PublishPolicy { step, .. } => assert_eq!(
                            self.will_hold.get(&worker),
                            Some(step),
                            "{worker} is asked for step {step}'s policy behind another step's plan"
                        ),
                        _ => {}
                    }
                    self.inbox.push_back((worker, msg))
                }
                Effect::Publish {
                    item: WatchItem::Event { kind, message, .. },
                    ..
                } => self.events.push((kind.name().to_string(), message)),
                Effect::RemoveCheckpoint { step, .. } => self.removed_checkpoints.push(step),
                Effect::EndSession { worker, .. } => self.ended_sessions.push(worker),
                Effect::AppendEval { eval, .. } => self.evals.push(*eval),
                Effect::ScoreRound(r) => self.to_score.push(*r),
                Effect::EngineGenerate(r) => {
                    let busy = self.c.job(&r.job).is_ok_and(|j| j.inflight().is_some());
                    self.engine_overlap.push(busy);
                    self.engine_rounds.push(*r)
                }
                Effect::EngineReload { step, dir, .. } => self.engine_reloads.push((step, dir)),
                Effect::LoadHistory { job, from, to } => {
                    self.history_loads.push((from, to));
                    self.history_unanswered.push_back((job, from, to));
                }
                Effect::WriteTokenizer { dir, .. } => self.tokenizer_dirs.push(dir),
                Effect::AppendMetrics { .. } | Effect::Publish { .. } => {}
            }
        }
        for job in dispatched {
            let fx = self.c.handle(Event::PlanAhead { job }, self.now)?;
            assert!(fx.is_empty(), "planning ahead had effects: {fx:?}");
        }
        Ok(())
    }

    fn worker(&mut self, id: &str) {
        self.handle(Event::RegisterWorker {
            id: id.into(),
            reg: Registration {
                hostname: "h".into(),
                collective_addr: format!("127.0.0.1:1{id}"),
                relay_addr: format!("127.0.0.1:2{id}"),
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
            spec: Arc::new(spec),
            spec_toml: String::new(),
            docs,
            start: None,
        })
        .unwrap();
    }

    /// Answers one message; returns false when the inbox is empty.
    fn step_once(&mut self) -> bool {
        if let Some((job, from, to)) = self.history_unanswered.pop_front() {
            // As the store answers: the committed steps' records.
            let steps = match &self.history_error {
                Some(e) => Err(e.clone()),
                None => Ok(self
                    .committed
                    .iter()
                    .filter(|(m, _)| (from..=to).contains(&m.step))
                    .map(|(m, docs)| CommittedStep {
                        step: m.step,
                        lr: m.lr,
                        docs: crate::stream::doc::DocIds::new(docs),
                        cursor_after: m.cursor.clone(),
                    })
                    .collect()),
            };
            self.handle(Event::HistoryLoaded { job, from, steps })
                .unwrap();
            return true;
        }
        let Some((w, msg)) = self.inbox.pop_front() else {
            if self.auto_score && !self.to_score.is_empty() {
                let r = self.to_score.remove(0);
                self.handle(loop_tests::scored(&r)).unwrap();
                return true;
            }
            return false;
        };
        if self.dead.contains(&w) {
            return true;
        }
        if let (Some(held), ToWorker::Checkpoint { .. }) = (&mut self.held_checkpoints, &msg) {
            held.push((w, msg));
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
                let poison = self.poison.clone();
                let poisoned =
                    |m: &step::MicrobatchPayload| m.seqs.iter().any(|q| poison.contains(&q.doc));
                if planned.kind == PlanKind::Train && mbs.iter().any(poisoned) {
                    let ev = Event::WorkerError {
                        worker: w,
                        job,
                        generation,
                        step: planned.step,
                        kind: WorkerErrorKind::NonFinite,
                        message: "non-finite loss NaN in loss chunk 0".into(),
                    };
                    self.handle(ev).unwrap();
                    return true;
                }
                let nonfinite: Vec<u32> = if planned.kind == PlanKind::Probe {
                    mbs.iter()
                        .enumerate()
                        .filter(|(_, m)| poisoned(m))
                        .map(|(i, _)| i as u32)
                        .collect()
                } else {
                    Vec::new()
                };
                // Counted on the materialised rows, as a worker would.
                let rows: Vec<step::Rows> = mbs.iter().map(|m| m.rows()).collect();
                let tokens: u64 = rows.iter().map(|r| r.token_ids.len() as u64).sum();
                let loss_tokens: u64 = mbs
                    .iter()
                    .zip(&rows)
                    .map(|(m, r)| step::rank_loss_tokens(&m.cu_seq_lens, &r.labels))
                    .sum();
                // As workers count: a training step counts a DPO pair
                // once, a forward-only pass every sequence.
                let documents = mbs
                    .iter()
                    .flat_map(|m| &m.seqs)
                    .filter(|q| q.role == 0 || planned.kind != PlanKind::Train)
                    .count() as u64;
                // Per-token log-probs too: a DPO pass ignores them.
                let logps = if matches!(planned.kind, PlanKind::Reference | PlanKind::Eval) {
                    mbs.iter()
                        .flat_map(|m| m.seqs.iter().zip(m.cu_seq_lens.windows(2)))
                        .map(|(q, w)| SeqLogp {
                            doc: q.doc,
                            role: q.role,
                            logp: fake_logp(q.doc, q.role),
                            tokens: (0..(w[1] - w[0]) as usize)
                                .map(|j| fake_token_logp(q.doc, j))
                                .collect(),
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                // As a worker does: each microbatch's sums go to its source.
                let mut sources: BTreeMap<u32, SourceSums> = BTreeMap::new();
                for (m, r) in mbs.iter().zip(&rows).filter(|(m, _)| !m.seqs.is_empty()) {
                    let lt = step::rank_loss_tokens(&m.cu_seq_lens, &r.labels);
                    let e = sources.entry(m.source).or_default();
                    e.loss_sum += lt as f64 * 2.0;
                    e.loss_tokens += lt;
                    e.tokens += r.token_ids.len() as u64;
                    e.documents += m.seqs.len() as u64;
                }
                let sums = MetricSums {
                    loss_sum: loss_tokens as f64 * 2.0,
                    loss_tokens,
                    tokens,
                    documents,
                    microbatches: mbs.len() as u32,
                    grad_norm: 1.0,
                    sources,
                    ..Default::default()
                };
                if self.gather && planned.kind == PlanKind::Train {
                    let result = RankResult {
                        sums,
                        logps,
                        nonfinite,
                    };
                    return self.gather_result(job, generation, planned.step, rank, result);
                }
                Event::StepResult {
                    logps,
                    nonfinite,
                    worker: w,
                    job,
                    generation,
                    step: planned.step,
                    sums,
                }
            }
            ToWorker::Checkpoint { job, step, .. } => Event::CheckpointDone {
                worker: w,
                job,
                step,
            },
            ToWorker::PublishPolicy { job, step, .. } => Event::PolicyPublished {
                worker: w,
                job,
                step,
            },
            ToWorker::Generate {
                job,
                generation,
                plan,
                ..
            } => loop_tests::generated(w, job, generation, &plan),
            ToWorker::SyncWeights {
                job,
                generation,
                version,
            } => {
                // Trainer rank 0 sends; the generators answer.
                let generator = self
                    .c
                    .job(&job)
                    .ok()
                    .and_then(|j| j.gen())
                    .is_some_and(|g| g.generators.rank_of(&w).is_some());
                if !generator {
                    return true;
                }
                Event::WeightsSynced {
                    worker: w,
                    job,
                    generation,
                    version,
                }
            }
            ToWorker::Abort { .. } | ToWorker::Release { .. } => return true,
            ToWorker::Relay { .. } => unreachable!("forwarded when sent (forward_relays)"),
        };
        self.handle(ev).unwrap();
        true
    }

    fn run(&mut self) {
        while self.step_once() {}
    }

    /// Holds `rank`'s train result until every rank of the generation has
    /// one, then sends them all from rank 0's worker, as gathering workers
    /// do. Always true (an answer was handled or held).
    fn gather_result(
        &mut self,
        job: JobId,
        generation: u64,
        step: u64,
        rank: u32,
        result: RankResult,
    ) -> bool {
        let held = self.gathered.entry((generation, step)).or_default();
        held.push((rank, result));
        let gen = self.c.job(&job).ok().and_then(|j| j.gen());
        let Some(gen) = gen.filter(|g| g.id == generation) else {
            return true;
        };
        if held.len() < gen.members.len() {
            return true;
        }
        let worker = gen.members[0].clone();
        let results = self
            .gathered
            .remove(&(generation, step))
            .unwrap_or_default();
        if self.dead.contains(&worker) {
            return true;
        }
        self.handle(Event::StepResults {
            worker,
            job,
            generation,
            step,
            results,
        })
        .unwrap();
        true
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
        nonfinite: Vec::new(),
    })
    .unwrap();
    assert!(s.committed.is_empty());
    s.run();
    assert_eq!(s.committed.len(), 2);
}

/// Runs a 3-worker job to the end, train results gathered or per rank.
fn three_worker_run(gather: bool) -> Sim {
    let mut s = Sim::new();
    s.gather = gather;
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("steps = 5", "docs_per_step = 7", 3, 3), docs(40));
    s.run();
    assert_eq!(s.state(), JobState::Completed, "gather {gather}");
    s
}

#[test]
fn gathered_results_commit_the_same_steps_as_results_sent_per_rank() {
    let (per_rank, gathered) = (three_worker_run(false), three_worker_run(true));
    assert_eq!(gathered.committed.len(), 5);
    let facts = |s: &Sim| -> Vec<_> {
        s.committed
            .iter()
            .map(|(m, docs)| {
                let sources: Vec<_> = m.sources.values().map(|x| (x.tokens, x.docs)).collect();
                let m = (
                    m.step,
                    m.loss,
                    m.tokens,
                    m.loss_tokens,
                    m.docs,
                    m.microbatches,
                );
                (m, sources, docs.clone())
            })
            .collect()
    };
    assert_eq!(facts(&per_rank), facts(&gathered));
    let cursors =
        |s: &Sim| -> Vec<_> { s.committed.iter().map(|(m, _)| m.cursor.clone()).collect() };
    assert_eq!(cursors(&per_rank), cursors(&gathered));
}

/// Three workers with step 1 dispatched and unanswered; its plan.
fn step_1_unanswered() -> (Sim, Arc<PlannedStep>) {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("steps = 3", "docs_per_step = 6", 3, 3), docs(30));
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    let planned = s.plans.last().cloned().expect("step 1 dispatched");
    s.inbox.clear();
    (s, planned)
}

/// What a worker would report for `rank` of `p` (as `Sim` answers).
fn result_of(p: &PlannedStep, rank: u32) -> RankResult {
    let mbs = &p.ranks[rank as usize];
    let rows: Vec<step::Rows> = mbs.iter().map(|m| m.rows()).collect();
    let loss_tokens: u64 = mbs
        .iter()
        .zip(&rows)
        .map(|(m, r)| step::rank_loss_tokens(&m.cu_seq_lens, &r.labels))
        .sum();
    RankResult {
        sums: MetricSums {
            loss_sum: loss_tokens as f64,
            loss_tokens,
            tokens: rows.iter().map(|r| r.token_ids.len() as u64).sum(),
            documents: mbs.iter().map(|m| m.seqs.len() as u64).sum(),
            microbatches: mbs.len() as u32,
            grad_norm: 1.0,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn gathered(worker: &str, p: &PlannedStep, results: Vec<(u32, RankResult)>) -> Event {
    Event::StepResults {
        worker: worker.into(),
        job: "job".into(),
        generation: 1,
        step: p.step,
        results,
    }
}

#[test]
fn gathered_results_are_taken_only_from_rank_0_and_only_whole() {
    let all = |p: &PlannedStep| (0..3).map(|r| (r, result_of(p, r))).collect::<Vec<_>>();
    // From rank 0, whole: the step commits.
    let (mut s, p) = step_1_unanswered();
    s.handle(gathered("a", &p, all(&p))).unwrap();
    assert_eq!(s.committed.len(), 1);
    assert!(s.ended_sessions.is_empty());
    // From another member: refused, its sender dropped, nothing committed.
    let (mut s, p) = step_1_unanswered();
    s.handle(gathered("b", &p, all(&p))).unwrap();
    assert!(s.committed.is_empty());
    assert_eq!(s.ended_sessions, vec!["b".to_string()]);
    // A rank missing, or one out of range: refused the same way.
    for results in [
        all(&p).into_iter().take(2).collect::<Vec<_>>(),
        all(&p).into_iter().map(|(r, x)| (r * 2, x)).collect(),
    ] {
        let (mut s, p) = step_1_unanswered();
        s.handle(gathered("a", &p, results)).unwrap();
        assert!(s.committed.is_empty());
        assert_eq!(s.ended_sessions, vec!["a".to_string()]);
        let why = s
            .events
            .iter()
            .map(|(_, m)| m.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        assert!(why.contains("not one result for each of 3 ranks"), "{why}");
    }
}

#[test]
fn a_gathered_entry_that_disagrees_with_its_plan_drops_that_ranks_worker() {
    let (mut s, p) = step_1_unanswered();
    let mut results: Vec<_> = (0..3).map(|r| (r, result_of(&p, r))).collect();
    results[2].1.sums.tokens += 1;
    s.handle(gathered("a", &p, results)).unwrap();
    assert!(s.committed.is_empty());
    assert_eq!(
        s.ended_sessions,
        vec!["c".to_string()],
        "rank 2 computed it; rank 0 only relayed it"
    );
    // With a replacement the job re-forms and trains the same documents.
    s.dead.push("c".into());
    s.worker("d");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].1, p.docs);
}

#[test]
fn queued_heartbeats_count_at_their_own_read_time_and_never_turn_back_the_clock() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let read_at = s.now + 500;
    s.now += 1_500;
    // Applied together just before a tick, each at the time it was read.
    s.handle(Event::Heartbeats {
        beats: vec![
            Beat {
                worker: "a".into(),
                at_ms: read_at,
                lag_ms: Some(0),
            },
            Beat {
                worker: "b".into(),
                at_ms: read_at - 400,
                lag_ms: Some(0),
            },
        ],
    })
    .unwrap();
    let seen = |s: &Sim, w: &str| s.c.worker(w).unwrap().last_seen_ms();
    assert_eq!((seen(&s, "a"), seen(&s, "b")), (read_at, read_at - 400));
    // A heartbeat read before a newer message does not move its time back.
    s.handle(heartbeat("a".into())).unwrap();
    let newer = seen(&s, "a");
    s.handle(Event::Heartbeats {
        beats: vec![Beat {
            worker: "a".into(),
            at_ms: read_at,
            lag_ms: Some(0),
        }],
    })
    .unwrap();
    assert_eq!(seen(&s, "a"), newer);
}

#[test]
fn heartbeat_timeout_declares_worker_lost() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 2), docs(10));
    s.worker("a");
    s.now += 1_500;
    s.handle(heartbeat("a".into())).unwrap();
    s.now += 1_500;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Configuring);
    s.now += 2_500;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
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
        spec: Arc::new(spec("steps = 4", "docs_per_step = 4", 1, 1)),
        docs: docs(20),
        reference: Default::default(),
        history: Vec::new(),
    })
    .unwrap();
    let job = r.c.job("job").unwrap();
    assert_eq!(job.rec.state, JobState::Pending);
    assert_eq!(job.rec.cursor, rec.cursor);
    r.worker("z");
    r.after_rejoin_grace(); // the old members never come back
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
    // Issue 6: the joiner syncs from the holder's memory at step 1; no
    // checkpoint is written first (before: a checkpoint of step 1, then a
    // restore from it).
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    assert!(gen2.iter().all(|c| c.step == 1 && c.restore_from.is_none()));
    assert!(gen2[0].priors[0].is_some() && gen2[0].priors[1].is_none());
    assert!(!s.checkpoints.contains(&1), "{:?}", s.checkpoints);
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
        spec: Arc::new(spec("steps = 6", "docs_per_step = 4", 1, 1)),
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
    let seq = |len: usize| Sequence::new(vec![7; len], vec![7; len]);
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
    s.data.format = crate::job::spec::DataFormat::Dpo;
    s.objective.kind = crate::job::objective::ObjectiveKind::Dpo;
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
            RefEntry::Pair([fake_logp(doc.id, 0), fake_logp(doc.id, 1)])
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
            let got = q.ref_logp.unwrap();
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
        spec: Arc::new(dpo_spec("steps = 2")),
        docs: d.clone(),
        reference: cached.clone(),
        history: Vec::new(),
    })
    .unwrap();
    r.worker("z");
    r.after_rejoin_grace(); // the old members never come back
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
        spec: Arc::new(dpo_spec("steps = 2")),
        docs: d,
        reference: s.stored_ref.clone(),
        history: Vec::new(),
    })
    .unwrap();
    q.worker("y");
    q.after_rejoin_grace(); // the old members never come back
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
                body: DocBody::Rollout(crate::stream::doc::Rollout {
                    seq: Sequence::new(
                        vec![7; 6 + (line as usize * 7) % 30],
                        vec![7; 6 + (line as usize * 7) % 30],
                    ),
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
    sp.data.format = crate::job::spec::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
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
            assert!(q.advantage.is_some());
        }
    }
}

#[test]
fn pg_kl_with_a_cached_reference_runs_a_per_token_pass_first_and_plans_carry_it() {
    let mut s = Sim::new();
    let d = rollouts(9, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 8", 1, 4);
    sp.data.format = crate::job::spec::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.objective.kl_coef = Some(0.05);
    s.submit(sp, d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Every rollout (flat groups too: the pass runs before grouping
    // matters) cached with one log-prob per token, as reported.
    assert_eq!(s.stored_ref.len(), d.len());
    for doc in d.iter() {
        let want: Vec<f32> = (0..doc.tokens() as usize)
            .map(|j| fake_token_logp(doc.id, j))
            .collect();
        assert_eq!(s.stored_ref[&doc.id], RefEntry::Tokens(want.into()));
    }
    let first_train = s
        .plans
        .iter()
        .position(|p| p.kind == PlanKind::Train)
        .unwrap();
    assert!(first_train >= 1, "the reference pass comes first");
    // Training rows carry each sequence's reference log-probs, aligned
    // with the tokens, and no DPO scalar.
    let mut rows = 0;
    for p in &s.plans[first_train..] {
        assert_eq!(p.kind, PlanKind::Train);
        for m in p.ranks.iter().flatten().filter(|m| !m.seqs.is_empty()) {
            let ref_logprobs = m.ref_logprobs();
            assert_eq!(ref_logprobs.len() as u64, m.tokens());
            for (q, w) in m.seqs.iter().zip(m.cu_seq_lens.windows(2)) {
                let got = &ref_logprobs[w[0] as usize..w[1] as usize];
                let want: Vec<f32> = (0..got.len()).map(|j| fake_token_logp(q.doc, j)).collect();
                assert_eq!(got, want.as_slice(), "{}", q.doc);
                assert!(q.ref_logp.is_none());
            }
            rows += 1;
        }
    }
    assert!(rows > 0);
}

#[test]
fn pg_without_kl_or_with_a_live_reference_needs_no_pass() {
    for (kl, reference) in [
        (0.0, None),
        (0.05, Some(crate::job::objective::Reference::Live)),
    ] {
        let mut s = Sim::new();
        let mut sp = spec("epochs = 1", "docs_per_step = 8", 1, 4);
        sp.data.format = crate::job::spec::DataFormat::Rollouts;
        sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
        sp.objective.kl_coef = Some(kl);
        sp.objective.reference = reference;
        s.submit(sp, rollouts(3, 4));
        s.worker("a");
        s.run();
        assert_eq!(s.state(), JobState::Completed);
        assert!(s.plans.iter().all(|p| p.kind == PlanKind::Train));
        assert!(s.stored_ref.is_empty());
        let mbs = s.plans.iter().flat_map(|p| p.ranks.iter().flatten());
        assert!(mbs.into_iter().all(|m| m.ref_logprobs().is_empty()));
    }
}

// ---- recovery (issue 6): memory, checkpoints, replay ------------------------

/// One Configure as a worker received it.
#[derive(Debug, Clone)]
struct Conf {
    rank: u32,
    step: u64,
    restore_from: Option<PathBuf>,
    priors: Vec<Option<HeldState>>,
}

impl Sim {
    fn run_until(&mut self, done: impl Fn(&Sim) -> bool) {
        while !done(self) {
            assert!(
                self.step_once(),
                "the inbox ran dry before the condition held"
            );
        }
    }

    fn kill(&mut self, w: &str) {
        self.dead.push(w.into());
        self.handle(Event::SessionClosed { worker: w.into() })
            .unwrap();
    }

    fn configures_of(&self, generation: u64) -> Vec<Conf> {
        let mut out: Vec<Conf> = self
            .configures
            .iter()
            .filter_map(|(_, m)| match m {
                ToWorker::Configure {
                    generation: g,
                    rank,
                    step,
                    restore_from,
                    priors,
                    ..
                } if *g == generation => Some(Conf {
                    rank: *rank,
                    step: *step,
                    restore_from: restore_from.clone(),
                    priors: priors.to_vec(),
                }),
                _ => None,
            })
            .collect();
        out.sort_by_key(|c| c.rank);
        out
    }

    fn last_generation(&self) -> u64 {
        self.c.job("job").unwrap().rec.generation
    }

    /// Committed step → its manifest; a step committed twice fails.
    fn manifests(&self) -> BTreeMap<u64, Vec<DocId>> {
        let mut out = BTreeMap::new();
        for (m, docs) in &self.committed {
            assert!(
                out.insert(m.step, docs.clone()).is_none(),
                "step {} committed twice",
                m.step
            );
        }
        out
    }

    fn replayed(&self) -> Vec<Arc<PlannedStep>> {
        self.plans.iter().filter(|p| p.replay).cloned().collect()
    }
}

fn with(mut sp: JobSpec, sharding: crate::job::spec::Sharding, every: u64) -> JobSpec {
    sp.parallel.sharding = sharding;
    sp.checkpoint.every_steps = every;
    sp
}

use crate::job::spec::Sharding;

/// Every document of every epoch in the committed manifests exactly once,
/// steps 1..=n without gaps, and every replayed plan carries exactly the
/// documents of the step it re-runs.
fn assert_exactly_once(s: &Sim, d: &[Document], epochs: u32) {
    let manifests = s.manifests();
    let steps: Vec<u64> = manifests.keys().copied().collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
    for id in manifests.values().flatten() {
        *counts.entry(*id).or_default() += 1;
    }
    assert_eq!(counts.len(), d.len());
    assert!(counts.values().all(|&c| c == epochs), "{counts:?}");
    for p in s.replayed() {
        assert_eq!(p.docs, manifests[&p.step], "replayed step {}", p.step);
        let packed: Vec<DocId> = p
            .ranks
            .iter()
            .flatten()
            .flat_map(|m| &m.seqs)
            .map(|q| q.doc)
            .collect();
        let (mut a, mut b) = (packed, p.docs.clone());
        a.sort();
        b.sort();
        assert_eq!(a, b, "replayed step {} packs its documents once", p.step);
    }
}

#[test]
fn ddp_loss_keeps_the_survivors_state_and_replans_the_same_documents() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(36);
    s.submit(
        with(
            spec("steps = 6", "docs_per_step = 6", 1, 3),
            Sharding::Ddp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 3);
    let step4 = s.plans.last().unwrap().clone();
    assert_eq!(step4.step, 4);
    // c dies with step 4 in flight; nothing of step 4 was applied.
    s.inbox.clear();
    s.kill("c");
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    for c in &gen2 {
        assert_eq!((c.step, &c.restore_from), (3, &None), "{c:?}");
        assert!(c
            .priors
            .iter()
            .all(|p| p.as_ref().is_some_and(|p| p.step == 3)));
    }
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.replayed().is_empty(), "survivors keep their state");
    let m = s.manifests();
    assert_eq!(
        m[&4], step4.docs,
        "the aborted step is re-planned with the same documents"
    );
    assert_eq!(s.committed[3].0.world_size, 2);
    assert_exactly_once(&s, &d, 1);
}

/// An fsdp job of `steps` steps that never checkpoints, on three workers,
/// run until one step is left; then a worker dies (the survivors restore
/// from init and replay every committed step).
fn long_run_losing_a_shard(steps: u64) -> (Sim, Arc<[Document]>) {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(steps as usize * 3);
    let sp = spec(&format!("steps = {steps}"), "docs_per_step = 3", 1, 3);
    s.submit(with(sp, Sharding::Fsdp, 0), d.clone());
    s.run_until(|s| s.committed.len() as u64 == steps - 1);
    s.inbox.clear();
    s.kill("c");
    (s, d)
}

#[test]
fn a_replay_past_the_in_memory_window_reads_older_steps_back_from_the_store() {
    let steps = HISTORY_WINDOW + HISTORY_LOAD_STEPS + 30;
    let (mut s, d) = long_run_losing_a_shard(steps);
    // Only the newest steps' documents stayed in memory.
    let job = s.c.job("job").unwrap();
    assert_eq!(job.data.history.len() as u64, HISTORY_WINDOW);
    assert_eq!(job.data.history_stored_through, steps - 1 - HISTORY_WINDOW);
    let mut most = 0;
    while s.step_once() {
        most = most.max(s.c.job("job").unwrap().data.history.len() as u64);
    }
    assert_eq!(s.state(), JobState::Completed);
    // The stored steps were read back in chunks as the replay reached them,
    // and memory never held more than the window and one chunk.
    let stored = steps - 1 - HISTORY_WINDOW;
    assert_eq!(
        s.history_loads,
        vec![(1, HISTORY_LOAD_STEPS), (HISTORY_LOAD_STEPS + 1, stored)]
    );
    assert!(most <= HISTORY_WINDOW + HISTORY_LOAD_STEPS, "{most}");
    // Every committed step replayed with its own documents and lr.
    let replayed = s.replayed();
    assert_eq!(
        replayed.iter().map(|p| p.step).collect::<Vec<_>>(),
        (1..steps).collect::<Vec<_>>()
    );
    for p in &replayed {
        let (m, docs) = &s.committed[p.step as usize - 1];
        assert_eq!((&p.docs, p.lr), (docs, m.lr), "step {}", p.step);
    }
    assert_exactly_once(&s, &d, 1);
}

#[test]
fn a_store_that_cannot_give_a_replayed_step_fails_the_job_naming_it() {
    let (mut s, _) = long_run_losing_a_shard(HISTORY_WINDOW + 5);
    s.history_error = Some("disk on fire".into());
    s.run();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("replaying step 1: reading its record from the store failed: disk on fire"),
        "{reason}"
    );
}

#[test]
fn fsdp_loss_restores_the_checkpoint_and_replays_the_committed_steps() {
    for sharding in [Sharding::Fsdp, Sharding::Zero2] {
        let mut s = Sim::new();
        for w in ["a", "b", "c"] {
            s.worker(w);
        }
        let d = docs(48);
        s.submit(
            with(spec("steps = 8", "docs_per_step = 6", 1, 3), sharding, 2),
            d.clone(),
        );
        // Step 2 is checkpointed, step 3 committed, step 4 in flight.
        s.run_until(|s| s.committed.len() == 3);
        assert_eq!(s.c.job("job").unwrap().rec.last_checkpoint, Some(2));
        s.inbox.clear();
        s.kill("c");
        let gen2 = s.configures_of(2);
        assert_eq!(gen2.len(), 2);
        for c in &gen2 {
            assert_eq!(c.step, 2);
            let dir = c.restore_from.as_ref().expect("a restore");
            assert!(dir.ends_with("checkpoints/step-2"), "{dir:?}");
            assert!(c.priors.iter().all(Option::is_none));
        }
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let replayed = s.replayed();
        assert_eq!(replayed.len(), 1);
        assert_eq!(replayed[0].step, 3);
        assert_eq!(replayed[0].ranks.len(), 2, "re-packed for the new world");
        assert_eq!(replayed[0].lr, s.committed[2].0.lr);
        // The replay comes first, then normal steps from 4 on.
        let after: Vec<(u64, bool)> = s
            .plans
            .iter()
            .skip_while(|p| !p.replay)
            .map(|p| (p.step, p.replay))
            .collect();
        assert_eq!(after[..2], [(3, true), (4, false)]);
        let replay_events = s.events.iter().filter(|(k, _)| k == "replay").count();
        assert_eq!(replay_events, 1);
        assert_exactly_once(&s, &d, 1);
    }
}

#[test]
fn a_join_from_two_to_three_syncs_from_memory_under_ddp_and_fsdp() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let mut s = Sim::new();
        s.worker("a");
        s.worker("b");
        s.submit(
            with(spec("steps = 4", "docs_per_step = 6", 1, 4), sharding, 0),
            docs(30),
        );
        s.step_once();
        s.step_once(); // both Ready → step 1 in flight
        s.worker("c");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
        assert_eq!(worlds, vec![2, 3, 3, 3]);
        let gen2 = s.configures_of(2);
        assert_eq!(gen2.len(), 3);
        for c in &gen2 {
            assert_eq!((c.step, &c.restore_from), (1, &None), "{sharding:?}");
            let prior = |i: usize| c.priors[i].as_ref().map(|p| (p.rank, p.world_size));
            assert_eq!(
                [prior(0), prior(1), prior(2)],
                [Some((0, 2)), Some((1, 2)), None]
            );
        }
        assert_eq!(s.checkpoints, vec![4], "only the final checkpoint");
        assert!(s.replayed().is_empty());
    }
}

#[test]
fn an_fsdp_drain_writes_the_step_first_and_restores_it_without_replay() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(
        with(
            spec("steps = 4", "docs_per_step = 6", 1, 3),
            Sharding::Fsdp,
            0,
        ),
        docs(30),
    );
    for _ in 0..3 {
        s.step_once(); // all Ready → step 1 in flight
    }
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.checkpoints, vec![1, 4], "the drain writes step 1 first");
    // The core asks for each checkpoint's tokenizer files once, whatever
    // the number of writers (the shell no longer guesses from the sends).
    let job = s.c.job("job").unwrap();
    assert_eq!(
        s.tokenizer_dirs,
        vec![job.checkpoint_dir(1), job.checkpoint_dir(4)]
    );
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    assert!(gen2.iter().all(|c| c.step == 1
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-1"))));
    assert!(s.replayed().is_empty());
    let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
    assert_eq!(worlds, vec![3, 2, 2, 2]);
}

#[test]
fn a_ddp_drain_needs_no_checkpoint() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(
            spec("steps = 3", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            0,
        ),
        docs(20),
    );
    s.step_once();
    s.step_once();
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.checkpoints, vec![3]);
    let gen2 = s.configures_of(2);
    assert_eq!((gen2.len(), gen2[0].restore_from.clone()), (1, None));
    assert!(gen2[0].priors[0].is_some());
}

#[test]
fn a_checkpoint_that_fails_to_restore_falls_back_to_the_previous_one() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(48);
    s.submit(
        with(
            spec("steps = 8", "docs_per_step = 6", 1, 3),
            Sharding::Fsdp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 5);
    let rec = &s.c.job("job").unwrap().rec;
    let index: Vec<u64> = rec.checkpoints.iter().map(|c| c.step).collect();
    assert_eq!(index, vec![2, 4]);
    s.inbox.clear();
    s.kill("c");
    assert_eq!(s.configures_of(2)[0].step, 4);
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 2,
        step: 4,
        kind: WorkerErrorKind::RestoreFailed,
        message: "step-4/model-rank1.safetensors: checksum mismatch".into(),
    })
    .unwrap();
    let line = "checkpoint step-4 failed to restore on a: \
                step-4/model-rank1.safetensors: checksum mismatch; falling back to step-2";
    assert!(
        s.events.iter().any(|(_, m)| m.contains(line)),
        "{:?}",
        s.events
    );
    let gen3 = s.configures_of(3);
    assert_eq!(gen3.len(), 2);
    assert!(gen3.iter().all(|c| c.step == 2
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-2"))));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed: Vec<u64> = s.replayed().iter().map(|p| p.step).collect();
    assert_eq!(replayed, vec![3, 4, 5]);
    let rec = &s.c.job("job").unwrap().rec;
    assert_eq!(rec.bad_checkpoints, vec![4]);
    assert!(rec.checkpoints.iter().all(|c| c.step != 4));
    assert_exactly_once(&s, &d, 1);
}

#[test]
fn with_no_good_checkpoint_left_the_job_replays_from_init_or_fails() {
    // From the init: the whole history is known.
    let mut s = Sim::new();
    for w in ["a", "b"] {
        s.worker(w);
    }
    let d = docs(30);
    s.submit(
        with(
            spec("steps = 5", "docs_per_step = 6", 1, 2),
            Sharding::Fsdp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 3);
    s.inbox.clear();
    s.kill("b");
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 2,
        step: 2,
        kind: WorkerErrorKind::RestoreFailed,
        message: "step-2/manifest.json: missing".into(),
    })
    .unwrap();
    let gen3 = s.configures_of(3);
    assert_eq!((gen3[0].step, gen3[0].restore_from.clone()), (0, None));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed: Vec<u64> = s.replayed().iter().map(|p| p.step).collect();
    assert_eq!(replayed, vec![1, 2, 3]);
    assert_exactly_once(&s, &d, 1);

    // Resumed from another job's checkpoint: nothing older to go back to.
    let mut r = Sim::new();
    r.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(with(
            spec("steps = 6", "docs_per_step = 4", 1, 1),
            Sharding::Fsdp,
            0,
        )),
        spec_toml: String::new(),
        docs: docs(30),
        start: Some(JobStart {
            step: 3,
            cursor: Default::default(),
            dir: "/ckpt/step-3".into(),
        }),
    })
    .unwrap();
    r.worker("a");
    r.inbox.clear();
    r.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 3,
        kind: WorkerErrorKind::RestoreFailed,
        message: "/ckpt/step-3/model.safetensors: truncated".into(),
    })
    .unwrap();
    assert_eq!(r.state(), JobState::Failed);
    let reason = &r.c.job("job").unwrap().rec.reason;
    assert!(reason.contains("no state to recover step 3"), "{reason}");
    // The cause the worker named reaches the job's reason (issue 14 item
    // 10: it said only "no state to recover").
    assert!(
        reason.contains("the last restore failed on a: /ckpt/step-3/model.safetensors: truncated"),
        "{reason}"
    );
}

#[test]
fn a_failed_state_sync_reforms_with_a_restore() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(
        with(
            spec("steps = 4", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            1,
        ),
        docs(20),
    );
    s.run_until(|s| s.committed.len() == 2);
    s.worker("b"); // joins at the next boundary
    s.run_until(|s| s.last_generation() == 2);
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "b".into(),
        job: "job".into(),
        generation: 2,
        step: 3,
        kind: WorkerErrorKind::StateSync,
        message: "broadcast from rank 0 timed out".into(),
    })
    .unwrap();
    let gen3 = s.configures_of(3);
    assert_eq!(gen3.len(), 2);
    assert!(gen3
        .iter()
        .all(|c| c.restore_from.is_some() && c.priors.iter().all(Option::is_none)));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Once restored, later generations may use memory again.
    assert!(!s.c.job("job").unwrap().restore_required());
}

#[test]
fn two_seconds_of_silence_declare_a_worker_lost_and_ddp_survivors_continue() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(
            spec("steps = 3", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            0,
        ),
        docs(20),
    );
    s.run_until(|s| s.committed.len() == 1);
    s.inbox.clear();
    let last_b = s.c.worker("b").unwrap().last_seen_ms();
    s.now = last_b + 2_000 - 20; // each handle advances 10 ms
    s.handle(heartbeat("a".into())).unwrap();
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // exactly 2 s: not yet
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // 2.01 s
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.dead.push("b".into());
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 1);
    assert_eq!((gen2[0].step, gen2[0].restore_from.clone()), (1, None));
    assert!(gen2[0].priors[0].is_some());
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.replayed().is_empty());
}

#[test]
fn a_reported_stall_is_not_held_against_workers_but_a_silent_one_is_still_lost() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let seen = s.c.worker("b").unwrap().last_seen_ms();
    // The shell could not listen for 5 s (the lock held): 5.5 s of wall
    // silence is 0.5 s of silence while listening.
    s.now = seen + 5_500;
    s.handle(Event::Tick { stalled_ms: 5_000 }).unwrap();
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    // a heartbeats after the stall; b stays silent, and is lost once it has
    // been silent 2 s of listening time, stall or no stall.
    s.handle(heartbeat("a".into())).unwrap();
    s.now = seen + 5_000 + 2_000 - 10; // each handle advances 10 ms
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // exactly 2 s: not yet
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    // A stall before a worker was last seen is no credit for it.
    s.now = s.c.worker("a").unwrap().last_seen_ms() + 2_000 - 10;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Lost);
}

#[test]
fn a_heartbeat_backlog_is_not_held_against_workers_but_a_silent_one_is_still_lost() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let seen = s.c.worker("c").unwrap().last_seen_ms();
    let beat = |s: &mut Sim, w: &str| {
        let ev = Event::Heartbeat {
            worker: w.into(),
            lag_ms: Some(1_500),
        };
        s.handle(ev).unwrap();
    };
    // From here on the shell reads every heartbeat 1.5 s after it was sent
    // (it is behind, its tick on time); c's are queued behind a's and b's.
    s.now = seen + 1_500;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.heartbeat_backlog_ms(), 1_500);
    // 3.4 s of wall silence, 1.9 s of it while keeping up: not lost (it
    // was before the backlog counted).
    s.now = seen + 3_400;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_ne!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    // Silent on: lost once 2 s past the backlog, the others kept.
    s.now = seen + 3_600;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
}

/// Runs a job to committed step 3 (checkpoint at 2) and hands back what a
/// restarted coordinator reads from its store, plus the held states the
/// workers report when they re-register.
fn run_then_restart(sharding: Sharding) -> (Sim, JobRecord, Vec<CommittedStep>, Vec<HeldState>) {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(spec("steps = 6", "docs_per_step = 4", 2, 2), sharding, 2),
        docs(30),
    );
    s.run_until(|s| s.committed.len() == 3);
    let rec = s.persisted.last().unwrap().clone();
    assert_eq!(rec.step, 3);
    let history = s
        .committed
        .iter()
        .filter(|(m, _)| m.step > rec.history_from)
        .map(|(m, docs)| CommittedStep {
            step: m.step,
            lr: m.lr,
            docs: docs.clone().into(),
            cursor_after: m.cursor.clone(),
        })
        .collect();
    let held = ["a", "b"]
        .iter()
        .map(|w| s.c.worker(w).unwrap().held.clone().unwrap())
        .collect();
    (s, rec, history, held)
}

fn restarted(rec: &JobRecord, history: Vec<CommittedStep>, sharding: Sharding) -> Sim {
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec.clone()),
        spec: Arc::new(with(
            spec("steps = 6", "docs_per_step = 4", 2, 2),
            sharding,
            2,
        )),
        docs: docs(30),
        reference: Default::default(),
        history,
    })
    .unwrap();
    r
}

impl Sim {
    /// Lets a restarted coordinator's wait for old members run out.
    fn after_rejoin_grace(&mut self) {
        self.now += CoordinatorOptions::default().rejoin_grace_ms;
        let alive: Vec<WorkerId> = self
            .c
            .workers()
            .filter(|w| w.connected() && !self.dead.contains(&w.id))
            .map(|w| w.id.clone())
            .collect();
        for worker in alive {
            self.handle(heartbeat(worker)).unwrap();
        }
        self.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    }

    fn worker_holding(&mut self, id: &str, held: Option<HeldState>) {
        self.handle(Event::RegisterWorker {
            id: id.into(),
            reg: Registration {
                hostname: "h".into(),
                collective_addr: format!("127.0.0.1:1{id}"),
                relay_addr: format!("127.0.0.1:2{id}"),
                held,
                ..Default::default()
            },
        })
        .unwrap();
        self.handle(Event::SessionOpened { worker: id.into() })
            .unwrap();
    }
}

#[test]
fn after_a_coordinator_restart_workers_holding_the_committed_step_continue() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let (full, rec, history, held) = run_then_restart(sharding);
        assert!(held.iter().all(|h| h.step == 3));
        let mut r = restarted(&rec, history, sharding);
        r.worker_holding("a", Some(held[0].clone()));
        r.worker_holding("b", Some(held[1].clone()));
        let gen = r.configures_of(rec.generation + 1);
        assert_eq!(gen.len(), 2, "{sharding:?}");
        assert!(gen.iter().all(|c| c.step == 3 && c.restore_from.is_none()));
        assert!(gen[0].priors.iter().all(Option::is_some));
        r.run();
        assert_eq!(r.state(), JobState::Completed);
        assert!(r.replayed().is_empty());
        let steps: Vec<u64> = r.committed.iter().map(|(m, _)| m.step).collect();
        assert_eq!(steps, vec![4, 5, 6]);
        drop(full);
    }
}

#[test]
fn after_a_restart_a_sharded_job_missing_a_rank_restores_and_replays() {
    let (full, rec, history, held) = run_then_restart(Sharding::Fsdp);
    let mut r = restarted(&rec, history, Sharding::Fsdp);
    r.worker_holding("a", Some(held[0].clone()));
    r.worker("z");
    assert!(
        r.configures.is_empty(),
        "b may still come back with its shard"
    );
    let reason = r.c.job("job").unwrap().rec.reason.clone();
    assert!(reason.contains("1 member(s) of generation"), "{reason}");
    r.after_rejoin_grace(); // b never came back
    let gen = r.configures_of(rec.generation + 1);
    assert!(gen.iter().all(|c| c.step == 2
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-2"))));
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    let replayed = r.replayed();
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].docs, full.committed[2].1, "step 3's manifest");
    let steps: Vec<u64> = r.committed.iter().map(|(m, _)| m.step).collect();
    assert_eq!(steps, vec![4, 5, 6]);
}

/// Losses, joins and a drain over two epochs, under ddp and fsdp: every
/// document of each epoch is committed exactly once, and replays re-run
/// exactly the committed documents.
#[test]
fn exactly_once_over_a_run_with_losses_joins_and_replays() {
    let runs = [Sharding::Ddp, Sharding::Fsdp, Sharding::Zero2]
        .into_iter()
        .flat_map(|sharding| [(sharding, false), (sharding, true)]);
    for (sharding, gather) in runs {
        let mut s = Sim::new();
        s.gather = gather;
        s.worker("a");
        s.worker("b");
        let d = docs(53);
        s.submit(
            with(spec("epochs = 2", "docs_per_step = 5", 1, 3), sharding, 3),
            d.clone(),
        );
        let at = |n: usize| move |s: &Sim| s.committed.len() >= n;
        s.run_until(at(4));
        s.worker("c"); // 2 → 3
        s.run_until(at(7));
        s.kill("b"); // mid-step, stale plans still queued
        s.run_until(at(9));
        s.worker("d");
        s.run_until(at(11));
        s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
        s.run_until(at(14));
        s.kill("c");
        s.worker("e");
        s.run();
        assert_eq!(
            s.state(),
            JobState::Completed,
            "{sharding:?}, gather {gather}"
        );
        assert_exactly_once(&s, &d, 2);
        if sharding == Sharding::Ddp {
            assert!(s.replayed().is_empty(), "ddp never restores");
        } else {
            assert!(
                !s.replayed().is_empty(),
                "{sharding:?} restores and replays"
            );
        }
    }
}

/// Per document: the (advantage, ref_logp) its sequences carry in a plan,
/// by role.
type Scalars = (Option<f64>, Option<f64>);

fn scalars_of(p: &PlannedStep) -> BTreeMap<(DocId, u32), Scalars> {
    p.ranks
        .iter()
        .flatten()
        .flat_map(|m| &m.seqs)
        .map(|q| ((q.doc, q.role), (q.advantage, q.ref_logp)))
        .collect()
}

/// The last plan of `step` that was dispatched for real (not a replay).
fn committed_plan(s: &Sim, step: u64) -> Arc<PlannedStep> {
    s.plans
        .iter()
        .rev()
        .find(|p| p.step == step && !p.replay && p.kind == PlanKind::Train)
        .unwrap()
        .clone()
}

#[test]
fn replayed_dpo_and_pg_steps_carry_the_same_annotations() {
    let mut pg = with(
        spec("epochs = 1", "docs_per_step = 6", 1, 3),
        Sharding::Fsdp,
        2,
    );
    pg.data.format = crate::job::spec::DataFormat::Rollouts;
    pg.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    let mut dpo = dpo_spec("steps = 6");
    dpo.parallel.sharding = Sharding::Fsdp;
    dpo.checkpoint.every_steps = 2;
    for (sp, d, key) in [
        (dpo, pairs(150), "ref_logp"),
        (pg, rollouts(12, 4), "advantage"),
    ] {
        let mut s = Sim::new();
        for w in ["a", "b", "c"] {
            s.worker(w);
        }
        s.submit(sp, d);
        s.run_until(|s| s.committed.len() == 3);
        s.inbox.clear();
        s.kill("c");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{key}");
        let replayed = s.replayed();
        assert_eq!(replayed.len(), 1, "{key}");
        let r = &replayed[0];
        let original = scalars_of(&committed_plan(&s, r.step));
        let carried = |&(advantage, ref_logp): &Scalars| match key {
            "advantage" => advantage.is_some(),
            _ => ref_logp.is_some(),
        };
        assert!(original.values().any(carried), "{key}");
        assert_eq!(scalars_of(r), original, "{key}: step {}", r.step);
        assert_eq!(r.normalizers, committed_plan(&s, r.step).normalizers);
    }
}

/// `rl.publish_every = 2`: after steps 2 and 4 every member is asked to
/// write the policy to OUTPUT_DIR/policy/step-N, and the watch stream
/// announces each once, after the last member answered.
#[test]
fn pg_publishes_the_policy_every_n_steps_once_all_ranks_wrote_it() {
    let mut s = Sim::new();
    // 15 groups, every third flat: 10 kept groups of 4, 2 groups a step.
    let d = rollouts(15, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 6", 1, 4);
    sp.data.format = crate::job::spec::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.rl.publish_every = Some(2);
    s.submit(sp, d);
    s.worker("a");
    s.worker("b");
    // Answer until the first publish request is queued, then check that
    // one member's answer alone announces nothing.
    while s.publish_requests.is_empty() {
        assert!(s.step_once(), "no policy was requested");
    }
    let (first, step, _) = s.publish_requests[0].clone();
    assert_eq!(step, 2);
    s.handle(Event::PolicyPublished {
        worker: first.clone(),
        job: "job".into(),
        step: 2,
    })
    .unwrap();
    assert!(
        s.events.iter().all(|(k, _)| k != "policy"),
        "{:?}",
        s.events
    );
    s.inbox
        .retain(|(w, m)| !(w == &first && matches!(m, ToWorker::PublishPolicy { .. })));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 5);
    let root = std::path::Path::new("/tmp/accrue-core-test/policy");
    let mut asked: Vec<(String, u64, std::path::PathBuf)> = s.publish_requests.clone();
    asked.sort();
    assert_eq!(
        asked,
        vec![
            ("a".into(), 2, root.join("step-2")),
            ("a".into(), 4, root.join("step-4")),
            ("b".into(), 2, root.join("step-2")),
            ("b".into(), 4, root.join("step-4")),
        ]
    );
    let policy: Vec<&String> = s
        .events
        .iter()
        .filter(|(k, _)| k == "policy")
        .map(|(_, m)| m)
        .collect();
    assert_eq!(
        policy,
        vec![
            "policy of step 2 published to /tmp/accrue-core-test/policy/step-2",
            "policy of step 4 published to /tmp/accrue-core-test/policy/step-4",
        ]
    );
}
// Operator controls: live step settings, and the manifests that record
// what each step ran with.

use crate::core::manifest::{check_exactly_once, Expectation};
use crate::job::settings::JobUpdate;

fn set(s: &mut Sim, update: JobUpdate) -> Result<()> {
    s.handle(Event::UpdateJob {
        job: "job".into(),
        update,
    })
}

fn universe(d: &[Document]) -> Expectation {
    Expectation {
        universe: d.iter().map(|x| x.id).collect(),
        complete_epochs: 1,
        partial: false,
    }
}

#[test]
fn a_settings_change_applies_from_the_next_step_and_is_in_its_manifest() {
    let mut s = Sim::new();
    let d = docs(40);
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), d.clone());
    assert_eq!(s.c.job("job").unwrap().rec.total_steps, 10);
    s.worker("a");
    s.step_once(); // Ready → step 1 in flight
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            lr: Some(0.5),
            max_tokens: Some(100),
            ..Default::default()
        },
    )
    .unwrap();
    let rec = &s.c.job("job").unwrap().rec;
    assert_eq!(rec.changes.len(), 1);
    assert_eq!(rec.changes[0].from_step, 2, "never the in-flight step");
    assert_eq!(
        s.persisted.last().unwrap().changes,
        rec.changes,
        "persisted"
    );
    // 4 docs, then 36 at 6 per step.
    assert_eq!(rec.total_steps, 7);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sizes: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
    assert_eq!(sizes, vec![4, 6, 6, 6, 6, 6, 6]);
    let first = &s.manifests[0];
    assert_eq!(first.settings.docs_per_step, Some(4));
    assert_eq!(
        (first.settings.max_tokens, first.settings.base_lr),
        (128, 1e-4)
    );
    assert_eq!(first.lr, 1e-4);
    for m in &s.manifests[1..] {
        assert_eq!(m.settings.docs_per_step, Some(6));
        assert_eq!(
            (m.settings.max_tokens, m.settings.base_lr, m.lr),
            (100, 0.5, 0.5)
        );
        assert!(m.ranks.iter().flatten().all(|mb| mb.tokens <= 100));
    }
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn an_aborted_step_replanned_after_a_change_keeps_its_documents() {
    let mut s = Sim::new();
    let d = docs(30);
    s.worker("a");
    s.worker("b");
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), d.clone());
    s.step_once();
    s.step_once(); // both ready → step 1 in flight
    let first_docs = s.plans[0].docs.clone();
    s.inbox.clear();
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            ..Default::default()
        },
    )
    .unwrap();
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(
        s.committed[0].1, first_docs,
        "the re-plan took the same documents"
    );
    let m = &s.manifests[0];
    assert_eq!(
        (m.step, m.attempts, m.world_size, m.generation),
        (1, 2, 1, 2)
    );
    assert_eq!(m.settings.docs_per_step, Some(4));
    assert!(s.manifests[1..].iter().all(|m| m.attempts == 1));
    assert_eq!(s.committed[1].0.docs, 6);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_bad_or_misplaced_update_is_refused_and_changes_nothing() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(20));
    let before = s.persisted.len();
    let e = set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(0),
            tokens_per_step: Some(10),
            ..Default::default()
        },
    )
    .unwrap_err();
    let CoreError::InvalidUpdate { problems, .. } = &e else {
        panic!("{e}");
    };
    let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, vec!["batch.docs_per_step", "batch.tokens_per_step"]);
    assert!(
        e.to_string()
            .contains("batch.docs_per_step: must be at least 1"),
        "{e}"
    );
    let e = set(
        &mut s,
        JobUpdate {
            max_tokens: Some(10),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("data.max_tokens: document 0:"),
        "{e}"
    );
    assert!(s.c.job("job").unwrap().rec.changes.is_empty());
    assert_eq!(s.persisted.len(), before, "nothing persisted");
    let unknown = s.handle(Event::UpdateJob {
        job: "nope".into(),
        update: JobUpdate {
            lr: Some(1.0),
            ..Default::default()
        },
    });
    assert!(matches!(unknown, Err(CoreError::JobNotFound(_))));
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let late = set(
        &mut s,
        JobUpdate {
            lr: Some(1.0),
            ..Default::default()
        },
    );
    assert!(
        matches!(late, Err(CoreError::BadJobState { .. })),
        "{late:?}"
    );
}

#[test]
fn settings_changes_survive_a_coordinator_restart() {
    let mut s = Sim::new();
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 1), docs(30));
    s.worker("a");
    s.step_once();
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(5),
            lr: Some(0.25),
            ..Default::default()
        },
    )
    .unwrap();
    s.step_once(); // step 1 commits, step 2 is dispatched with the change
    let rec = s.persisted.last().unwrap().clone();
    assert_eq!(rec.step, 1);
    let history = s
        .committed
        .iter()
        .map(|(m, d)| super::CommittedStep {
            step: m.step,
            lr: m.lr,
            docs: d.clone().into(),
            cursor_after: m.cursor.clone(),
        })
        .collect();
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec),
        spec: Arc::new(spec("steps = 4", "docs_per_step = 4", 1, 1)),
        docs: docs(30),
        reference: Default::default(),
        history,
    })
    .unwrap();
    r.worker("z");
    r.after_rejoin_grace(); // the old member never comes back
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    assert_eq!(r.manifests.len(), 3);
    assert!(r
        .manifests
        .iter()
        .all(|m| m.settings.docs_per_step == Some(5) && m.lr == 0.25));
}

#[test]
fn a_warmup_schedule_continues_with_the_new_base_lr() {
    let mut sp = spec("steps = 6", "docs_per_step = 2", 1, 1);
    sp.optimizer.warmup_steps = 4;
    sp.optimizer.lr = 1.0;
    let mut s = Sim::new();
    s.submit(sp, docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight at lr 0.25
    set(
        &mut s,
        JobUpdate {
            lr: Some(2.0),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    let lrs: Vec<f64> = s.manifests.iter().map(|m| m.lr).collect();
    assert_eq!(lrs, vec![0.25, 1.0, 1.5, 2.0, 2.0, 2.0]);
}

#[test]
fn drain_during_a_step_aborts_nothing_and_the_next_generation_is_smaller() {
    let mut s = Sim::new();
    let d = docs(24);
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("epochs = 1", "docs_per_step = 6", 1, 3), d.clone());
    for _ in 0..3 {
        s.step_once(); // all ready → step 1 in flight
    }
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.aborts, vec![], "a drain aborts nothing");
    let shape: Vec<(u64, u32, u32)> = s
        .manifests
        .iter()
        .map(|m| (m.generation, m.world_size, m.attempts))
        .collect();
    assert_eq!(shape, vec![(1, 3, 1), (2, 2, 1), (2, 2, 1), (2, 2, 1)]);
    assert!(s
        .manifests
        .iter()
        .all(|m| m.ranks.len() == m.world_size as usize));
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_paused_job_dispatches_nothing_until_resumed() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 2), docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    let plans = s.plans.len();
    // Time passes, a worker joins, an operator changes a setting: still
    // nothing is dispatched.
    s.now += 1_000;
    s.handle(heartbeat("a".into())).unwrap();
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    s.worker("b");
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    assert_eq!(s.plans.len(), plans, "no plan while paused");
    assert_eq!(s.state(), JobState::Paused);
    assert_eq!(s.c.job("job").unwrap().rec.changes[0].from_step, 2);
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sizes: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
    assert_eq!(sizes, vec![4, 2, 2]);
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
        nonfinite: Vec::new(),
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

// ---- drains (a worker's SIGTERM sends Leave = DrainWorker) ----------------

#[test]
fn draining_an_idle_worker_releases_it_once() {
    let mut s = Sim::new();
    s.worker("a");
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    assert_eq!(
        s.releases,
        vec!["a".to_string()],
        "a second drain sends nothing"
    );
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Draining);
    // A drained worker joins no job.
    s.submit(spec("steps = 1", "docs_per_step = 4", 1, 1), docs(8));
    s.run();
    assert_eq!(s.state(), JobState::Pending);
    assert!(s.configures.is_empty());
}

#[test]
fn a_drained_worker_that_reconnected_is_released_again_on_a_new_drain() {
    let mut s = Sim::new();
    s.worker("a");
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    // The session broke before the Release arrived; the worker is back.
    s.handle(Event::SessionClosed { worker: "a".into() })
        .unwrap();
    s.handle(Event::SessionOpened { worker: "a".into() })
        .unwrap();
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    assert_eq!(s.releases, vec!["a".to_string(), "a".to_string()]);
}

#[test]
fn draining_a_configuring_worker_aborts_nothing_and_the_rest_train() {
    let mut s = Sim::new();
    let d = docs(16);
    for w in ["a", "b"] {
        s.worker(w);
    }
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), d.clone());
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Configuring);
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.releases.iter().filter(|w| *w == "b").count(), 1);
    assert_eq!(s.aborts, vec![]);
    assert!(s
        .manifests
        .iter()
        .all(|m| m.world_size == 1 && m.attempts == 1));
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

/// Workers a, b, c on a 24-document job of 6 per step, step 1 in flight.
fn three_workers_step_1_in_flight(sharding: Sharding) -> (Sim, Arc<[Document]>) {
    let mut s = Sim::new();
    let d = docs(24);
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(
        with(spec("epochs = 1", "docs_per_step = 6", 1, 3), sharding, 0),
        d.clone(),
    );
    for _ in 0..3 {
        s.step_once(); // all ready → step 1 in flight
    }
    (s, d)
}

/// Regression (chaos soak): a worker draining at the step boundary whose
/// generation ended without one (another member lost mid-step) was left
/// Draining with no job and never released: the process hung on forever.
#[test]
fn a_draining_member_of_a_generation_ended_by_a_loss_is_released() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let (mut s, d) = three_workers_step_1_in_flight(sharding);
        s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
        assert_eq!(
            s.releases,
            Vec::<String>::new(),
            "{sharding:?}: not before its boundary"
        );
        s.dead.push("b".into());
        s.handle(Event::SessionClosed { worker: "b".into() })
            .unwrap();
        assert_eq!(s.releases, vec!["c".to_string()], "{sharding:?}");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let c = s.releases.iter().filter(|w| *w == "c").count();
        assert_eq!(c, 1, "{sharding:?}: c released once");
        assert!(
            s.manifests.iter().all(|m| m.world_size == 1),
            "{sharding:?}: only a trains after the loss"
        );
        assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
    }
}

/// Regression (chaos soak): a worker lost by heartbeat (SIGSTOP, then
/// SIGCONT) kept heartbeating on its open session into a core that ignores
/// Lost workers, and was never used or told again. Its session is now
/// ended, and the worker registering again is used like any joiner.
#[test]
fn a_worker_lost_with_its_session_open_is_told_and_rejoins_by_registering() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    s.dead.push("c".into());
    s.now += 10_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    assert_eq!(s.ended_sessions, vec!["c".to_string()]);
    // Its late heartbeat changes nothing; its session is over.
    s.handle(heartbeat("c".into())).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    // It registers again (same id, as the worker does) and rejoins.
    s.dead.clear();
    s.worker("c");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let worlds: Vec<u32> = s.manifests.iter().map(|m| m.world_size).collect();
    assert_eq!(
        worlds.first(),
        Some(&2),
        "the first committed step ran without c"
    );
    assert_eq!(worlds.last(), Some(&3), "c rejoined: {worlds:?}");
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

/// Issue 19: a result whose counts disagree with its rank's plan would skew
/// every metric; its worker is dropped and the step re-planned.
#[test]
fn a_result_that_disagrees_with_its_plan_drops_the_worker_and_replans() {
    refused_for(|mbs| {
        let tokens: u64 = mbs.iter().map(|m| m.rows().token_ids.len() as u64).sum();
        let sums = MetricSums {
            tokens: tokens * 2,
            microbatches: mbs.len() as u32,
            documents: 2,
            loss_tokens: 1,
            loss_sum: 1.0,
            ..Default::default()
        };
        (sums, format!("tokens {}, planned {tokens}", tokens * 2))
    });
}

/// Issue 19: loss tokens are checked too (every objective's worker counts
/// them the same way, so a correct result always agrees).
#[test]
fn a_result_with_other_loss_tokens_than_planned_is_refused() {
    refused_for(|mbs| {
        let planned: u64 = mbs
            .iter()
            .map(|m| step::rank_loss_tokens(&m.cu_seq_lens, &m.rows().labels))
            .sum();
        let sums = MetricSums {
            tokens: mbs.iter().map(|m| m.rows().token_ids.len() as u64).sum(),
            microbatches: mbs.len() as u32,
            documents: mbs
                .iter()
                .flat_map(|m| &m.seqs)
                .filter(|q| q.role == 0)
                .count() as u64,
            loss_tokens: planned + 1,
            loss_sum: 1.0,
            ..Default::default()
        };
        (
            sums,
            format!("loss tokens {}, planned {planned}", planned + 1),
        )
    });
}

/// Rank 2 of three answers step 1 with `bad(its microbatches)`: the result
/// is refused naming the returned detail, and the job completes without it.
/// `worker` (its session already gone: it is dead to the simulation)
/// answers `step` of `generation` with `result`; asserts the result is
/// refused: the worker lost, and a generation event saying its result for
/// `noun` disagrees with its plan, naming `want`.
fn assert_refused(
    s: &mut Sim,
    worker: &str,
    generation: u64,
    step: u64,
    result: RankResult,
    noun: &str,
    want: &str,
) {
    s.dead.push(worker.to_string());
    s.handle(Event::StepResult {
        worker: worker.to_string(),
        job: "job".into(),
        generation,
        step,
        sums: result.sums,
        logps: result.logps,
        nonfinite: result.nonfinite,
    })
    .unwrap();
    assert_eq!(
        s.c.worker(worker).unwrap().state,
        WorkerState::Lost,
        "{want}"
    );
    let detail = s
        .events
        .iter()
        .map(|(_, m)| m.as_str())
        .find(|m| m.contains(noun) && m.contains("disagrees with its plan"))
        .expect("a generation event naming the disagreement");
    assert!(detail.contains(want), "{detail}");
}

fn refused_for(bad: impl Fn(&[step::MicrobatchPayload]) -> (MetricSums, String)) {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    let (w, generation, planned) = s
        .inbox
        .iter()
        .find_map(|(w, m)| match m {
            ToWorker::Plan {
                rank: 2,
                generation,
                planned,
                ..
            } => Some((w.clone(), *generation, planned.clone())),
            _ => None,
        })
        .unwrap();
    let (sums, want) = bad(&planned.ranks[2]);
    s.inbox.retain(|(x, _)| *x != w);
    let result = RankResult {
        sums,
        logps: Vec::new(),
        nonfinite: Vec::new(),
    };
    assert_refused(&mut s, &w, generation, 1, result, "step", &want);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.manifests[0].world_size, 2, "step 1 re-planned without it");
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn draining_a_worker_of_a_paused_job_releases_it_and_resume_goes_on_without_it() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.releases, vec!["c".to_string()], "released while paused");
    assert_eq!(s.state(), JobState::Paused, "a drain does not resume");
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.aborts, vec![]);
    let worlds: Vec<u32> = s.manifests.iter().map(|m| m.world_size).collect();
    assert_eq!(worlds, vec![3, 2, 2, 2]);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_drain_requested_twice_mid_step_writes_one_checkpoint_and_releases_once() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Fsdp);
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    // Answer the three step results: the boundary asks for a checkpoint.
    for _ in 0..3 {
        s.step_once();
    }
    assert_eq!(s.checkpoint_msgs, 3, "the drain's checkpoint, one per rank");
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    assert_eq!(s.checkpoint_msgs, 3, "a second drain asks for nothing more");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.releases.iter().filter(|w| *w == "c").count(), 1);
    assert_eq!(s.aborts, vec![]);
    let shape: Vec<(u32, u32)> = s
        .manifests
        .iter()
        .map(|m| (m.world_size, m.attempts))
        .collect();
    assert_eq!(shape, vec![(3, 1), (2, 1), (2, 1), (2, 1)]);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

/// Regression (issue 13): after `accrue set --max-tokens` the workers
/// still computed padding against the submitted value, because a plan did
/// not carry its budget. Every plan sent carries the budget it was packed
/// with.
#[test]
fn max_tokens_set_at_run_time_reaches_the_plans_sent_to_workers() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight with the submitted 128
    set(
        &mut s,
        JobUpdate {
            max_tokens: Some(70),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sent: Vec<u32> = s
        .plans
        .iter()
        .map(|p| {
            let msg = crate::shell::service::convert::to_worker(&ToWorker::Plan {
                job: "job".into(),
                generation: 1,
                rank: 0,
                planned: p.clone(),
            });
            match msg.msg {
                Some(accrue_proto::v1::coordinator_message::Msg::StepPlan(w)) => w.max_tokens,
                other => panic!("expected a plan, got {other:?}"),
            }
        })
        .collect();
    assert_eq!(sent, vec![128, 70, 70, 70, 70]);
    for p in &s.plans[1..] {
        assert!(p.ranks.iter().flatten().all(|mb| mb.tokens() <= 70));
    }
}

/// Regression (issue 13): a replay packed with the submitted `max_tokens`,
/// undoing a lowered value (a memory limit the operator set). A replayed
/// step keeps its documents and learning rate and packs within the lowered
/// budget.
#[test]
fn a_replay_after_a_lowered_max_tokens_packs_with_the_lowered_value() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(48);
    s.submit(
        with(
            spec("steps = 8", "docs_per_step = 6", 1, 3),
            Sharding::Fsdp,
            2,
        ),
        d.clone(),
    );
    // Step 2 is checkpointed, step 3 committed (packed within 128).
    s.run_until(|s| s.committed.len() == 3);
    let original = committed_plan(&s, 3);
    let widest = |p: &PlannedStep| {
        p.ranks
            .iter()
            .flatten()
            .map(|mb| mb.tokens())
            .max()
            .unwrap()
    };
    assert!(
        widest(&original) > 64,
        "the original packing used > 64 tokens"
    );
    set(
        &mut s,
        JobUpdate {
            max_tokens: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    s.inbox.clear();
    s.kill("c");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed = s.replayed();
    assert_eq!(replayed.len(), 1);
    let r = &replayed[0];
    assert_eq!(r.step, 3);
    assert_eq!(r.settings.max_tokens, 64);
    assert!(widest(r) <= 64, "replayed within the lowered budget");
    assert_eq!((r.docs.clone(), r.lr), (original.docs.clone(), original.lr));
    assert_eq!(r.normalizers, original.normalizers);
    assert_exactly_once(&s, &d, 1);
}

/// `checkpoint.keep` bounds the disk: a checkpoint that leaves the index
/// is deleted (after the record persisted), the job's own only — never the
/// checkpoint it resumed from — and never one still in the index.
#[test]
fn checkpoints_beyond_keep_are_deleted_but_never_the_resume_point() {
    let mut s = Sim::new();
    let mut sp = with(
        spec("steps = 6", "docs_per_step = 4", 1, 1),
        Sharding::Ddp,
        1,
    );
    sp.checkpoint.keep = 2;
    s.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(sp),
        spec_toml: String::new(),
        docs: docs(24),
        start: Some(JobStart {
            step: 0,
            cursor: Default::default(),
            dir: PathBuf::from("/elsewhere/imported"),
        }),
    })
    .unwrap();
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let kept: Vec<u64> =
        s.c.job("job")
            .unwrap()
            .rec
            .checkpoints
            .iter()
            .map(|c| c.step)
            .collect();
    assert_eq!(kept, vec![5, 6]);
    // Step 0 (the imported checkpoint) left the index but is not ours.
    assert_eq!(s.removed_checkpoints, vec![1, 2, 3, 4]);
}

/// Issue 18: operators name jobs by id, name or a unique id prefix.
#[test]
fn jobs_resolve_by_id_name_or_unique_prefix() {
    let mut s = Sim::new();
    let mut submit = |id: &str, name: &str, out: &str| {
        let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
        sp.job.name = name.into();
        sp.job.output_dir = out.into();
        s.handle(Event::SubmitJob {
            id: id.into(),
            spec: Arc::new(sp),
            spec_toml: String::new(),
            docs: docs(10),
            start: None,
        })
        .unwrap();
    };
    submit("ab12-x", "sft", "/o1");
    submit("ab34-y", "dpo", "/o2");
    let c = &s.c;
    assert_eq!(c.resolve_job("ab12-x").unwrap(), "ab12-x");
    assert_eq!(c.resolve_job("dpo").unwrap(), "ab34-y");
    assert_eq!(c.resolve_job("ab3").unwrap(), "ab34-y");
    assert_eq!(
        c.resolve_job("nope"),
        Err(CoreError::JobNotFound("nope".into()))
    );
    let Err(CoreError::AmbiguousJob { candidates, .. }) = c.resolve_job("ab") else {
        panic!("a prefix of two ids is ambiguous");
    };
    assert_eq!(candidates, vec!["ab12-x", "ab34-y"]);
    // A name wins over a prefix; an ended job of that name still answers
    // while no live one has it; two live ones are ambiguous.
    s.handle(Event::CancelJob {
        job: "ab12-x".into(),
    })
    .unwrap();
    assert_eq!(s.c.resolve_job("sft").unwrap(), "ab12-x");
    let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
    sp.job.name = "dpo".into();
    sp.job.output_dir = "/o3".into();
    s.handle(Event::SubmitJob {
        id: "cd56-z".into(),
        spec: Arc::new(sp),
        spec_toml: String::new(),
        docs: docs(10),
        start: None,
    })
    .unwrap();
    assert!(matches!(
        s.c.resolve_job("dpo"),
        Err(CoreError::AmbiguousJob { .. })
    ));
}

/// Runs `s` until a plan of `kind` for worker `w` waits in its inbox;
/// takes it out (the worker answers it by hand) and returns its
/// generation and plan.
fn take_plan(s: &mut Sim, w: &str, kind: PlanKind) -> (u64, u32, Arc<step::PlannedStep>) {
    loop {
        let found = s.inbox.iter().position(|(x, m)| {
            x == w && matches!(m, ToWorker::Plan { planned, .. } if planned.kind == kind)
        });
        if let Some(i) = found {
            let Some((
                _,
                ToWorker::Plan {
                    generation,
                    rank,
                    planned,
                    ..
                },
            )) = s.inbox.remove(i)
            else {
                unreachable!("matched above")
            };
            return (generation, rank, planned);
        }
        assert!(s.step_once(), "no {kind:?} plan for {w}");
    }
}

/// The log-probs an honest worker reports for `mbs`.
fn honest_logps(mbs: &[step::MicrobatchPayload]) -> Vec<SeqLogp> {
    mbs.iter()
        .flat_map(|m| m.seqs.iter())
        .map(|q| SeqLogp {
            doc: q.doc,
            role: q.role,
            logp: fake_logp(q.doc, q.role),
            tokens: Vec::new(),
        })
        .collect()
}

/// The counts an honest worker reports for a forward-only plan `mbs`.
fn forward_sums(mbs: &[step::MicrobatchPayload]) -> MetricSums {
    MetricSums {
        microbatches: mbs.len() as u32,
        tokens: mbs.iter().map(|m| m.tokens()).sum(),
        documents: mbs.iter().map(|m| m.seqs.len() as u64).sum(),
        loss_tokens: mbs.iter().map(|m| m.loss_tokens).sum(),
        ..Default::default()
    }
}

/// Eval, reference and probe results are checked against their plans
/// like training ones: a reference chunk whose log-probs are not its
/// plan's sequences (one missing, one for another document, counts off)
/// drops the worker and the chunk is planned again, and the pass still
/// caches every document once (before, a missing log-prob failed the job
/// and a wrong one was cached).
#[test]
fn a_reference_result_that_disagrees_with_its_plan_is_refused() {
    type Bad = fn(&mut MetricSums, &mut Vec<SeqLogp>) -> &'static str;
    let cases: [Bad; 4] = [
        |_, l| {
            l.pop();
            "log-probs"
        },
        |_, l| {
            l[0].doc.line += 1000;
            "log-prob 0 for document"
        },
        |s, _| {
            s.documents += 1;
            "documents"
        },
        |s, _| {
            s.tokens -= 1;
            "tokens"
        },
    ];
    for bad in cases {
        let mut s = Sim::new();
        let d = pairs(150);
        s.submit(dpo_spec("steps = 2"), d.clone());
        s.worker("a");
        s.worker("b");
        let (generation, rank, planned) = take_plan(&mut s, "b", PlanKind::Reference);
        let mbs = &planned.ranks[rank as usize];
        let (mut sums, mut logps) = (forward_sums(mbs), honest_logps(mbs));
        let want = bad(&mut sums, &mut logps);
        let result = RankResult {
            sums,
            logps,
            nonfinite: Vec::new(),
        };
        let step = planned.step;
        assert_refused(
            &mut s,
            "b",
            generation,
            step,
            result,
            "reference chunk",
            want,
        );
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{want}");
        assert_eq!(s.stored_ref.len(), d.len(), "{want}: every pair cached");
        for (id, e) in &s.stored_ref {
            let honest = reference::RefEntry::Pair([fake_logp(*id, 0), fake_logp(*id, 1)]);
            assert_eq!(*e, honest, "{want}: {id} cached as computed");
        }
    }
}

/// Issue 19, bounded state: workers that come and go (each registering
/// under a new id, as a restarted pod does) leave at most
/// [`LOST_WORKERS_KEPT`] lost records, the most recent; a forgotten
/// worker registers again and trains.
#[test]
fn lost_workers_beyond_the_kept_number_are_forgotten_oldest_first() {
    let mut s = Sim::new();
    let churn = workers::LOST_WORKERS_KEPT + 40;
    for i in 0..churn {
        let id = format!("w{i}");
        s.worker(&id);
        s.dead.push(id.clone());
        s.handle(Event::SessionClosed { worker: id }).unwrap();
    }
    let lost: Vec<&str> =
        s.c.workers()
            .filter(|w| w.state == WorkerState::Lost)
            .map(|w| w.id.as_str())
            .collect();
    assert_eq!(lost.len(), workers::LOST_WORKERS_KEPT);
    assert_eq!(s.c.workers().count(), workers::LOST_WORKERS_KEPT);
    assert!(s.c.worker("w0").is_none(), "the first lost is forgotten");
    assert!(
        s.c.worker(&format!("w{}", churn - 1)).is_some(),
        "the last is kept"
    );
    assert!(s.c.worker("w40").is_some(), "the oldest kept");
    assert!(s.c.worker("w39").is_none(), "the newest forgotten");
    // A forgotten worker comes back under its old id and trains.
    s.dead.clear();
    s.worker("w0");
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), docs(8));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.c.worker("w0").unwrap().state, WorkerState::Idle);
}

// Planning the next step while one runs (`ahead`).

/// The step job "job" holds planned ahead.
fn planned_ahead(s: &Sim) -> PlannedStep {
    let job = s.c.job("job").unwrap();
    job.ahead
        .next
        .as_ref()
        .expect("a step planned ahead")
        .planned()
        .clone()
}

/// Steps until the `n`th plan has been sent.
fn until_plans(s: &mut Sim, n: usize) {
    while s.plans.len() < n {
        assert!(s.step_once(), "stalled before plan {n}");
    }
}

#[test]
fn the_next_step_is_planned_while_one_runs_and_sent_as_planned() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 2, 2), docs(40));
    s.worker("a");
    s.worker("b");
    until_plans(&mut s, 1);
    let planned = planned_ahead(&s);
    assert_eq!(planned.step, 2);
    until_plans(&mut s, 2);
    assert_eq!(*s.plans[1], planned, "step 2 went out as planned ahead");
    assert_eq!(planned_ahead(&s).step, 3);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 10);
    // All but the first went out as planned ahead.
    assert_eq!(s.c.job("job").unwrap().ahead.sent, 9);
}

#[test]
fn a_step_planned_ahead_is_planned_again_when_what_it_was_planned_from_changed() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), docs(40));
    s.worker("a");
    until_plans(&mut s, 1);
    assert_eq!(planned_ahead(&s).docs.len(), 4);
    // A live change for step 2 while step 1 runs.
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            ..Default::default()
        },
    )
    .unwrap();
    until_plans(&mut s, 2);
    assert_eq!(s.plans[1].step, 2);
    assert_eq!(s.plans[1].docs.len(), 6, "planned again with the change");
    assert_eq!(s.c.job("job").unwrap().ahead.sent, 0);
    // A member joins while step 2 runs: step 3, planned for one rank, is
    // planned again for the new generation's two.
    assert_eq!(planned_ahead(&s).ranks.len(), 1);
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.plans.iter().any(|p| p.ranks.len() == 2), "re-formed at 2");
    let all: Vec<DocId> = s.committed.iter().flat_map(|(_, d)| d.clone()).collect();
    assert_eq!(all.len(), 40, "every document once");
}

/// The relay roles of generation `g`'s Configures, by rank.
fn relay_roles(s: &Sim, g: u64) -> Vec<Option<crate::core::relay::RelayRole>> {
    let mut roles: Vec<(u32, Option<crate::core::relay::RelayRole>)> = s
        .configures
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Configure {
                generation,
                rank,
                relay,
                role: Role::Trainer,
                ..
            } if *generation == g => Some((*rank, relay.clone())),
            _ => None,
        })
        .collect();
    roles.sort_by_key(|r| r.0);
    roles.into_iter().map(|r| r.1).collect()
}

/// `n` documents committed, each once.
fn assert_every_document_once(s: &Sim, n: usize) {
    let all: Vec<DocId> = s.committed.iter().flat_map(|(_, d)| d.clone()).collect();
    let mut sorted = all.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((all.len(), sorted.len()), (n, n), "every document once");
}

#[test]
fn a_relayed_generations_followers_get_their_messages_through_their_hubs() {
    use crate::core::relay::RelayRole;
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 8", 4, 4), docs(40));
    for w in ["a", "b", "c", "d"] {
        s.worker(w);
    }
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 5);
    // Four ranks: groups of ⌈√4⌉ = 2, hubs 0 and 2.
    let roles = relay_roles(&s, 1);
    let token = match &roles[0] {
        Some(RelayRole::Hub { token, followers }) => {
            assert_eq!(followers, &[1]);
            token.clone()
        }
        other => panic!("rank 0: {other:?}"),
    };
    assert_eq!(
        roles[2],
        Some(RelayRole::Hub {
            token: token.clone(),
            followers: vec![3]
        })
    );
    let members = s.c.job("job").unwrap().rec.members.clone();
    let addr = |r: usize| format!("127.0.0.1:2{}", members[r]);
    assert_eq!(
        roles[1],
        Some(RelayRole::Follower {
            token: token.clone(),
            hub: 0,
            hub_addr: addr(0)
        })
    );
    assert_eq!(
        roles[3],
        Some(RelayRole::Follower {
            token,
            hub: 2,
            hub_addr: addr(2)
        })
    );
    // Relays go to hubs only, and carry every member's plan of every step
    // (the hubs' own too), with the checkpoint requests.
    let hubs = [members[0].clone(), members[2].clone()];
    assert!(
        s.relayed.iter().all(|(h, _)| hubs.contains(h)),
        "{:?}",
        s.relayed
    );
    let mut plans = s.relayed_plans.clone();
    plans.sort();
    let want: Vec<(u32, u64)> = (0..4)
        .flat_map(|r| (1..=5).map(move |step| (r, step)))
        .collect();
    assert_eq!(plans, want);
    assert_every_document_once(&s, 40);
}

#[test]
fn a_relayed_generation_that_loses_a_follower_re_forms_and_relays_again() {
    use crate::core::relay::RelayRole;
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 6", 3, 4), docs(36));
    for w in ["a", "b", "c", "d"] {
        s.worker(w);
    }
    until_plans(&mut s, 2);
    let members = s.c.job("job").unwrap().rec.members.clone();
    // Rank 3 follows rank 2: its plan went through rank 2's relay.
    s.kill(&members[3]);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Three ranks: groups of 2; rank 2's group has no follower.
    let last = s.c.job("job").unwrap().rec.generation;
    let roles = relay_roles(&s, last);
    assert_eq!(roles.len(), 3, "{roles:?}");
    assert!(matches!(&roles[0], Some(RelayRole::Hub { followers, .. }) if followers == &[1]));
    assert!(matches!(&roles[1], Some(RelayRole::Follower { .. })));
    assert_eq!(roles[2], None);
    assert_every_document_once(&s, 36);
}
