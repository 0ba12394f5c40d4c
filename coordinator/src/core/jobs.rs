//! A job as the coordinator tracks it: its persisted record, its data, and
//! where it is in its life ([`Phase`]: waiting for a generation, running
//! one, or ended), rebuilt after a restart.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tracing::info;

use super::bisect::Bisection;
use super::deadline::Pace;
use super::effects::{Effect, Effects, Persist, ToWorker, WatchItem};
use super::eval::{EvalRun, EvalSet};
use super::metrics::MetricSums;
use super::record::JobRecord;
use super::recovery::Decision;
use super::reference::{self, ReferenceCache, ReferenceLogps, SeqLogp};
use super::step::{Annotations, PlannedStep};
use super::types::{AbortReason, CommittedStep, EventKind, JobState, PlanKind, WorkerId};
use crate::job::settings::Settings;
use crate::job::sources::Source;
use crate::job::spec::JobSpec;
use crate::rl::rollouts::{self, RolloutPlan};
use crate::rl::stream::RolloutStream;
use crate::stream::cursor::{Order, SourceOrder};
use crate::stream::doc::{DocId, Document};

/// A fixed membership of a job: ranks 0..W-1.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub id: u64,
    /// Worker of each rank.
    pub members: Vec<WorkerId>,
    /// Ranks that reported Ready for this generation ...
    ready: Vec<bool>,
    /// ... and how many: "all ready?" is asked on every event that may
    /// dispatch, so it is O(1), not a scan of W ranks (issue 19).
    ready_count: u32,
    /// The step its members hold: the configured step, then advanced by
    /// every replayed or committed step.
    pub step: u64,
    /// Where its state came from, and the steps it replays.
    pub decision: Decision,
    /// Formed under "restore from disk" (a state sync had failed): until it
    /// is ready, the next generation must restore from disk too.
    pub disk_only: bool,
    /// Each member's rank: every result, error and Ready looks its sender
    /// up, so this is O(log W), not a scan of the members (issue 19).
    /// Shared: a generation is cloned often and never changes.
    ranks: Arc<BTreeMap<WorkerId, u32>>,
    /// A disaggregated RL generation's generators (`rl.generators`):
    /// workers outside the training ranks that only generate. Empty in
    /// every other generation. (Boxed: most generations have none.)
    pub generators: Box<GeneratorSet>,
}

/// The generators of a disaggregated generation, by their rank among the
/// generators (what their `GeneratePlan`s carry), and which are ready.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GeneratorSet {
    pub members: Vec<WorkerId>,
    ready: Vec<bool>,
    ready_count: u32,
}

impl GeneratorSet {
    pub fn new(members: Vec<WorkerId>) -> GeneratorSet {
        GeneratorSet {
            ready: vec![false; members.len()],
            ready_count: 0,
            members,
        }
    }

    pub fn len(&self) -> u32 {
        self.members.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// A generator's rank among the generators (a scan: generators answer
    /// once per round, never on the per-step path).
    pub fn rank_of(&self, worker: &str) -> Option<u32> {
        self.members
            .iter()
            .position(|m| m == worker)
            .map(|i| i as u32)
    }

    pub fn all_ready(&self) -> bool {
        self.ready_count as usize == self.ready.len()
    }

    /// Notes generator `rank`'s Ready (again is a no-op).
    pub fn mark_ready(&mut self, rank: u32) {
        if let Some(r) = self.ready.get_mut(rank as usize).filter(|r| !**r) {
            *r = true;
            self.ready_count += 1;
        }
    }
}

impl Generation {
    /// A generation of `members` (rank = position), none ready yet.
    pub fn new(id: u64, members: Vec<WorkerId>, decision: Decision, disk_only: bool) -> Self {
        let ranks = Arc::new(
            members
                .iter()
                .enumerate()
                .map(|(r, m)| (m.clone(), r as u32))
                .collect(),
        );
        Generation {
            id,
            ready: vec![false; members.len()],
            ready_count: 0,
            members,
            step: decision.step,
            decision,
            disk_only,
            ranks,
            generators: Box::default(),
        }
    }

    /// The same generation with these generators beside its training ranks.
    pub fn with_generators(mut self, generators: Vec<WorkerId>) -> Self {
        self.generators = Box::new(GeneratorSet::new(generators));
        self
    }

    /// Every worker of the generation: the training ranks, then the
    /// generators.
    pub fn everyone(&self) -> impl Iterator<Item = &WorkerId> {
        self.members.iter().chain(&self.generators.members)
    }

    /// The training world size (generators are not in it).
    pub fn world_size(&self) -> u32 {
        self.members.len() as u32
    }

    pub fn all_ready(&self) -> bool {
        self.ready_count as usize == self.ready.len()
    }

    /// Notes `rank`'s Ready (again is a no-op); true when it was the last.
    pub fn mark_ready(&mut self, rank: u32) -> bool {
        match self.ready.get_mut(rank as usize) {
            Some(r) if !*r => {
                *r = true;
                self.ready_count += 1;
                self.all_ready()
            }
            _ => false,
        }
    }

    pub fn rank_of(&self, worker: &str) -> Option<u32> {
        self.ranks.get(worker).copied()
    }
}

/// A dispatched step waiting for every rank's result.
#[derive(Debug, Clone)]
pub struct InFlight {
    pub planned: Arc<PlannedStep>,
    pub started_ms: i64,
    pub results: BTreeMap<u32, MetricSums>,
    /// Reference plans: the sequences' log-probs reported so far.
    pub logps: Vec<SeqLogp>,
    /// Probe plans: each rank's non-finite microbatches.
    pub nonfinite: BTreeMap<u32, Vec<u32>>,
}

/// Committed steps whose replay history stays in memory; older steps'
/// documents are read back from the store only if a replay reaches them.
pub const HISTORY_WINDOW: u64 = 64;

/// Steps of stored history a replay loads back at a time.
pub const HISTORY_LOAD_STEPS: u64 = 64;

/// What a formed generation is doing.
#[derive(Debug, Clone)]
pub enum Work {
    /// Configuring, or between steps: the next plan goes out once every
    /// member is ready (and the job is running).
    Idle,
    InFlight(InFlight),
    /// A generation round of the RL loop (`crate::rl::rounds`): the members
    /// sample completions with the committed step's weights.
    Generating(Box<crate::rl::rounds::Round>),
    /// The current step's checkpoint is being written and nothing is
    /// dispatched meanwhile; then the generation goes on as `then` says.
    AwaitingCheckpoint(AfterCheckpoint),
}

/// What a generation waiting for its checkpoint does once it is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterCheckpoint {
    /// A zero2/fsdp drain: the leaver's shards had to reach disk before the
    /// generation re-forms.
    Regroup,
    /// The job trained all it was asked to: it completes (with this
    /// detail) only once its final checkpoint is durable.
    Complete(String),
}

/// A generation and its work.
#[derive(Debug, Clone)]
pub struct Active {
    pub gen: Generation,
    pub work: Work,
}

/// Where a job is in its life.
#[derive(Debug, Clone)]
pub enum Phase {
    /// No generation: waiting for workers.
    Waiting {
        /// After a coordinator restart, form no generation before this time
        /// unless every member of the last one is back.
        rejoin_until_ms: Option<i64>,
        /// The next generation must restore from disk (a state sync or a
        /// memory-only restore failed).
        disk_only: bool,
    },
    /// (Boxed: the generation and its work are large, the other phases
    /// small.)
    Active(Box<Active>),
    /// Completed, failed or cancelled.
    Ended,
}

/// Operator requests that take effect at the next step boundary. They
/// outlive a generation that ends before the boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoundaryRequests {
    pub pause: bool,
    pub checkpoint: bool,
}

/// A job's documents and everything derived from them.
#[derive(Debug, Clone)]
pub struct JobData {
    /// The tokenized dataset (shared, read-only).
    pub docs: Arc<[Document]>,
    /// A cached reference (DPO, or PG with a KL penalty): the log-probs so far.
    pub reference: Option<ReferenceCache>,
    /// Policy gradient: groups and advantages.
    pub rollouts: Option<RolloutPlan>,
    /// Streamed PG jobs (`data.source = "stream"`): the queue of groups.
    pub stream: Option<RolloutStream>,
    /// The RL loop (`data.source = "generate"`): prompts and rounds.
    pub rollout_loop: Option<crate::rl::rounds::LoopState>,
    /// The loop's rounds scored since the last commit (step metrics).
    pub loop_stats: crate::rl::rounds::RoundStats,
    /// Committed steps after `rec.history_from` held in memory for replay:
    /// the newest [`HISTORY_WINDOW`], and those a replay in progress loaded
    /// back from the store (issue 19: a job that never checkpoints would
    /// otherwise hold every step's documents for its whole run).
    pub history: BTreeMap<u64, CommittedStep>,
    /// Committed steps after `rec.history_from` and at or below this were
    /// dropped from memory: the store holds their records, and a replay
    /// loads them back ([`super::effects::Effect::LoadHistory`]).
    pub history_stored_through: u64,
    /// The first step of a load of stored history asked of the shell and
    /// not yet answered.
    pub history_loading: Option<u64>,
    /// Documents by id (built on the first replay).
    doc_index: OnceLock<HashMap<DocId, usize>>,
    /// The training sources (one for a plain `data.train`).
    pub sources: Vec<Source>,
    /// The source of each file of the job (`DocId::file` indexes it).
    pub file_source: Vec<u32>,
    /// How the file stream is served (the spec's weights; see
    /// [`Self::order_at`] for a step's).
    pub order: Order,
    /// `[eval]`: the eval documents (never in the training stream).
    pub eval: Option<EvalSet>,
}

impl JobData {
    /// The generation running apart from the trainers (`rl.engine` or
    /// `rl.generators`), if the job has one.
    pub fn engine_mut(&mut self) -> Option<&mut crate::rl::rounds::EngineLoop> {
        self.rollout_loop.as_mut().and_then(|l| l.engine.as_mut())
    }

    /// A job's data at submit or restore: the cached reference so far,
    /// its rollout groups (admitted against committed step `step`) and its
    /// stream queue, as its spec asks.
    pub fn new(
        job: &str,
        spec: &JobSpec,
        docs: Arc<[Document]>,
        reference: Option<ReferenceLogps>,
        step: u64,
    ) -> JobData {
        // Eval documents come after the training ones (their files follow
        // the training files): split them off.
        let train_files = spec.data.files().len() as u32;
        let (docs, eval) = match &spec.eval {
            Some(e) if docs.iter().any(|d| d.id.file >= train_files) => {
                let (t, ev): (Vec<Document>, Vec<Document>) =
                    docs.iter().cloned().partition(|d| d.id.file < train_files);
                let sources = crate::job::sources::resolve(&e.sources, train_files, None);
                let mut file_source = vec![0; train_files as usize];
                file_source.extend(crate::job::sources::file_sources(&sources));
                let set = EvalSet {
                    docs: ev.into(),
                    file_source: file_source.clone(),
                    sources,
                    every_steps: e.every_steps,
                    dpo_beta: spec.objective.dpo().map(|d| d.beta),
                };
                (Arc::from(t), Some(set))
            }
            _ => (docs, None),
        };
        let rollouts = spec.objective.pg().map(|pg| {
            let plan = rollouts::prepare(&docs, &pg, spec.rl.max_staleness, step);
            info!(
                job,
                groups = plan.units.len(),
                zero_variance_groups = plan.zero_variance_groups,
                rejected_stale = plan.rejected_stale,
                "rollouts grouped"
            );
            plan
        });
        let sources = spec.data.train_sources(spec.job.epochs);
        let file_source = crate::job::sources::file_sources(&sources);
        let len = rollouts.as_ref().map_or(docs.len(), |r| r.units.len()) as u64;
        let order = if rollouts.is_some() || sources.len() < 2 {
            Order::single(spec.job.seed, spec.data.shuffle, len, spec.job.epochs)
        } else {
            // Documents come in source order: each source is one range.
            let mut parts: Vec<SourceOrder> = sources
                .iter()
                .map(|s| SourceOrder {
                    start: 0,
                    len: 0,
                    epochs: s.epochs,
                })
                .collect();
            for d in docs.iter() {
                let src = file_source.get(d.id.file as usize).copied().unwrap_or(0);
                parts[src as usize].len += 1;
            }
            let mut start = 0;
            for p in &mut parts {
                p.start = start;
                start += p.len;
            }
            let weights = sources.iter().map(|s| s.weight).collect();
            Order::mixture(spec.job.seed, spec.data.shuffle, parts, weights)
        };
        JobData {
            reference: reference::needs_cache(spec)
                .then(|| ReferenceCache::new(reference.unwrap_or_default())),
            rollouts,
            stream: RolloutStream::for_spec(spec),
            rollout_loop: spec.data.is_generate().then(|| {
                let l = crate::rl::rounds::LoopState::new(spec.job.seed, spec.data.shuffle);
                match &spec.rl.engine {
                    // A frozen engine serves the starting policy throughout.
                    Some(e) => l.with_engine(
                        (e.reload == crate::job::engine::EngineReload::None).then_some(step),
                    ),
                    // Generator workers start with no known policy.
                    None if spec.rl.generators.is_some() => l.with_engine(None),
                    None => l,
                }
            }),
            loop_stats: Default::default(),
            history: BTreeMap::new(),
            history_stored_through: 0,
            history_loading: None,
            doc_index: OnceLock::new(),
            docs,
            sources,
            file_source,
            order,
            eval,
        }
    }

    /// Whether the cached reference holds every document that needs one
    /// (the eval pairs too).
    pub fn reference_complete(&self) -> bool {
        self.reference.as_ref().is_none_or(|c| {
            c.complete(&self.docs) && self.eval.as_ref().is_none_or(|e| c.complete(&e.docs))
        })
    }

    /// Every document of the job: training, then eval.
    pub fn all_docs(&self) -> impl Iterator<Item = &Document> {
        self.docs
            .iter()
            .chain(self.eval.iter().flat_map(|e| e.docs.iter()))
    }

    /// The source index of a document of the job.
    pub fn source_of(&self, doc: &DocId) -> u32 {
        self.file_source
            .get(doc.file as usize)
            .copied()
            .unwrap_or(0)
    }

    /// The name of source `s`.
    pub fn source_name(&self, s: u32) -> &str {
        self.sources
            .get(s as usize)
            .map_or("train", |s| s.name.as_str())
    }

    /// What this job's plans carry besides the documents.
    pub fn annotations(&self) -> Annotations<'_> {
        Annotations {
            reference: self.reference.as_ref(),
            rollouts: self.rollouts.as_ref(),
            file_source: Some(&self.file_source),
        }
    }

    /// Units of the job's file stream: documents, or groups for PG.
    pub fn stream_len(&self) -> usize {
        self.rollouts
            .as_ref()
            .map_or(self.docs.len(), |r| r.units.len())
    }

    /// Documents by id.
    pub fn doc_index(&self) -> &HashMap<DocId, usize> {
        self.doc_index.get_or_init(|| {
            self.docs
                .iter()
                .enumerate()
                .map(|(i, d)| (d.id, i))
                .collect()
        })
    }
}

/// A job with its live state.
#[derive(Debug, Clone)]
pub struct Job {
    pub rec: JobRecord,
    pub spec: Arc<JobSpec>,
    pub data: JobData,
    pub phase: Phase,
    pub requests: BoundaryRequests,
    /// Checkpoints being written (asynchronously; training goes on): per
    /// step, the workers asked to write it and whether each reported it
    /// durable. It counts once all have.
    pub pending_checkpoints: BTreeMap<u64, BTreeMap<WorkerId, bool>>,
    /// Published policies (`rl.publish_every`) by step: members yet to answer.
    pub publish_acks: BTreeMap<u64, BTreeSet<WorkerId>>,
    /// The last plan dispatched: (generation, step, kind), so that a result
    /// arriving after its generation ended still tells what the worker holds.
    pub last_plan: Option<(u64, u64, PlanKind)>,
    /// The last training step dispatched and how many times it was
    /// (1 + aborts before commit); live only.
    pub attempts: (u64, u32),
    /// Why the last aborted attempt ended (live only).
    pub last_abort: String,
    /// The last failed restore, as its worker told it (live only): when no
    /// source of state is left, the job's failure names this cause.
    pub last_restore_failure: Option<String>,
    /// Generations in a row that failed to restore their state (live
    /// only; reset when one is ready): a source that keeps failing ends
    /// the job at `faults.max_step_attempts` instead of being retried
    /// forever.
    pub restore_failures: u32,
    /// How fast its plans ran: the step deadline's basis (live only).
    pub pace: Pace,
    /// A non-finite step's documents being bisected (live only).
    pub bisection: Option<Bisection>,
    /// An evaluation owed or under way (live only: lost with the
    /// coordinator, never needed for correctness).
    pub eval_run: Option<EvalRun>,
    /// The next step, planned while the current one runs (see `ahead`) ...
    pub ahead: Option<super::ahead::Ahead>,
    /// ... and how many steps went out so planned (the others were planned
    /// at dispatch: the first, and any after a change).
    pub sent_ahead: u64,
}

impl Job {
    pub fn new(rec: JobRecord, spec: Arc<JobSpec>, data: JobData) -> Self {
        let phase = if rec.state.is_terminal() {
            Phase::Ended
        } else {
            Phase::Waiting {
                rejoin_until_ms: None,
                disk_only: false,
            }
        };
        Self {
            rec,
            spec,
            data,
            phase,
            requests: BoundaryRequests::default(),
            pending_checkpoints: BTreeMap::new(),
            publish_acks: BTreeMap::new(),
            last_plan: None,
            attempts: (0, 0),
            last_abort: String::new(),
            last_restore_failure: None,
            restore_failures: 0,
            pace: Pace::default(),
            bisection: None,
            eval_run: None,
            ahead: None,
            sent_ahead: 0,
        }
    }

    /// The settings of the job's steps (spec plus live changes).
    pub fn settings(&self) -> Settings<'_> {
        Settings::new(&self.spec, &self.rec.changes)
    }

    /// How step `step` is served: the job's order with the mixture's
    /// weights in force at that step.
    pub fn order_at(&self, step: u64) -> Order {
        let base = &self.data.order;
        if base.mix.is_empty() {
            return base.clone();
        }
        let (weights, rev) = self.settings().weights_at(step, &self.data.sources);
        if rev == 0 {
            return base.clone();
        }
        base.with_weights(weights, rev)
    }

    /// The current generation and its work, if one is formed.
    pub fn active(&self) -> Option<&Active> {
        match &self.phase {
            Phase::Active(a) => Some(a),
            _ => None,
        }
    }

    pub fn active_mut(&mut self) -> Option<&mut Active> {
        match &mut self.phase {
            Phase::Active(a) => Some(a),
            _ => None,
        }
    }

    /// The current generation, if one is formed.
    pub fn gen(&self) -> Option<&Generation> {
        self.active().map(|a| &a.gen)
    }

    /// The step in flight, if any.
    pub fn inflight(&self) -> Option<&InFlight> {
        match self.active().map(|a| &a.work) {
            Some(Work::InFlight(f)) => Some(f),
            _ => None,
        }
    }

    /// Whether the next generation must restore from disk (a state sync
    /// failed, and no generation has become ready since).
    pub fn restore_required(&self) -> bool {
        match &self.phase {
            Phase::Waiting { disk_only, .. } => *disk_only,
            Phase::Active(a) => a.gen.disk_only && !a.gen.all_ready(),
            Phase::Ended => false,
        }
    }

    /// True while the generation re-runs committed steps after a restore.
    pub fn replaying(&self) -> bool {
        self.gen().is_some_and(|g| g.step < self.rec.step)
    }

    /// Where the checkpoint of `step` is written.
    pub fn checkpoint_dir(&self, step: u64) -> PathBuf {
        self.spec
            .job
            .output_dir
            .join("checkpoints")
            .join(format!("step-{step}"))
    }

    /// Whether the committed step's state is on disk (a checkpoint of it,
    /// or nothing trained yet).
    pub fn step_durable(&self) -> bool {
        self.rec.step == 0 || self.rec.checkpoints.iter().any(|c| c.step == self.rec.step)
    }

    /// The first step of the replay history kept in memory: the newest
    /// [`HISTORY_WINDOW`] committed steps after `rec.history_from` (older
    /// ones are read back from the store when a replay reaches them).
    pub fn history_window_start(rec: &JobRecord) -> u64 {
        rec.history_from
            .max(rec.step.saturating_sub(HISTORY_WINDOW))
            + 1
    }

    /// Drops from memory the replay history below the window (the store
    /// holds it), except steps from `keep` on (a replay in progress); the
    /// window starts after `rec.history_from`, so nothing at or below it
    /// (no longer replayable) stays either.
    pub fn trim_history(&mut self, keep: Option<u64>) {
        let start = Job::history_window_start(&self.rec);
        let cut = keep.map_or(start, |k| k.min(start));
        let h = &mut self.data.history;
        *h = h.split_off(&cut);
        self.data.history_stored_through = self.data.history_stored_through.max(start - 1);
    }

    /// True when the job has trained all it was asked to.
    pub fn finished(&self) -> bool {
        match self.spec.job.steps {
            Some(steps) => self.rec.step >= steps,
            // A stream without job.steps runs until cancelled.
            None if self.data.stream.is_some() => false,
            None => self.data.order.exhausted(&self.rec.cursor),
        }
    }

    /// The first step a change made now applies to.
    pub fn next_new_step(&self) -> u64 {
        self.rec.step.max(self.attempts.0) + 1
    }

    /// Counts a dispatch of a training step (a re-dispatch after an abort
    /// is another attempt of the same step).
    pub fn note_dispatch(&mut self, p: &PlannedStep) {
        if p.kind != PlanKind::Train {
            return;
        }
        self.attempts = match self.attempts {
            (s, n) if s == p.step => (s, n + 1),
            _ => (p.step, 1),
        };
    }

    /// The time by which the step in flight must have every result.
    pub fn step_deadline_ms(&self) -> Option<i64> {
        let f = self.inflight()?;
        let tokens = f.planned.busiest_rank_tokens();
        let timeout = self
            .pace
            .deadline_ms(self.spec.faults.step_timeout_s, tokens);
        Some(f.started_ms.saturating_add(timeout))
    }

    /// The generation round in flight on the job's workers (the RL loop),
    /// if any: the training ranks' (colocated, or eval prompts), else the
    /// generators' (disaggregated).
    pub fn round(&self) -> Option<&crate::rl::rounds::Round> {
        self.round_on().map(|(r, _)| r)
    }

    /// [`Self::round`] and the workers it was dealt to, by rank.
    pub fn round_on(&self) -> Option<(&crate::rl::rounds::Round, &[WorkerId])> {
        let a = self.active()?;
        if let Work::Generating(r) = &a.work {
            return Some((r, &a.gen.members));
        }
        if a.gen.generators.is_empty() {
            return None;
        }
        let e = self.data.rollout_loop.as_ref()?.engine.as_ref()?;
        let r = e.round.as_deref()?;
        Some((r, &a.gen.generators.members))
    }

    /// When the round in flight is overdue: after `faults.step_timeout_s`,
    /// else the deadline floor (a round's pace is not learned: its length
    /// depends on what the policy samples).
    pub fn round_deadline_ms(&self) -> Option<i64> {
        let r = self.round()?;
        let timeout = match self.spec.faults.step_timeout_s {
            Some(s) => (s * 1000.0).ceil() as i64,
            None => super::deadline::FLOOR_MS as i64,
        };
        Some(r.started_ms.saturating_add(timeout))
    }

    /// Times step `step` was dispatched so far (at least 1).
    pub fn attempts_of(&self, step: u64) -> u32 {
        if self.attempts.0 == step {
            self.attempts.1
        } else {
            1
        }
    }

    /// Pauses the job at its current step boundary.
    pub fn pause_now(&mut self, now_ms: i64, fx: &mut Effects) {
        self.rec.state = JobState::Paused;
        self.rec.reason = "paused by operator".into();
        fx.persist(Persist::Job(Box::new(self.rec.clone())));
        let msg = format!("paused at step {}", self.rec.step);
        fx.push(self.event(EventKind::State, msg, now_ms));
    }

    /// A watch event about this job, in its current state.
    pub fn event(&self, kind: EventKind, message: String, now_ms: i64) -> Effect {
        self.event_ending(kind, message, None, None, now_ms)
    }

    /// A watch event that ends something (a generation, the job): why, and
    /// which step in flight it abandoned.
    pub fn event_ending(
        &self,
        kind: EventKind,
        message: String,
        reason: Option<AbortReason>,
        aborted_step: Option<u64>,
        now_ms: i64,
    ) -> Effect {
        Effect::Publish {
            job: self.rec.id.clone(),
            item: WatchItem::Event {
                kind,
                message,
                state: self.rec.state,
                unix_ms: now_ms,
                reason,
                aborted_step,
            },
        }
    }

    /// Asks every member to write the committed step's checkpoint (once
    /// per step). Mid-replay the members do not hold the committed step
    /// yet: the checkpoint is taken at the next commit instead.
    pub fn request_checkpoint(&mut self, fx: &mut Effects) {
        let Some(gen) = self.gen() else { return };
        if gen.step < self.rec.step {
            self.requests.checkpoint = true;
            return;
        }
        let step = self.rec.step;
        if self.pending_checkpoints.contains_key(&step)
            || self.rec.checkpoints.iter().any(|c| c.step == step)
        {
            return;
        }
        let dir = self.checkpoint_dir(step);
        // The workers write weights and optimizer state; the coordinator,
        // which owns the tokenizer, its files.
        fx.push(Effect::WriteTokenizer {
            job: self.rec.id.clone(),
            dir: dir.clone(),
        });
        for m in &gen.members {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Checkpoint {
                    job: self.rec.id.clone(),
                    step,
                    dir: dir.clone(),
                    cursor: self.rec.cursor.clone(),
                },
            });
        }
        let acks = gen.members.iter().map(|m| (m.clone(), false)).collect();
        self.pending_checkpoints.insert(step, acks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::recovery::{Decision, Source};

    #[test]
    fn a_generation_counts_its_ready_ranks_once_each() {
        let members: Vec<WorkerId> = (0..3).map(|i| format!("w{i}")).collect();
        let decision = Decision {
            source: Source::Init,
            step: 0,
            target: 0,
        };
        let mut g = Generation::new(1, members, decision, false);
        assert!(!g.all_ready());
        assert!(!g.mark_ready(0));
        assert!(!g.mark_ready(0), "a repeated Ready is not a second rank");
        assert!(!g.mark_ready(7), "no such rank");
        assert!(!g.mark_ready(2));
        assert!(!g.all_ready());
        assert!(g.mark_ready(1), "the last rank completes it");
        assert!(g.all_ready());
        assert!(!g.mark_ready(1), "and only once");
        assert!(g.all_ready());
    }
}
