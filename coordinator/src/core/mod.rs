//! The coordinator as a pure state machine: `Coordinator::handle(event,
//! now_ms) -> Effects`. No sockets, no clock, no disk: the server shell
//! feeds events in and carries the effects out. [`Effects`] holds the
//! durable writes apart from what may follow them, and the shell carries
//! out the rest only once every write succeeded (raft-rs
//! `ready()/advance()` is the model). Multi-worker scenarios are
//! tested as loops over `handle`.
//!
//! Layers point down; no file imports one above it:
//! - `types` (ids, states, reasons), `error`, `metrics`, `deadline`, `record` (the
//!   persisted job), `liveness` (silence net of the coordinator's delays), `workers`, `recovery` (where state comes from),
//!   `reference`, `rollouts`, `stream`, `generate` (the RL loop's rounds), `step` (a planned step), `bisect`
//!   (finding poison documents), `eval` (evaluation passes and their
//!   metrics);
//! - `effects` (what goes in and comes out), `jobs` (a job and its
//!   [`Phase`]), `planner` (the one planner), `membership` (who forms a
//!   generation);
//! - `machine` (the [`Coordinator`] and `handle`), then its handlers by
//!   concern: `lifecycle`, `generations`, `control`, `publish`, `rollout_loop`,
//!   `quarantine`.
//!
//! This file only declares and re-exports.

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
pub use error::{CoreError, Result};
pub use eval::EvalMetrics;
pub use events::{Beat, Event, JobStart, RankResult};
pub use generation::{Generation, GeneratorSet};
pub use job::{BoundaryRequests, Job};
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
    PlanKind, Quarantined, Role, WeightRing, Why, WorkerErrorKind, WorkerId,
};
pub use workers::{Registration, Worker, WorkerState};
