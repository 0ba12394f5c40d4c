//! What goes into the state machine: [`Event`]s from the wire (workers'
//! messages, admin requests) and from the shell (ticks, the answers to the
//! effects it carried out).

use std::path::PathBuf;
use std::sync::Arc;

use super::metrics::MetricSums;
use super::reference::{ReferenceLogps, SeqLogp};
use super::types::{CommittedStep, JobId, WorkerErrorKind, WorkerId};
use super::workers::Registration;
use crate::job::settings::JobUpdate;
use crate::job::spec::JobSpec;
use crate::rl::generation::GenCompletion;
use crate::rl::rounds::{LoopInputs, RoundStats};
use crate::rl::stream::StoredStream;
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
    /// The answer to [`super::effects::Effect::LoadHistory`]: the steps read, or why the
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
        /// The generation whose request it answers.
        generation: u64,
        step: u64,
    },
    /// A generator loaded the policy of step `version` from the weight
    /// ring (`ToWorker::SyncWeights`).
    WeightsSynced {
        worker: WorkerId,
        job: JobId,
        generation: u64,
        version: u64,
        /// Bytes the generator received and the seconds it took.
        bytes: u64,
        seconds: f64,
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
    /// A chat-completion call to a served job's endpoint, rendered
    /// (`crate::rl::serve`); answered by an `Effect::Served` once
    /// generated, or refused (`ServeFull`, not a served job, ended).
    Serve {
        job: JobId,
        request: crate::rl::serve::ServeRequest,
    },
    /// The caller of a served call went away.
    ServeCancel {
        job: JobId,
        id: u64,
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
    /// The shell stepped the environments of a round's open episodes
    /// (`Effect::StepEpisodes`): one reply per episode, or why it could
    /// not (the job fails, naming the episode).
    EpisodesStepped {
        job: JobId,
        round: u64,
        result: std::result::Result<Vec<crate::rl::episode::EnvReply>, String>,
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
    /// The shell wrote the tokenizer files of step `step`'s checkpoint
    /// (`Effect::WriteTokenizer`): acknowledged as
    /// [`super::job::TOKENIZER_FILES`].
    TokenizerWritten {
        job: JobId,
        step: u64,
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
            | Event::Serve { job, .. }
            | Event::ServeCancel { job, .. }
            | Event::RestoreRollouts { job, .. }
            | Event::LoadPrompts { job, .. }
            | Event::GenerateResult { job, .. }
            | Event::RoundScored { job, .. }
            | Event::RoundFailed { job, .. }
            | Event::EpisodesStepped { job, .. }
            | Event::EngineGenerated { job, .. }
            | Event::EngineReloaded { job, .. }
            | Event::TokenizerWritten { job, .. }
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
                | Event::Serve { .. }
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

/// A job being submitted.
pub(crate) struct Submission {
    pub id: JobId,
    pub spec: Arc<JobSpec>,
    pub spec_toml: String,
    pub docs: Arc<[Document]>,
    /// Resume from a checkpoint of ours instead of step 0.
    pub start: Option<JobStart>,
}

/// A job read back from the store after a restart.
pub(crate) struct Restored {
    pub rec: super::record::JobRecord,
    pub spec: Arc<JobSpec>,
    pub docs: Arc<[Document]>,
    pub reference: ReferenceLogps,
    pub history: Vec<CommittedStep>,
}
