//! The state the admin and worker services share: the core and the store
//! behind one lock, the open sessions, and the carrying out of the core's
//! effects (persist first, then send and publish).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{broadcast, mpsc};
use tonic::Status;

use super::markers::Markers;
use super::model_folder::TokenizerWriter;
use super::push_room::Signals;
use super::tracking::TensorBoard;
use crate::core::{Coordinator, CoreError, Effects, Event, JobId, ToWorker, WatchItem, WorkerId};
use crate::rl::engine::client::EngineClient;
use crate::shell::store::Store;

/// Messages queued for one worker's session stream. Domain messages, not
/// wire ones: each session's stream encodes its own, outside the state lock
/// and in parallel (a generation's W Configures were built under the lock).
pub type SessionTx = mpsc::UnboundedSender<Result<ToWorker, Status>>;

/// State shared by the admin and worker services.
pub struct Shared {
    pub(super) inner: Mutex<Inner>,
    pub(super) watch: broadcast::Sender<(JobId, WatchItem)>,
    pub(super) metrics: crate::shell::prometheus::Exporter,
    /// Wakes rollout pushers waiting for queue room.
    pub(super) rollouts: Signals,
    pub(super) tokenizers: Arc<TokenizerWriter>,
    pub(super) tensorboard: TensorBoard,
    /// The RL loop: each generating job's prompts, tokenizer and verifier.
    pub(super) scorers: Mutex<HashMap<JobId, Arc<crate::rl::scorer::Scorer>>>,
    /// Served jobs' endpoints (`[rl.serve]`).
    pub(super) endpoints: Mutex<HashMap<JobId, Arc<crate::rl::endpoint::Endpoint>>>,
    /// Endpoint calls waiting for their generation.
    pub(super) calls: super::calls::Calls,
    /// The RL loop's calls to external engines (`rl.engine`).
    pub(super) engine: EngineClient,
    /// The runtime the server was built on, for engine calls started from
    /// a scoring thread.
    pub(super) runtime: Option<tokio::runtime::Handle>,
    /// Itself, for work that outlives a call (scoring threads).
    pub(super) me: std::sync::Weak<Shared>,
    /// How long the state lock has been held (the control plane's serial
    /// section, issue 19), for `accrue bench control-plane`.
    pub(super) held: HeldTime,
    /// Heartbeats read since the last tick, applied by it: a heartbeat
    /// never waits for the state lock (at 4,096 workers, ~8,000 a second
    /// each blocked a runtime thread behind planning).
    pub(super) beats: Mutex<Vec<crate::core::Beat>>,
    /// The output markers of its jobs, which it keeps true.
    pub(super) markers: Markers,
}

/// Time the state lock was held: in total, how often, and the longest.
#[derive(Debug, Default)]
pub(super) struct HeldTime {
    total_ns: AtomicU64,
    count: AtomicU64,
    max_ns: AtomicU64,
}

/// A snapshot of the state lock's hold times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockStats {
    pub total_ns: u64,
    pub count: u64,
    pub max_ns: u64,
}

/// The state, locked; records how long it was held when dropped.
pub(crate) struct Locked<'a> {
    guard: MutexGuard<'a, Inner>,
    since: Instant,
    held: &'a HeldTime,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let ns = self.since.elapsed().as_nanos() as u64;
        self.held.total_ns.fetch_add(ns, Ordering::Relaxed);
        self.held.count.fetch_add(1, Ordering::Relaxed);
        self.held.max_ns.fetch_max(ns, Ordering::Relaxed);
    }
}

pub(crate) struct Inner {
    pub core: Coordinator,
    pub store: Store,
    /// Open session per worker, with a serial to tell reconnects apart.
    pub(super) sessions: HashMap<WorkerId, (u64, SessionTx)>,
    next_session: u64,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Shared {
    /// The shared state of the coordinator `holder` names.
    pub fn new(
        core: Coordinator,
        store: Store,
        holder: crate::shell::output::Holder,
    ) -> Arc<Shared> {
        let (watch, _) = broadcast::channel(1024);
        Arc::new_cyclic(|me| Shared {
            inner: Mutex::new(Inner {
                core,
                store,
                sessions: HashMap::new(),
                next_session: 0,
            }),
            watch,
            metrics: crate::shell::prometheus::Exporter::new(),
            rollouts: Signals::default(),
            tokenizers: Arc::default(),
            tensorboard: TensorBoard::default(),
            scorers: Mutex::new(HashMap::new()),
            endpoints: Mutex::new(HashMap::new()),
            calls: Default::default(),
            engine: EngineClient::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
            me: me.clone(),
            held: HeldTime::default(),
            beats: Mutex::new(Vec::new()),
            markers: Markers::new(holder),
        })
    }

    /// Rewrites the output markers of the live jobs with `now_ms` as
    /// their liveness: the jobs are read under the state lock, the files
    /// written after it is released.
    pub fn refresh_markers(&self, now_ms: i64) {
        let holder = self.markers.holder();
        let live: Vec<_> = {
            let inner = self.lock();
            inner
                .core
                .jobs()
                .filter(|j| !j.rec.state.is_terminal())
                .map(|j| {
                    let owner = crate::shell::output::Owner {
                        submitted_unix_ms: j.rec.submitted_unix_ms,
                        ..crate::shell::output::Owner::new(&j.rec.id, &j.rec.name, holder, now_ms)
                    };
                    (owner, j.spec.job.output_dir.clone())
                })
                .collect()
        };
        self.markers.refresh(&live, now_ms);
    }

    /// The Prometheus text exposition (scrape-time gauges refreshed).
    pub fn render_metrics(&self) -> String {
        {
            let inner = self.lock();
            self.metrics.observe_core(&inner.core, now_ms());
        }
        self.metrics.observe_push_waiters(self.rollout_waiters());
        self.metrics.render()
    }

    pub(crate) fn lock(&self) -> Locked<'_> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Locked {
            guard,
            since: Instant::now(),
            held: &self.held,
        }
    }

    /// Reads the state machine under the state lock (what an embedding
    /// program or a benchmark shows: jobs, workers).
    pub fn read<R>(&self, f: impl FnOnce(&Coordinator) -> R) -> R {
        f(&self.lock().core)
    }

    /// The bytes of `job`'s step records in the store (see
    /// [`Store::steps_bytes`]).
    pub fn steps_bytes(&self, job: &str) -> std::io::Result<u64> {
        self.lock()
            .store
            .steps_bytes(job)
            .map_err(std::io::Error::other)
    }

    /// How long the state lock has been held since the server started;
    /// `reset` starts the longest hold over (a benchmark's next phase).
    pub fn lock_stats(&self, reset: bool) -> LockStats {
        let max_ns = match reset {
            true => self.held.max_ns.swap(0, Ordering::Relaxed),
            false => self.held.max_ns.load(Ordering::Relaxed),
        };
        LockStats {
            total_ns: self.held.total_ns.load(Ordering::Relaxed),
            count: self.held.count.load(Ordering::Relaxed),
            max_ns,
        }
    }

    /// See [`crate::shell::prometheus::Exporter::plan_seconds`].
    pub fn plan_seconds(&self, job: &str) -> (f64, u64) {
        self.metrics.plan_seconds(job)
    }

    /// Queues a heartbeat read now for the next tick (never the state
    /// lock: the tick applies them).
    pub fn heartbeat(&self, worker: WorkerId, lag_ms: Option<i64>) {
        let beat = crate::core::Beat {
            worker,
            at_ms: now_ms(),
            lag_ms,
        };
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(beat);
    }

    /// Heartbeats queued for the next tick.
    #[cfg(test)]
    pub(crate) fn queued_heartbeats(&self) -> usize {
        self.beats.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Applies the heartbeats queued since the last call (the tick does,
    /// under the state lock, just before `Event::Tick`).
    pub(crate) fn apply_heartbeats(&self, inner: &mut Inner) -> Result<(), Status> {
        let beats = std::mem::take(&mut *self.beats.lock().unwrap_or_else(|p| p.into_inner()));
        if beats.is_empty() {
            return Ok(());
        }
        self.apply_locked(inner, Event::Heartbeats { beats })
    }

    /// Feeds one event to the state machine and carries out its effects.
    pub fn apply(&self, event: Event) -> Result<(), Status> {
        let mut inner = self.lock();
        self.apply_locked(&mut inner, event)
    }

    pub(crate) fn apply_locked(&self, inner: &mut Inner, event: Event) -> Result<(), Status> {
        let (effects, timing) = handle_timed(inner, event).map_err(core_status)?;
        self.run_effects(inner, effects, timing)
    }

    /// Subscribes to watch items (subscribe before reading history so none
    /// is missed).
    pub fn subscribe(&self) -> broadcast::Receiver<(JobId, WatchItem)> {
        self.watch.subscribe()
    }

    /// Opens a session for `worker`, returning its serial.
    pub(crate) fn open_session(&self, worker: &str, tx: SessionTx) -> Result<u64, Status> {
        let mut inner = self.lock();
        if inner.core.worker(worker).is_none() {
            return Err(Status::not_found(format!(
                "worker {worker} is not registered; call Register first"
            )));
        }
        inner.next_session += 1;
        let serial = inner.next_session;
        inner.sessions.insert(worker.to_string(), (serial, tx));
        self.apply_locked(
            &mut inner,
            Event::SessionOpened {
                worker: worker.to_string(),
            },
        )?;
        Ok(serial)
    }

    /// Closes a session unless a newer one replaced it.
    pub(crate) fn close_session(&self, worker: &str, serial: u64) {
        let mut inner = self.lock();
        if inner
            .sessions
            .get(worker)
            .is_some_and(|(s, _)| *s == serial)
        {
            inner.sessions.remove(worker);
            let _ = self.apply_locked(
                &mut inner,
                Event::SessionClosed {
                    worker: worker.to_string(),
                },
            );
        }
    }
}

/// When a state-machine call started and returned, for the latency
/// metrics (measured here: the core has no clock).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(super) started: Instant,
    pub(super) returned: Instant,
}

/// Feeds one event to the state machine, timing the call.
pub(crate) fn handle_timed(
    inner: &mut Inner,
    event: Event,
) -> Result<(Effects, Timing), CoreError> {
    let started = Instant::now();
    let effects = inner.core.handle(event, now_ms())?;
    let returned = Instant::now();
    Ok((effects, Timing { started, returned }))
}

/// The one mapping from domain errors to gRPC status codes.
pub fn core_status(e: CoreError) -> Status {
    match e {
        CoreError::JobNotFound(_) | CoreError::WorkerNotFound(_) => {
            Status::not_found(e.to_string())
        }
        CoreError::BadJobState { .. } | CoreError::NotStreamed(_) | CoreError::NotServed(_) => {
            Status::failed_precondition(e.to_string())
        }
        CoreError::QueueFull { .. } | CoreError::ServeFull { .. } => {
            Status::resource_exhausted(e.to_string())
        }
        CoreError::WorkerIdInUse(_) => Status::already_exists(e.to_string()),
        CoreError::DuplicateJob(_) => Status::already_exists(e.to_string()),
        CoreError::InvalidUpdate { .. }
        | CoreError::AmbiguousJob { .. }
        | CoreError::RolloutTooLong { .. } => Status::invalid_argument(e.to_string()),
        CoreError::NotQuarantined { .. } => Status::not_found(e.to_string()),
        CoreError::OutputInUse(_) => Status::failed_precondition(e.to_string()),
    }
}

#[cfg(test)]
#[path = "shared_tests.rs"]
mod tests;
