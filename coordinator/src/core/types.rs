//! The core's shared vocabulary: ids, states, reasons and the records
//! several parts of the state machine pass around. The bottom of the core:
//! it imports nothing else of it.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::stream::cursor::Cursor;
use crate::stream::doc::DocId;

pub type JobId = String;
pub type WorkerId = String;

/// A member's part in a generation: every member trains, except in a
/// disaggregated RL job (`rl.generators`), whose generators only generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Trainer,
    Generator,
}

/// Where a member sits in a disaggregated generation's weight ring
/// (trainer rank 0, then the generators): it dials `next`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightRing {
    pub rank: u32,
    pub world: u32,
    /// (worker id, collective address) of ring rank (rank + 1) % world.
    pub next: (WorkerId, String),
}

/// Lifecycle of a job as operators see it (persisted in its record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    Pending,
    Running,
    Paused,
    Completed,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }

    /// Lower-case name, as the CLI and metrics show it.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Paused => "paused",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// Training state a worker holds in memory (mirror of `accrue.v1.HeldState`):
/// the job, the step whose update it holds, and its shard layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldState {
    pub job: JobId,
    pub step: u64,
    pub world_size: u32,
    pub rank: u32,
    /// The generation whose layout this is.
    pub generation: u64,
}

/// A document a non-finite step was bisected down to: the job trains on
/// without it until an operator releases it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantined {
    pub doc: DocId,
    /// The step that was non-finite with it.
    pub step: u64,
    /// The step's failure, as the worker reported it.
    pub detail: String,
    pub unix_ms: i64,
}

/// A checkpoint every rank of its generation reported written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    pub step: u64,
    pub dir: PathBuf,
}

/// What replaying a committed step needs: its documents and learning rate.
#[derive(Debug, Clone, PartialEq)]
pub struct CommittedStep {
    pub step: u64,
    pub lr: f64,
    /// The step's documents in selection order (its manifest), compact.
    pub docs: crate::stream::doc::DocIds,
    pub cursor_after: Cursor,
}

/// What workers do with a plan (mirror of `accrue.v1.PlanKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanKind {
    /// Forward, backward, optimizer step; commits a training step.
    #[default]
    Train,
    /// Forward only, per-sequence log-probs back (the cached reference
    /// pass); `step` numbers the chunk and the cursor does not move.
    Reference,
    /// Forward and backward of each microbatch alone, no update: which are
    /// non-finite (a bisection of failed step `step`; see `bisect`).
    Probe,
    /// Forward only over eval documents with the current weights: their
    /// log-probs back (`eval`); `step` is the committed step evaluated.
    Eval,
}

impl PlanKind {
    /// What its `step` number names, for messages ("eval chunk 3").
    pub fn noun(self) -> &'static str {
        match self {
            PlanKind::Train => "step",
            PlanKind::Reference => "reference chunk",
            PlanKind::Probe => "probe of step",
            PlanKind::Eval => "eval chunk",
        }
    }
}

/// The peer a worker's collective error blames: a rank of its generation's
/// training ring, or of its weight ring (trainer rank 0, then the
/// generators, in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Rank(u32),
    WeightRing(u32),
}

/// Kinds of worker-reported failure (mirror of `accrue.v1.ErrorKind`): the
/// coordinator decides on the kind, never on the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerErrorKind {
    NonFinite,
    CollectiveTimeout {
        peer: Option<Peer>,
    },
    InvalidPlan,
    Internal,
    /// The configured checkpoint could not be restored (missing or corrupt).
    RestoreFailed,
    /// State sync from live peers failed.
    StateSync,
    OutOfMemory,
    /// A document of the plan cannot be trained as sent.
    Data,
    /// A checkpoint part could not be written.
    CheckpointWrite,
    /// A relay link failed; `peer_rank` is the rank blamed (the hub, or
    /// the reporting follower itself when it could not reach its hub).
    RelayLink {
        peer_rank: Option<u32>,
    },
}

impl WorkerErrorKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkerErrorKind::NonFinite => "non-finite",
            WorkerErrorKind::CollectiveTimeout { .. } => "collective timeout",
            WorkerErrorKind::InvalidPlan => "invalid plan",
            WorkerErrorKind::Internal => "internal",
            WorkerErrorKind::RestoreFailed => "restore failed",
            WorkerErrorKind::StateSync => "state sync",
            WorkerErrorKind::OutOfMemory => "out of memory",
            WorkerErrorKind::Data => "data",
            WorkerErrorKind::CheckpointWrite => "checkpoint write",
            WorkerErrorKind::RelayLink { .. } => "relay link",
        }
    }
}

/// What a job event is about (mirror of `accrue.v1.EventKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// The job's state changed.
    State,
    /// A generation formed or ended.
    Generation,
    Checkpoint,
    /// The operator changed step settings.
    Config,
    /// A generation replays committed steps.
    Replay,
    /// Progress of the cached reference pass.
    Reference,
    /// A policy was published.
    Policy,
    /// Documents were quarantined or released.
    Quarantine,
}

impl EventKind {
    /// Lower-case name, as the CLI shows it.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::State => "state",
            EventKind::Generation => "generation",
            EventKind::Checkpoint => "checkpoint",
            EventKind::Config => "config",
            EventKind::Replay => "replay",
            EventKind::Reference => "reference",
            EventKind::Policy => "policy",
            EventKind::Quarantine => "quarantine",
        }
    }
}

/// Why a generation ended or a job stopped, and so why a step in flight
/// was abandoned (mirror of `accrue.v1.AbortReason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AbortReason {
    WorkerLost,
    CollectiveTimeout,
    RestoreFailed,
    StateSyncFailed,
    /// A worker's error failed the job.
    WorkerError,
    Cancelled,
    /// The generation re-formed at a step boundary (drain, join).
    MembershipChange,
    /// The job failed for a reason of its own (planning, a reference pass).
    JobFailed,
    /// The job's output (metrics, a checkpoint) or its state in the
    /// coordinator's store could not be written.
    OutputFailed,
    /// A member did not answer within the step deadline.
    StepDeadline,
    /// A step was dispatched `faults.max_step_attempts` times.
    TooManyAttempts,
    /// The step was non-finite; its documents are bisected first.
    NonFinite,
}

impl AbortReason {
    /// Every reason, for metrics labels.
    pub const ALL: [AbortReason; 12] = [
        AbortReason::WorkerLost,
        AbortReason::CollectiveTimeout,
        AbortReason::RestoreFailed,
        AbortReason::StateSyncFailed,
        AbortReason::WorkerError,
        AbortReason::Cancelled,
        AbortReason::MembershipChange,
        AbortReason::JobFailed,
        AbortReason::OutputFailed,
        AbortReason::StepDeadline,
        AbortReason::TooManyAttempts,
        AbortReason::NonFinite,
    ];

    /// snake_case name (a bounded Prometheus label value).
    pub fn name(self) -> &'static str {
        match self {
            AbortReason::WorkerLost => "worker_lost",
            AbortReason::CollectiveTimeout => "collective_timeout",
            AbortReason::RestoreFailed => "restore_failed",
            AbortReason::StateSyncFailed => "state_sync_failed",
            AbortReason::WorkerError => "worker_error",
            AbortReason::Cancelled => "cancelled",
            AbortReason::MembershipChange => "membership_change",
            AbortReason::JobFailed => "job_failed",
            AbortReason::OutputFailed => "output_failed",
            AbortReason::StepDeadline => "step_deadline",
            AbortReason::TooManyAttempts => "too_many_attempts",
            AbortReason::NonFinite => "non_finite",
        }
    }
}

/// A reason with its detail for people (the worker, step or error behind
/// it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    pub reason: AbortReason,
    pub detail: String,
}

impl Why {
    pub fn new(reason: AbortReason, detail: impl Into<String>) -> Why {
        Why {
            reason,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

/// How a job ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// All steps trained, or the data exhausted (the detail says which).
    Completed(String),
    Failed(Why),
    Cancelled,
}

impl End {
    pub fn state(&self) -> JobState {
        match self {
            End::Completed(_) => JobState::Completed,
            End::Failed(_) => JobState::Failed,
            End::Cancelled => JobState::Cancelled,
        }
    }

    /// Why a step in flight is abandoned when the job ends this way.
    pub fn why(&self) -> Why {
        match self {
            End::Completed(detail) => Why::new(AbortReason::JobFailed, detail.clone()),
            End::Failed(why) => why.clone(),
            End::Cancelled => Why::new(AbortReason::Cancelled, "cancelled by operator"),
        }
    }
}

/// How one output directory lies relative to another (a submit's to a
/// live job's): any of them means the two jobs' files would mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nesting {
    Same,
    Inside,
    Contains,
}

impl Nesting {
    /// How `dir` lies relative to `other`, compared by whole components
    /// (`runs/ab` is not inside `runs/a`); `None` when they are apart.
    pub fn of(dir: &std::path::Path, other: &std::path::Path) -> Option<Nesting> {
        if dir == other {
            Some(Nesting::Same)
        } else if dir.starts_with(other) {
            Some(Nesting::Inside)
        } else if other.starts_with(dir) {
            Some(Nesting::Contains)
        } else {
            None
        }
    }
}

impl fmt::Display for Nesting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Nesting::Same => "the same directory as",
            Nesting::Inside => "inside",
            Nesting::Contains => "a parent of",
        })
    }
}
