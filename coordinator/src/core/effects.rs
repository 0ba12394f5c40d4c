//! What comes out of the state machine: [`Effects`], the durable writes
//! apart from what may follow them (messages to workers, watch items,
//! output files, calls off the state lock).

use std::path::PathBuf;
use std::sync::Arc;

use super::metrics::StepMetrics;
use super::recovery::PriorRun;
use super::reference::RefEntry;
use super::step::PlannedStep;
use super::types::{
    AbortReason, EventKind, HeldState, JobId, JobState, Role, WeightRing, Why, WorkerId,
};
use crate::core::manifest::StepManifest;
use crate::job::spec::JobSpec;
use crate::rl::rounds::{EngineRound, RoundPlan, RoundToScore};
use crate::rl::stream::RolloutWrite;
use crate::stream::cursor::Cursor;
use crate::stream::doc::DocId;

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
        /// The generation's ring secret (`super::links`).
        link: super::links::LinkSecret,
    },
    Plan {
        job: JobId,
        generation: u64,
        rank: u32,
        /// The plan rank whose microbatches it runs: its context-parallel
        /// group (its own rank without context parallelism).
        group: u32,
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
    /// with [`super::events::Event::HistoryLoaded`].
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
        /// A checkpoint's: the shell acknowledges the files as
        /// [`super::job::TOKENIZER_FILES`]'s `CheckpointDone` of this step
        /// (the checkpoint is durable only with them).
        step: Option<u64>,
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
    /// Step the environments of a round's open episodes off the state
    /// lock, then answer with `Event::EpisodesStepped`.
    StepEpisodes(Box<crate::rl::episode::EpisodesToStep>),
    /// Hand a served job's generated calls to their callers.
    Served {
        job: JobId,
        served: Vec<crate::rl::serve::Served>,
    },
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
        /// A LoRA job: `dir` is an adapter folder, loaded as one.
        adapter: bool,
    },
    /// A checkpoint left the job's index (`checkpoint.keep`): delete its
    /// directory (after the record persisted before it).
    RemoveCheckpoint {
        job: JobId,
        step: u64,
        dir: PathBuf,
    },
}
