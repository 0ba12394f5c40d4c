//! The worker registry ([`Workers`]): who is connected, alive, and
//! assigned where, and the lost ones kept for operators. Liveness is judged
//! from injected time (`now_ms`), never the clock.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::effects::{Effect, Effects};
use super::liveness::{Heard, Liveness};
use super::types::{HeldState, JobId, Why, WorkerId};

/// Lost workers whose records stay for operators (`accrue workers`,
/// ListWorkers); older ones are forgotten, so workers that come and go (a
/// restarted pod registers under a new id) do not grow the registry and
/// every listing without bound. A forgotten worker that comes back
/// registers again, under its old id if it asks for it.
pub const LOST_WORKERS_KEPT: usize = 256;

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
    /// `Liveness`).
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

impl WorkerState {
    /// Lower-case name, as the status page and metrics show it.
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Registered => "registered",
            WorkerState::Idle => "idle",
            WorkerState::Configuring => "configuring",
            WorkerState::Active => "active",
            WorkerState::Draining => "draining",
            WorkerState::Lost => "lost",
        }
    }
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

/// Every worker the coordinator knows, by id (read as a map), with the
/// registry's own rules: registration order, liveness, losing one.
#[derive(Debug, Default)]
pub struct Workers {
    map: BTreeMap<WorkerId, Worker>,
    next_seq: u64,
    /// Lost workers, least recently lost first, each once: the oldest
    /// records beyond [`LOST_WORKERS_KEPT`] are forgotten.
    lost: VecDeque<WorkerId>,
    /// Lost during the event being handled: the checkpoints of other jobs
    /// they were still writing are dropped before anything is scheduled.
    lost_now: Vec<WorkerId>,
    /// The coordinator's own delays in hearing workers (stalls, a
    /// backlog), not held against them.
    pub liveness: Liveness,
}

impl std::ops::Deref for Workers {
    type Target = BTreeMap<WorkerId, Worker>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for Workers {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Workers {
    /// Workers in registration order.
    pub fn in_order(&self) -> impl Iterator<Item = &Worker> {
        let mut w: Vec<&Worker> = self.map.values().collect();
        w.sort_by_key(|w| w.seq);
        w.into_iter()
    }

    pub fn register(&mut self, id: WorkerId, reg: Registration, now_ms: i64) {
        self.next_seq += 1;
        // A drained worker lost before its release (a peer blamed it, its
        // session broke) and registering again under its id is still
        // drained: it must not join a later generation.
        let draining = self.map.get(&id).is_some_and(|w| w.draining);
        info!(worker = %id, host = %reg.hostname, device = %reg.device, held = ?reg.held, "worker registered");
        let held = reg.held.clone();
        let worker = Worker {
            id: id.clone(),
            reg,
            state: WorkerState::Registered,
            heard: self.liveness.heard(now_ms, None),
            job: None,
            rank: None,
            draining,
            seq: self.next_seq,
            held,
            follows: None,
        };
        self.map.insert(id, worker);
    }

    /// A message from `worker` read `lag_ms` late (see `liveness`). Every
    /// heartbeat's delay is evidence of the backlog, a lost worker's too.
    pub fn heard_from(&mut self, worker: &str, now_ms: i64, lag_ms: Option<i64>) {
        let heard = self.liveness.heard(now_ms, lag_ms);
        if let Some(w) = self.map.get_mut(worker) {
            // A queued heartbeat applied after a newer message keeps the
            // newer time.
            if w.state != WorkerState::Lost && heard.at_ms >= w.heard.at_ms {
                w.heard = heard;
            }
        }
    }

    /// Connected workers silent past `timeout_ms` (net of the
    /// coordinator's own delays).
    pub fn silent(&self, now_ms: i64, timeout_ms: i64) -> Vec<WorkerId> {
        self.map
            .values()
            .filter(|w| w.connected() && self.liveness.silent_ms(&w.heard, now_ms) > timeout_ms)
            .map(|w| w.id.clone())
            .collect()
    }

    /// Marks `worker` lost (once): what it held is gone, its session is
    /// ended (a worker that is in fact alive reconnects and registers
    /// again). Returns the job it was in, if any: its generation must end.
    /// `None` when the worker is unknown or already lost.
    pub fn lose(&mut self, worker: &str, why: &Why, fx: &mut Effects) -> Option<Option<JobId>> {
        let w = self.map.get_mut(worker)?;
        if w.state == WorkerState::Lost {
            return None;
        }
        // Losing a worker mid-job costs a step; one that was released or
        // idle leaving is routine.
        if w.job.is_some() {
            warn!(worker, reason = %why, "worker lost");
        } else {
            info!(worker, reason = %why, "worker left");
        }
        w.state = WorkerState::Lost;
        // Whatever it held is gone with it (a re-registration reports anew).
        w.held = None;
        w.rank = None;
        let job = w.job.take();
        fx.push(Effect::EndSession {
            worker: worker.to_string(),
            why: why.detail.clone(),
        });
        self.lost_now.push(worker.to_string());
        Some(job)
    }

    /// The workers lost since the last call, each noted as the most
    /// recently lost (the records of the least recently lost beyond
    /// [`LOST_WORKERS_KEPT`] are forgotten; one that came back since is
    /// not lost and stays).
    pub fn take_lost(&mut self) -> Vec<WorkerId> {
        let lost = std::mem::take(&mut self.lost_now);
        for worker in &lost {
            self.lost.retain(|w| w != worker);
            self.lost.push_back(worker.clone());
        }
        while self.lost.len() > LOST_WORKERS_KEPT {
            let Some(old) = self.lost.pop_front() else {
                break;
            };
            let forget = self
                .map
                .get(&old)
                .is_some_and(|w| w.state == WorkerState::Lost && w.job.is_none());
            if forget {
                self.map.remove(&old);
            }
        }
        lost
    }

    /// `worker` leaves its job: idle again, or gone for good when draining
    /// (a lost worker stays lost).
    pub fn release(&mut self, worker: &str) {
        if let Some(w) = self.map.get_mut(worker) {
            w.job = None;
            w.rank = None;
            if w.state != WorkerState::Lost {
                w.state = if w.draining {
                    WorkerState::Draining
                } else {
                    WorkerState::Idle
                };
            }
        }
    }
}
