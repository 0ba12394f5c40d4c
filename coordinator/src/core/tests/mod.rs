//! Scenario tests of the state machine: loops over `handle`, no sockets, no
//! clock. Simulated workers answer Configure with Ready and plans with
//! results computed from the plan itself.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

#[allow(unused_imports)]
use self::{
    control_plane::*, disagg::*, drains::*, engine::*, fault::*, mixture::*, objectives::*,
    operations::*, recovery::*, rl_loop::*, settings::*, stream::*, training::*,
};
use super::job_data::{HISTORY_LOAD_STEPS, HISTORY_WINDOW};
use super::*;
use crate::core::manifest::{check_exactly_once, Expectation};
use crate::job::parallel::Sharding;
use crate::job::settings::JobUpdate;
use crate::job::spec::JobSpec;
use crate::rl::generation::GenCompletion;
use crate::rl::prompts::{Prompt, PromptSet};
use crate::rl::rounds as generate;
use crate::rl::rounds::EngineRound;
use crate::rl::stream::RolloutWrite;
use crate::rl::stream::{AdmitCounts, RolloutStream, StoredStream, StreamMeta};
use crate::stream::doc::Rollout;
use crate::stream::doc::{DocBody, DocId, Document, Sequence};
use std::collections::BTreeSet;

mod context;
mod control_plane;
mod disagg;
mod drains;
mod engine;
mod fault;
mod mixture;
mod objectives;
mod operations;
mod recovery;
mod restarts;
mod rl_loop;
mod serve;
mod settings;
mod stream;
mod training;

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
    /// Multi-turn rounds whose environments the core asked to step.
    to_step: Vec<crate::rl::episode::EpisodesToStep>,
    /// Checkpoint tokenizer writes to acknowledge: (job, step).
    tokenizer_acks: VecDeque<(JobId, u64)>,
    /// Leave them to the test (a slow or failing write).
    hold_tokenizer_acks: bool,
    /// Endpoint calls handed back to the shell, in order.
    served: Vec<crate::rl::serve::Served>,
    /// Whether `run` scores rounds itself (else a test answers them).
    auto_score: bool,
    /// Leave environment steps to the test even when `auto_score`.
    hold_steps: bool,
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
            to_step: Vec::new(),
            tokenizer_acks: VecDeque::new(),
            hold_tokenizer_acks: false,
            served: Vec::new(),
            auto_score: true,
            hold_steps: false,
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
        let result = self.handle_one(e);
        // The shell's tokenizer writes finish at once (before any worker's
        // checkpoint ack) unless a test holds them.
        while !self.hold_tokenizer_acks {
            let Some((job, step)) = self.tokenizer_acks.pop_front() else {
                break;
            };
            // (A job that ended meanwhile is gone: nothing to acknowledge.)
            let _ = self.handle_one(Event::TokenizerWritten { job, step });
        }
        result
    }

    fn handle_one(&mut self, e: Event) -> Result<()> {
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
                Effect::StepEpisodes(s) => self.to_step.push(*s),
                Effect::Served { served, .. } => self.served.extend(served),
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
                Effect::WriteTokenizer { job, dir, step } => {
                    self.tokenizer_dirs.push(dir);
                    // As the shell does once the files are written.
                    if let Some(step) = step {
                        self.tokenizer_acks.push_back((job, step));
                    }
                }
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
            if self.auto_score && !self.hold_steps && !self.to_step.is_empty() {
                let st = self.to_step.remove(0);
                self.handle(rl_loop::stepped(&st)).unwrap();
                return true;
            }
            if self.auto_score && !self.to_score.is_empty() {
                let r = self.to_score.remove(0);
                self.handle(rl_loop::scored(&r)).unwrap();
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
                group,
                planned,
            } => {
                // Every rank of a context-parallel group runs its group's
                // microbatches and reports the group's sums.
                let mbs = &planned.ranks[group as usize];
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
                generation: self
                    .c
                    .job(&job)
                    .ok()
                    .and_then(|j| j.gen())
                    .map_or(0, |g| g.id),
                job,
                step,
            },
            ToWorker::Generate {
                job,
                generation,
                plan,
                ..
            } => rl_loop::generated(w, job, generation, &plan),
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
                    bytes: 0,
                    seconds: 0.0,
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
