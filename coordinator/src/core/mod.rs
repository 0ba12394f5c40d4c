//! The coordinator as a pure state machine: [`Coordinator::handle`]`(event,
//! now_ms) -> `[`Effects`]. No sockets, no clock, no disk: the shell feeds
//! events in and carries the effects out, the durable writes first and
//! the rest only once they succeeded (raft-rs `ready()/advance()` is the
//! model). Multi-worker scenarios are tested as loops over `handle`
//! (`tests/`).
//!
//! What lives here, bottom up (no file imports one above it):
//! - the vocabulary: `types` (ids, states, reasons), `error`, `options`,
//!   `metrics` (sums to means), `nonfinite`, `manifest` (what a committed
//!   step trained), `record` (the persisted job), `liveness`, `deadline`;
//! - the parts of a job: `workers` (the registry), `generation`, `phase`,
//!   `job_data`, `acks`, `job`; `recovery` (where state comes from),
//!   `reference`, `eval`, `bisect`, `step` (a planned step), `ahead`;
//! - the deciders, pure functions of a job and the workers: `planner` (the
//!   one planner), `membership` (who forms a generation), `formation`
//!   (their Configures), `relay`/`routing` (relayed generations);
//! - `events` and `effects` (what goes in and comes out), `ctx` (a job's
//!   handlers run on its `JobCtx`), and the handlers by concern:
//!   `results`, `commit`, `dispatch`, `generations`, `control`, `publish`,
//!   `quarantine` (and the RL loop's in `crate::rl`);
//! - `machine` (the [`Coordinator`]: events to their job's context, the
//!   registry's own), `submit`, `job_events`.
//!
//! It imports `crate::job`, `crate::stream`, `crate::model` and the RL
//! loop's state (`crate::rl`), never the shell.

pub(crate) mod acks;
pub(crate) mod ahead;
pub mod bisect;
pub(crate) mod commit;
pub(crate) mod control;
pub(crate) mod ctx;
pub mod deadline;
pub(crate) mod dispatch;
pub(crate) mod effects;
pub(crate) mod error;
pub mod eval;
pub(crate) mod events;
pub(crate) mod formation;
pub(crate) mod generation;
pub(crate) mod generations;
pub(crate) mod job;
pub(crate) mod job_data;
pub(crate) mod job_events;
pub(crate) mod links;
pub(crate) mod liveness;
pub(crate) mod machine;
pub mod manifest;
pub mod membership;
pub mod metrics;
pub mod nonfinite;
pub(crate) mod options;
pub(crate) mod phase;
pub mod planner;
pub(crate) mod publish;
pub(crate) mod quarantine;
pub(crate) mod record;
pub mod recovery;
pub mod reference;
pub mod relay;
pub(crate) mod results;
pub(crate) mod routing;
pub mod step;
pub(crate) mod submit;
pub(crate) mod types;
pub(crate) mod workers;

#[cfg(test)]
mod tests;

pub use effects::{Effect, Effects, Persist, ToWorker, WatchItem};
pub use error::{CoreError, OutputOverlap, Result};
pub use eval::EvalMetrics;
pub use events::{Beat, Event, JobStart, RankResult};
pub use generation::{Generation, GeneratorSet};
pub use job::{BoundaryRequests, Job, TOKENIZER_FILES};
pub use job_data::JobData;
pub use machine::Coordinator;
pub use metrics::{MetricSums, SourceMetrics, SourceSums, StepMetrics};
pub use options::{CoordinatorOptions, RELAY_MIN_WORLD};
pub use phase::{Active, AfterCheckpoint, InFlight, Phase, Work};
pub use record::JobRecord;
pub use reference::{RefEntry, ReferenceLogps, SeqLogp};
pub use step::PlannedStep;
pub use types::{
    AbortReason, CheckpointEntry, CommittedStep, End, EventKind, HeldState, JobId, JobState,
    Nesting, Peer, PlanKind, Quarantined, Role, WeightRing, Why, WorkerErrorKind, WorkerId,
};
pub use workers::{Registration, Worker, WorkerState};
