//! Prometheus metrics of the coordinator, served as text on `GET /metrics`:
//! the families and their registration here, their updates in `observe`.
//!
//! Names follow the Prometheus conventions
//! (<https://prometheus.io/docs/practices/naming/>): base units
//! (`_seconds`), `_total` on counters and only there, `_ratio` for
//! fractions, low-cardinality labels (`job`, `state`, `reason`, `phase`;
//! never a document or worker id, since lost workers stay in the registry
//! forever). Things that accumulate are counters so `rate()` works; the
//! last-step gauges sit beside them for dashboards.
//!
//! Who feeds what: the service layer (`service/mod.rs`) observes the
//! effects of every state-machine call — committed steps, dispatched plans
//! with their wall latency, aborts, checkpoints, admitted rollouts — and
//! the gauges of current state (workers, jobs, queues, checkpoint age) are
//! read from the state machine at scrape time, so they are never stale.
//! The core stays pure: wall latency is measured around it, not inside.
//! [`crate::shell::http`] serves them. See the metrics reference in the README
//! for every family.

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus::Registry;

mod families;
mod observe;

#[cfg(test)]
mod tests;

use families::{Builder, Checkpoints, Dispatch, Rollouts, Sources, State, Steps};

/// The coordinator's Prometheus registry and its metrics.
pub struct Exporter {
    registry: Registry,
    /// Families registered (the conventions test checks it saw them all).
    #[cfg_attr(not(test), allow(dead_code))]
    families: usize,
    steps: Steps,
    sources: Sources,
    dispatch: Dispatch,
    checkpoints: Checkpoints,
    rollouts: Rollouts,
    state: State,
    /// Per job: (checkpoint step, unix ms it became complete), as seen by
    /// this process or, after a restart, the checkpoint directory's mtime.
    checkpoint_times: Mutex<HashMap<String, (u64, Option<i64>)>>,
    /// Per job: the last step seen at a scrape and when it was first seen.
    progress_times: Mutex<HashMap<String, (u64, i64)>>,
}

impl Default for Exporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Exporter {
    pub fn new() -> Exporter {
        let mut b = Builder {
            registry: Registry::new(),
            families: 0,
        };
        let steps = Steps::register(&mut b);
        let sources = Sources::register(&mut b);
        let dispatch = Dispatch::register(&mut b);
        let checkpoints = Checkpoints::register(&mut b);
        let rollouts = Rollouts::register(&mut b);
        let state = State::register(&mut b);
        Exporter {
            registry: b.registry,
            families: b.families,
            steps,
            sources,
            dispatch,
            checkpoints,
            rollouts,
            state,
            checkpoint_times: Mutex::new(HashMap::new()),
            progress_times: Mutex::new(HashMap::new()),
        }
    }
}
