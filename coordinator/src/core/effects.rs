//! What goes into the state machine ([`Event`]) and what comes out
//! ([`Effect`]): the whole interface between the core and the server shell,
//! which turns events from the wire and effects into messages, store
//! writes and watch items.

use std::path::PathBuf;
use std::sync::Arc;

use super::metrics::{MetricSums, StepMetrics};
use super::recovery::PriorRun;
use super::reference::{RefEntry, ReferenceLogps, SeqLogp};
use super::step::PlannedStep;
use super::types::{
    AbortReason, CommittedStep, EventKind, HeldState, JobId, JobState, Role, WeightRing, Why,
    WorkerErrorKind, WorkerId,
};
use super::workers::Registration;
use crate::core::manifest::StepManifest;
use crate::job::settings::JobUpdate;
use crate::job::spec::JobSpec;
use crate::rl::rounds::{
    EngineRound, GenCompletion, LoopInputs, RoundPlan, RoundStats, RoundToScore,
};
use crate::rl::stream::{RolloutWrite, StoredStream};
use crate::stream::cursor::Cursor;
use crate::stream::doc::{DocId, Document, Rollout};

/// A heartbeat as the shell read it: from whom, when, and how late
/// (see [`Event::Heartbeat`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Beat {
    pub worker: WorkerId,
    pub at_ms: i64,
    pub lag_ms: Option<i64>,
}

/// One rank's answer to a plan.
#[derive(Debug, Clone, Default)]
pub struct RankResult {
    pub sums: MetricSums,
    /// Reference plans: per-sequence log-probs.
    pub logps: Vec<SeqLogp>,
    /// Probe plans: the rank's non-finite microbatches.
    pub nonfinite: Vec<u32>,
}
/// Everything that can happen to the coordinator.
#[derive(Debug, Clone)]
pub enum Event {
    /// Heartbeats the shell read since the last tick, each at its own read
    /// time, applied in one go just before the tick (the shell queues them
    /// off the state lock).
    Heartbeats {
        beats: Vec<Beat>,
    },
    /// The answer to [`Effect::LoadHistory`]: the steps read, or why the
    /// store could not give them.
    HistoryLoaded {
        job: JobId,
        from: u64,
        steps: std::result::Result<Vec<CommittedStep>, String>,
    },
    /// A step of the job was just dispatched: plan the next one while it
    /// runs (the shell sends this once the plans are out; see `ahead`).
    PlanAhead {
        job: JobId,
    },
    RegisterWorker {
        id: WorkerId,
        reg: Registration,
    },
    SessionOpened {
        worker: WorkerId,
    },
    SessionClosed {
        worker: WorkerId,
    },
    Heartbeat {
        worker: WorkerId,
        /// How much later than its session's quickest this heartbeat was
        /// read (the shell measures it from the worker's send time; None
        /// when the worker sent none): what the coordinator's backlog is
        /// judged from (see `liveness`).
        lag_ms: Option<i64>,
    },
    Ready {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        step: u64,
    },
    StepResult {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        step: u64,
        sums: MetricSums,
        /// Reference plans: per-sequence log-probs (empty otherwise).
        logps: Vec<SeqLogp>,
        /// Probe plans: this rank's non-finite microbatches.
        nonfinite: Vec<u32>,
    },
    /// A train step's results of every rank, gathered over the
    /// generation's collective and sent by its rank 0 (`worker`): each
    /// entry counts as that rank's own `StepResult` (issue 19).
    StepResults {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        step: u64,
        /// (rank, its result), one per rank.
        results: Vec<(u32, RankResult)>,
    },
    WorkerError {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
    },
    CheckpointDone {
        worker: WorkerId,
        job: JobId,
        step: u64,
    },
    /// A worker wrote its part of a published policy (`rl.publish_every`).
    PolicyPublished {
        worker: WorkerId,
        job: JobId,
        step: u64,
    },
    /// A generator loaded the policy of step `version` from the weight
    /// ring (`ToWorker::SyncWeights`).
    WeightsSynced {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        version: u64,
    },
    SubmitJob {
        id: JobId,
        spec: Arc<JobSpec>,
        spec_toml: String,
        docs: Arc<[Document]>,
        /// Resume from a checkpoint of ours instead of step 0.
        start: Option<JobStart>,
    },
    /// A job read back from the store after a restart.
    RestoreJob {
        rec: Box<super::record::JobRecord>,
        spec: Arc<JobSpec>,
        docs: Arc<[Document]>,
        /// The job's cached reference log-probs from the store.
        reference: ReferenceLogps,
        /// Its committed steps after `rec.history_from`, from the store
        /// (replayed after a restore).
        history: Vec<CommittedStep>,
    },
    CancelJob {
        job: JobId,
    },
    PauseJob {
        job: JobId,
    },
    ResumeJob {
        job: JobId,
    },
    DrainWorker {
        worker: WorkerId,
    },
    TriggerCheckpoint {
        job: JobId,
    },
    /// Change step settings of a live job from its next new step on.
    UpdateJob {
        job: JobId,
        update: JobUpdate,
    },
    /// Returns quarantined documents to the job (`None`: every one).
    ReleaseQuarantine {
        job: JobId,
        docs: Option<Vec<DocId>>,
    },
    /// Periodic: detects missed heartbeats and overdue steps.
    /// `stalled_ms` is how long the shell itself could not listen since the
    /// last tick (the state lock held, its threads blocked: the tick came
    /// late by that much); worker silence over that time is not counted.
    /// The shell measures it; the core only adds it up.
    Tick {
        stalled_ms: i64,
    },
    /// Rollouts pushed to a streamed job (one RPC message, admitted whole).
    /// Answered by a `Persist::Rollouts` carrying the counts, or
    /// refused unchanged (`QueueFull`: wait for a commit and retry).
    PushRollouts {
        job: JobId,
        rollouts: Vec<Rollout>,
    },
    /// A streamed job's stored queue, after its `RestoreJob`.
    RestoreRollouts {
        job: JobId,
        stored: StoredStream,
    },
    /// A generating job's prompts, loaded by the shell after its
    /// `SubmitJob` or `RestoreJob` (the loop plans no round before).
    LoadPrompts {
        job: JobId,
        inputs: LoopInputs,
    },
    /// One rank's completions of a generation round.
    GenerateResult {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        round: u64,
        completions: Vec<GenCompletion>,
        seconds: f64,
    },
    /// The shell scored a round (`Effect::ScoreRound`): its rollouts in
    /// group order, admitted whole with the round's prompts consumed.
    RoundScored {
        job: JobId,
        round: u64,
        rollouts: Vec<Rollout>,
        stats: RoundStats,
    },
    /// The shell could not score a round (a verifier failed): the job
    /// fails, naming the verifier's error.
    RoundFailed {
        job: JobId,
        round: u64,
        error: String,
    },
    /// The engine's answer to `Effect::EngineGenerate` (after the shell's
    /// retries): every completion of the round, or why there are none.
    EngineGenerated {
        job: JobId,
        round: u64,
        result: std::result::Result<(Vec<GenCompletion>, f64), String>,
    },
    /// The engine's answer to `Effect::EngineReload` of step `step`.
    EngineReloaded {
        job: JobId,
        step: u64,
        result: std::result::Result<(), String>,
    },
    /// The shell could not write one of the job's outputs (`metrics.jsonl`,
    /// a checkpoint's removal, …): the job fails, naming it, rather than
    /// go on with a record that silently lacks it.
    OutputFailed {
        job: JobId,
        what: String,
    },
    /// The store refused a call's writes for these jobs: what followed
    /// them was not carried out. Each job ends in memory only (the store
    /// is what failed; its last durable state stays, and a restarted
    /// coordinator resumes the job from it) and its workers are released.
    PersistFailed {
        jobs: Vec<JobId>,
        error: String,
    },
}

impl Event {
    /// The worker whose message this is, if a worker's.
    pub fn from_worker(&self) -> Option<&str> {
        match self {
            Event::Ready { worker, .. }
            | Event::StepResult { worker, .. }
            | Event::StepResults { worker, .. }
            | Event::WorkerError { worker, .. }
            | Event::CheckpointDone { worker, .. }
            | Event::PolicyPublished { worker, .. }
            | Event::WeightsSynced { worker, .. }
            | Event::GenerateResult { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// The job the event is about, if one job's.
    pub fn job(&self) -> Option<&str> {
        match self {
            Event::HistoryLoaded { job, .. }
            | Event::PlanAhead { job }
            | Event::Ready { job, .. }
            | Event::StepResult { job, .. }
            | Event::StepResults { job, .. }
            | Event::WorkerError { job, .. }
            | Event::CheckpointDone { job, .. }
            | Event::PolicyPublished { job, .. }
            | Event::WeightsSynced { job, .. }
            | Event::CancelJob { job }
            | Event::PauseJob { job }
            | Event::ResumeJob { job }
            | Event::TriggerCheckpoint { job }
            | Event::UpdateJob { job, .. }
            | Event::ReleaseQuarantine { job, .. }
            | Event::PushRollouts { job, .. }
            | Event::RestoreRollouts { job, .. }
            | Event::LoadPrompts { job, .. }
            | Event::GenerateResult { job, .. }
            | Event::RoundScored { job, .. }
            | Event::RoundFailed { job, .. }
            | Event::EngineGenerated { job, .. }
            | Event::EngineReloaded { job, .. }
            | Event::OutputFailed { job, .. } => Some(job),
            Event::SubmitJob { id, .. } => Some(id),
            Event::RestoreJob { rec, .. } => Some(&rec.id),
            Event::Heartbeats { .. }
            | Event::RegisterWorker { .. }
            | Event::SessionOpened { .. }
            | Event::SessionClosed { .. }
            | Event::Heartbeat { .. }
            | Event::DrainWorker { .. }
            | Event::Tick { .. }
            | Event::PersistFailed { .. } => None,
        }
    }

    /// Whether the event is a request whose sender waits for the answer
    /// (an unknown job is an error to it, not a message to drop).
    pub fn is_request(&self) -> bool {
        matches!(
            self,
            Event::CancelJob { .. }
                | Event::PauseJob { .. }
                | Event::ResumeJob { .. }
                | Event::TriggerCheckpoint { .. }
                | Event::UpdateJob { .. }
                | Event::ReleaseQuarantine { .. }
                | Event::PushRollouts { .. }
                | Event::LoadPrompts { .. }
                | Event::RoundScored { .. }
                | Event::OutputFailed { .. }
        )
    }
}

/// Where a job resumed from a checkpoint starts: its manifest's step and
/// data cursor, and the directory workers restore from (model and
/// optimizer state).
#[derive(Debug, Clone, PartialEq)]
pub struct JobStart {
    pub step: u64,
    pub cursor: Cursor,
    pub dir: PathBuf,
}

/// A message for one worker (the adapter turns it into `CoordinatorMessage`).
#[derive(Debug, Clone)]
pub enum ToWorker {
    Configure {
        job: JobId,
        generation: u64,
        rank: u32,
        /// (worker id, collective address) per rank.
        peers: Arc<[(WorkerId, String)]>,
        /// Per rank: the state that peer holds in memory when it holds the
        /// configured step (no restore; the others sync from it).
        priors: Arc<[Option<HeldState>]>,
        /// `priors` as runs, computed once per generation (what the wire carries).
        prior_runs: Arc<[PriorRun]>,
        /// The validated spec; the adapter sends its resolved form.
        spec: Arc<JobSpec>,
        step: u64,
        restore_from: Option<PathBuf>,
        /// A generator's `rank` numbers it among the generators and its
        /// `peers` are the generators (it joins no training ring).
        role: Role,
        /// Trainer rank 0 and the generators of a disaggregated generation.
        weights: Option<WeightRing>,
        /// A relayed generation's hubs and followers (`super::relay`).
        relay: Option<super::relay::RelayRole>,
    },
    Plan {
        job: JobId,
        generation: u64,
        rank: u32,
        planned: Arc<PlannedStep>,
    },
    Abort {
        job: JobId,
        generation: u64,
        step: u64,
        why: Why,
    },
    Checkpoint {
        job: JobId,
        step: u64,
        dir: PathBuf,
        cursor: Cursor,
    },
    Release {
        job: JobId,
        reason: String,
    },
    /// Write the current policy as HF safetensors into `dir`; with no
    /// `dir`, snapshot it in memory for the generators' weight ring.
    PublishPolicy {
        job: JobId,
        step: u64,
        dir: Option<PathBuf>,
    },
    /// Disaggregated RL: trainer rank 0 broadcasts its newest snapshot
    /// (at least `version`) over the weight ring; generators load it.
    SyncWeights {
        job: JobId,
        generation: u64,
        version: u64,
    },
    /// Sample completions with the current weights (the RL loop).
    Generate {
        job: JobId,
        generation: u64,
        rank: u32,
        plan: Arc<RoundPlan>,
    },
    /// To a hub: its followers' messages, by rank, in order
    /// (`super::relay::route`).
    Relay {
        job: JobId,
        generation: u64,
        messages: Vec<(u32, ToWorker)>,
    },
}

/// One item of a job's watch stream.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchItem {
    Step(Box<StepMetrics>),
    /// An evaluation finished.
    Eval(super::eval::EvalMetrics),
    Event {
        kind: EventKind,
        message: String,
        state: JobState,
        unix_ms: i64,
        /// Why a generation ended or the job stopped.
        reason: Option<AbortReason>,
        /// The step in flight it abandoned, if any.
        aborted_step: Option<u64>,
    },
}

/// A durable write: the shell carries out every one of a call's before
/// anything else the call asked for ([`Effects`]).
#[derive(Debug, Clone)]
pub enum Persist {
    Job(Box<super::record::JobRecord>),
    /// The step's record, its metrics and its manifest, in one transaction.
    Step {
        rec: Box<super::record::JobRecord>,
        metrics: Box<StepMetrics>,
        docs: Vec<DocId>,
        manifest: Box<StepManifest>,
    },
    /// Reference log-probs of a committed chunk (persisted before the
    /// plans that carry them are sent).
    Reference {
        job: JobId,
        entries: Vec<(DocId, RefEntry)>,
    },
    /// A streamed job's rollouts: admitted, and deleted once trained (one
    /// transaction). A push is acknowledged only after this ran; a write
    /// that frees room wakes waiting pushers.
    Rollouts(Box<RolloutWrite>),
}

impl Persist {
    /// The job whose state this writes.
    pub fn job(&self) -> &str {
        match self {
            Persist::Job(rec) | Persist::Step { rec, .. } => &rec.id,
            Persist::Reference { job, .. } => job,
            Persist::Rollouts(w) => &w.job,
        }
    }
}

/// What one call of the state machine asks of the shell: the durable
/// writes, then what may only follow them. The split is the
/// persist-then-notify rule as a type: the shell carries out `then` only
/// once every write of `persist` succeeded, so no worker, watcher or file
/// ever acts on state the store does not hold (after a restart the
/// coordinator and its workers would disagree).
#[derive(Debug, Default)]
pub struct Effects {
    persist: Vec<Persist>,
    then: Vec<Effect>,
}

impl Effects {
    /// A durable write, before everything the call does after it.
    pub fn persist(&mut self, p: Persist) {
        self.persist.push(p);
    }

    /// An effect to carry out once the call's writes are durable.
    pub fn push(&mut self, e: Effect) {
        self.then.push(e);
    }

    pub fn persists(&self) -> &[Persist] {
        &self.persist
    }

    /// What follows the writes, in order.
    pub fn then(&self) -> &[Effect] {
        &self.then
    }

    pub(crate) fn then_mut(&mut self) -> &mut Vec<Effect> {
        &mut self.then
    }

    pub fn is_empty(&self) -> bool {
        self.persist.is_empty() && self.then.is_empty()
    }

    /// The writes and what follows them.
    pub fn into_parts(self) -> (Vec<Persist>, Vec<Effect>) {
        (self.persist, self.then)
    }
}

/// What the shell does once a call's writes are durable, in order.
#[derive(Debug, Clone)]
pub enum Effect {
    /// A replay needs steps `from..=to` of `job`'s history, which only the
    /// store holds: read their records (off the state lock) and answer
    /// with [`Event::HistoryLoaded`].
    LoadHistory {
        job: JobId,
        from: u64,
        to: u64,
    },
    AppendMetrics {
        job: JobId,
        path: PathBuf,
        metrics: Box<StepMetrics>,
    },
    /// An evaluation's metrics, appended to `metrics.jsonl` as an eval line.
    AppendEval {
        job: JobId,
        path: PathBuf,
        eval: Box<super::eval::EvalMetrics>,
    },
    /// The tokenizer side of a model folder the workers are writing (a
    /// checkpoint, a published policy): the job's tokenizer files, written
    /// into `dir` off the state lock (the coordinator owns the tokenizer).
    WriteTokenizer {
        job: JobId,
        dir: PathBuf,
    },
    Send {
        worker: WorkerId,
        msg: ToWorker,
    },
    /// The worker was declared lost: end its session if one is still
    /// open, so a worker that is in fact alive reconnects and registers
    /// again (reporting what it holds) rather than being ignored.
    EndSession {
        worker: WorkerId,
        why: String,
    },
    Publish {
        job: JobId,
        item: WatchItem,
    },
    /// Decode and score a generated round off the state lock, then answer
    /// with `Event::RoundScored` or `Event::RoundFailed`.
    ScoreRound(Box<RoundToScore>),
    /// Generate a round on the job's external engine (`rl.engine`), off
    /// the state lock; answered with `Event::EngineGenerated`.
    EngineGenerate(Box<EngineRound>),
    /// Tell the job's engine to load the published policy in `dir` (an
    /// absolute path the engine sees too); answered with
    /// `Event::EngineReloaded`.
    EngineReload {
        job: JobId,
        step: u64,
        dir: PathBuf,
        engine: crate::job::engine::EngineSection,
    },
    /// A checkpoint left the job's index (`checkpoint.keep`): delete its
    /// directory (after the record persisted before it).
    RemoveCheckpoint {
        job: JobId,
        step: u64,
        dir: PathBuf,
    },
}
