//! The worker registry: who is connected, alive, and assigned where.
//! Liveness is judged from injected time (`now_ms`), never the clock.

use serde::{Deserialize, Serialize};

use super::liveness::Heard;
use super::types::{HeldState, JobId, WorkerId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerState {
    /// Registered, no session yet.
    Registered,
    /// Session open, not in a generation.
    Idle,
    /// Sent a Configure, waiting for Ready.
    Configuring,
    /// In a generation, ready for plans.
    Active,
    /// Will leave at the next step boundary.
    Draining,
    /// Session closed or heartbeats missed.
    Lost,
}

/// What a worker says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Registration {
    pub hostname: String,
    pub device: String,
    pub memory_bytes: u64,
    /// A GPU worker's GPU name and memory (empty / 0 on CPU).
    pub gpu_name: String,
    pub gpu_memory_bytes: u64,
    pub collective_addr: String,
    /// Where its plan relay listens; empty: it cannot relay.
    pub relay_addr: String,
    /// Peak FLOP/s of the device, rounded (0 = unknown): the MFU denominator.
    pub peak_flops: u64,
    /// The training state it still holds in memory (re-registering after a
    /// coordinator restart), if any.
    pub held: Option<HeldState>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub id: WorkerId,
    pub reg: Registration,
    pub state: WorkerState,
    /// When it was last heard from (silence is judged from this by
    /// [`super::liveness::Liveness`]).
    pub heard: Heard,
    pub job: Option<JobId>,
    pub rank: Option<u32>,
    pub draining: bool,
    /// Registration order, for stable rank assignment.
    pub seq: u64,
    /// The training state it holds in memory as far as the coordinator
    /// knows (from its registration, its Ready, its step results); None
    /// while a Configure may be overwriting it.
    pub held: Option<HeldState>,
    /// The hub its messages go through, while it follows one
    /// (`super::relay`).
    pub follows: Option<super::relay::Follows>,
}

impl Worker {
    /// Free to join a generation.
    pub fn available(&self) -> bool {
        self.state == WorkerState::Idle && self.job.is_none() && !self.draining
    }

    pub fn connected(&self) -> bool {
        !matches!(self.state, WorkerState::Registered | WorkerState::Lost)
    }

    /// When it was last heard from.
    pub fn last_seen_ms(&self) -> i64 {
        self.heard.at_ms
    }

    /// Its held state, if it is `job`'s.
    pub fn held_for(&self, job: &str) -> Option<&HeldState> {
        self.held.as_ref().filter(|h| h.job == job)
    }
}
