//! Where a job is in its life ([`Phase`]): waiting for a generation,
//! running one (and what it is doing: [`Work`]), or ended.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::generation::Generation;
use super::metrics::MetricSums;
use super::reference::SeqLogp;
use super::step::PlannedStep;

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
