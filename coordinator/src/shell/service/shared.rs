//! The state the admin and worker services share: the core and the store
//! behind one lock, the open sessions, and the carrying out of the core's
//! effects (persist first, then send and publish).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{broadcast, mpsc};
use tonic::Status;
use tracing::{error, warn};

use super::model_folder::TokenizerWriter;
use super::push_room::Signals;
use super::tracking::TensorBoard;
use crate::core::{
    Coordinator, CoreError, Effect, Effects, Event, EventKind, JobId, Persist, ToWorker, WatchItem,
    WorkerId,
};
use crate::rl::engine::client::EngineClient;
use crate::shell::store::{StepRecord, Store};

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
    pub(super) tokenizers: TokenizerWriter,
    pub(super) tensorboard: TensorBoard,
    /// The RL loop: each generating job's prompts, tokenizer and verifier.
    pub(super) scorers: Mutex<HashMap<JobId, Arc<crate::rl::scorer::Scorer>>>,
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
}

/// Time the state lock was held: in total, how often, and the longest.
#[derive(Debug, Default)]
pub(super) struct HeldTime {
    total_ns: AtomicU64,
    count: AtomicU64,
    max_ns: AtomicU64,
}

/// A snapshot of [`HeldTime`].
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
    sessions: HashMap<WorkerId, (u64, SessionTx)>,
    next_session: u64,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Shared {
    pub fn new(core: Coordinator, store: Store) -> Arc<Shared> {
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
            tokenizers: TokenizerWriter::default(),
            tensorboard: TensorBoard::default(),
            scorers: Mutex::new(HashMap::new()),
            engine: EngineClient::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
            me: me.clone(),
            held: HeldTime::default(),
            beats: Mutex::new(Vec::new()),
        })
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
    /// lock: see [`Shared::apply_heartbeats`]).
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

    /// Feeds the exporter what one state-machine call did: aborted steps
    /// and completed checkpoints (committed steps and dispatched plans are
    /// observed while their effects are carried out).
    fn observe_effects(&self, inner: &Inner, effects: &[Effect]) {
        let mut aborted: Vec<&str> = Vec::new();
        for e in effects {
            let (job, reason) = match e {
                Effect::Send {
                    msg: ToWorker::Abort { job, why, .. },
                    ..
                } => (job, why.reason),
                // A generation whose members were all lost sends no Abort.
                Effect::Publish {
                    job,
                    item:
                        WatchItem::Event {
                            reason: Some(reason),
                            aborted_step: Some(_),
                            ..
                        },
                } => (job, *reason),
                Effect::Publish {
                    job,
                    item:
                        WatchItem::Event {
                            kind: EventKind::Checkpoint,
                            unix_ms,
                            ..
                        },
                } => {
                    let step = inner.core.job(job).ok().and_then(|j| j.rec.last_checkpoint);
                    self.metrics.observe_checkpoint(job, step, *unix_ms);
                    continue;
                }
                _ => continue,
            };
            // One abort per job and call, however many members were told.
            if !aborted.contains(&job.as_str()) {
                aborted.push(job);
                self.metrics.observe_abort(job, reason);
            }
        }
    }

    /// Writes a metrics line to the job's TensorBoard files when its spec
    /// asks for them; `Err` names the file that could not be written.
    fn track(
        &self,
        inner: &Inner,
        job: &JobId,
        prefix: &str,
        step: u64,
        unix_ms: i64,
        line: &impl serde::Serialize,
    ) -> Result<(), String> {
        let Ok(j) = inner.core.job(job) else {
            return Ok(());
        };
        if !j.spec.tracking.tensorboard {
            return Ok(());
        }
        let out = Path::new(&j.spec.job.output_dir);
        self.tensorboard
            .write(job, out, prefix, step, unix_ms, line)
            .map_err(|err| {
                error!(%job, %err, "writing TensorBoard events failed");
                format!("{}/tb: {err}", out.display())
            })
    }

    /// One durable write; Err names the job and what failed.
    fn persist(&self, inner: &mut Inner, p: Persist) -> Result<(), (JobId, String)> {
        let job = p.job().to_string();
        let result = match p {
            Persist::Job(rec) => {
                // A state change may end a waiting push (cancelled job).
                self.rollouts.wake();
                inner
                    .store
                    .put_job(&rec)
                    .map_err(|e| format!("persisting job {job}: {e}"))
            }
            Persist::Step {
                rec,
                metrics,
                docs,
                manifest,
            } => {
                let step = metrics.step;
                let m = (*metrics).clone();
                let record = StepRecord {
                    metrics: *metrics,
                    docs,
                    manifest: Some(*manifest),
                };
                let written = inner.store.commit_step(&rec, record);
                if written.is_ok() {
                    self.metrics.observe_step(&job, &m);
                    cool_off_lock(&inner.store, &job, step);
                }
                written.map_err(|e| format!("persisting step {step} of job {job}: {e}"))
            }
            Persist::Reference { entries, .. } => inner
                .store
                .put_reference(&job, &entries)
                .map_err(|e| format!("persisting reference log-probs of job {job}: {e}")),
            Persist::Rollouts(w) => {
                let written = inner.store.put_rollouts(&w);
                if written.is_ok() {
                    if let Some(c) = &w.counts {
                        self.metrics.observe_rollouts(&job, c);
                    }
                }
                if !w.remove.is_empty() {
                    self.rollouts.wake();
                }
                written.map_err(|e| format!("persisting rollouts of job {job}: {e}"))
            }
        };
        result.map_err(|what| {
            error!(%job, %what, "a write to the store failed");
            (job, what)
        })
    }

    /// Some of a call's writes failed: what followed them (`withheld`
    /// effects) is dropped, and the core ends the jobs written for without
    /// writing again (their last durable state stays in the store).
    fn persist_failed(
        &self,
        inner: &mut Inner,
        failed: Vec<(JobId, String)>,
        withheld: usize,
    ) -> Status {
        let error = failed
            .iter()
            .map(|(_, what)| what.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        let mut jobs: Vec<JobId> = failed.into_iter().map(|(j, _)| j).collect();
        jobs.dedup();
        error!(?jobs, withheld, %error, "writes failed: their messages are withheld");
        let status = Status::internal(error.clone());
        if let Err(e) = self.apply_locked(inner, Event::PersistFailed { jobs, error }) {
            error!(%e, "ending the jobs whose writes failed");
        }
        status
    }

    /// Carries out `effects` of the state-machine call `timing` measured:
    /// the writes, then (only if every write succeeded) the rest. A
    /// refused write withholds everything after it and fails the jobs
    /// written for, in memory only ([`Event::PersistFailed`]).
    pub(super) fn run_effects(
        &self,
        inner: &mut Inner,
        effects: Effects,
        timing: Timing,
    ) -> Result<(), Status> {
        let (persists, effects) = effects.into_parts();
        let mut failed: Vec<(JobId, String)> = Vec::new();
        for p in persists {
            if let Err(e) = self.persist(inner, p) {
                failed.push(e);
            }
        }
        if !failed.is_empty() {
            return Err(self.persist_failed(inner, failed, effects.len()));
        }
        self.observe_effects(inner, &effects);
        let mut failure = None;
        // Outputs that could not be written fail their job, after this
        // call's effects (the core hears of it as an event); so does a
        // history read that could not start.
        let mut failed_outputs: Vec<Event> = Vec::new();
        // Per job with a plan among the effects: when its last plan was queued.
        let mut dispatched: Vec<(JobId, Instant)> = Vec::new();
        for e in effects {
            match e {
                Effect::AppendMetrics { job, path, metrics } => {
                    if let Err(err) = crate::shell::output::append_metrics(&path, &job, &metrics) {
                        error!(path = %path.display(), %err, "writing metrics.jsonl failed");
                        let what = format!("{}: {err}", path.display());
                        failed_outputs.push(Event::OutputFailed { job, what });
                    } else if let Err(what) = self.track(
                        inner,
                        &job,
                        "train",
                        metrics.step,
                        metrics.unix_ms,
                        &*metrics,
                    ) {
                        failed_outputs.push(Event::OutputFailed { job, what });
                    }
                }
                Effect::AppendEval { job, path, eval } => {
                    self.metrics.observe_eval(&job, &eval);
                    if let Err(err) = crate::shell::output::append_eval(&path, &job, &eval) {
                        error!(path = %path.display(), %err, "writing metrics.jsonl failed");
                        let what = format!("{}: {err}", path.display());
                        failed_outputs.push(Event::OutputFailed { job, what });
                    } else if let Err(what) =
                        self.track(inner, &job, "eval", eval.step, eval.unix_ms, &eval)
                    {
                        failed_outputs.push(Event::OutputFailed { job, what });
                    }
                }
                Effect::RemoveCheckpoint { job, step, dir } => {
                    match std::fs::remove_dir_all(&dir) {
                        Ok(()) => {
                            tracing::info!(%job, step, dir = %dir.display(), "old checkpoint removed")
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(err) => {
                            error!(%job, dir = %dir.display(), %err, "removing an old checkpoint failed");
                            let what = format!("removing {}: {err}", dir.display());
                            failed_outputs.push(Event::OutputFailed { job, what });
                        }
                    }
                }
                Effect::WriteTokenizer { job, dir } => {
                    if let Ok(j) = inner.core.job(&job) {
                        let (me, id) = (self.me.clone(), job.clone());
                        self.tokenizers.write(&job, &j.spec.data, &dir, move |what| {
                            if let Some(s) = me.upgrade() {
                                let failed = Event::OutputFailed { job: id, what };
                                if let Err(e) = s.apply(failed) {
                                    error!(%e, "failing the job after a tokenizer write failed");
                                }
                            }
                        });
                    }
                }
                Effect::Send { worker, msg } => {
                    // A relay's messages are its members'.
                    let relayed: &[(u32, ToWorker)] = match &msg {
                        ToWorker::Relay { messages, .. } => messages,
                        _ => &[],
                    };
                    let each = std::iter::once(&msg).chain(relayed.iter().map(|m| &m.1));
                    let planned = each.clone().find_map(|m| match m {
                        ToWorker::Plan { job, .. } => Some(job.clone()),
                        _ => None,
                    });
                    if let Some((_, tx)) = inner.sessions.get(&worker) {
                        // A closed channel means the session is going away;
                        // its close event will follow.
                        let _ = tx.send(Ok(msg));
                    }
                    if let Some(job) = planned {
                        let now = Instant::now();
                        match dispatched.iter_mut().find(|(j, _)| *j == job) {
                            Some((_, t)) => *t = now,
                            None => dispatched.push((job, now)),
                        }
                    }
                }
                Effect::EndSession { worker, why } => {
                    // The session's reader task keeps its own sender, so
                    // the stream is ended with a status, not by a drop.
                    if let Some((_, tx)) = inner.sessions.remove(&worker) {
                        let status = Status::aborted(format!(
                            "this worker was declared lost ({why}); register again"
                        ));
                        let _ = tx.send(Err(status));
                    }
                }
                Effect::Publish { job, item } => {
                    let _ = self.watch.send((job, item));
                }
                Effect::LoadHistory { job, from, to } => {
                    if let Err(err) =
                        load_history(self.me.clone(), inner.store.clone(), &job, from, to)
                    {
                        // The core waits for an answer: without a thread the
                        // replay would wait forever, so it fails instead.
                        let steps = Err(format!("starting the thread that reads it: {err}"));
                        failed_outputs.push(Event::HistoryLoaded { job, from, steps });
                    }
                }
                Effect::ScoreRound(round) => self.score_round(*round),
                Effect::EngineGenerate(round) => self.engine_generate(*round),
                Effect::EngineReload {
                    job,
                    step,
                    dir,
                    engine,
                } => self.engine_reload(job, step, dir, engine),
            }
        }
        for (job, queued) in &dispatched {
            let plan = timing.returned - timing.started;
            self.metrics
                .observe_plan(job, plan, *queued - timing.returned);
        }
        for event in failed_outputs {
            if let Err(status) = self.apply_locked(inner, event) {
                failure = Some(status);
            }
        }
        // The plans are queued to the sessions, whose tasks encode and send
        // them: the next step is planned while this one runs, after the
        // tasks already queued (the sends) had their turn.
        for (job, _) in dispatched {
            match (&self.runtime, self.me.upgrade()) {
                (Some(rt), Some(me)) => {
                    rt.spawn(async move {
                        tokio::task::yield_now().await;
                        me.plan_ahead(&job);
                    });
                }
                _ => self.plan_ahead_locked(inner, &job),
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Plans `job`'s next step while its current one runs (`core::ahead`).
    fn plan_ahead(&self, job: &str) {
        let mut inner = self.lock();
        self.plan_ahead_locked(&mut inner, job);
    }

    fn plan_ahead_locked(&self, inner: &mut Inner, job: &str) {
        let event = Event::PlanAhead {
            job: job.to_string(),
        };
        match handle_timed(inner, event) {
            Ok((_, timing)) => self
                .metrics
                .observe_plan_ahead(job, timing.returned - timing.started),
            // Nothing to report to: dispatch plans the step itself.
            Err(e) => warn!(job, %e, "planning the next step ahead failed"),
        }
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
    started: Instant,
    returned: Instant,
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
        CoreError::BadJobState { .. } | CoreError::NotStreamed(_) => {
            Status::failed_precondition(e.to_string())
        }
        CoreError::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
        CoreError::WorkerIdInUse(_) => Status::already_exists(e.to_string()),
        CoreError::DuplicateJob(_) => Status::already_exists(e.to_string()),
        CoreError::InvalidUpdate { .. }
        | CoreError::AmbiguousJob { .. }
        | CoreError::RolloutTooLong { .. } => Status::invalid_argument(e.to_string()),
        CoreError::NotQuarantined { .. } => Status::not_found(e.to_string()),
        CoreError::OutputInUse { .. } => Status::failed_precondition(e.to_string()),
    }
}

/// Reads steps `from..=to` of `job`'s replay history from the store on a
/// thread of its own (a replay reached steps the core no longer holds in
/// memory; decompressing their records must not hold the state lock) and
/// hands them to the core. Err: the thread could not start (nothing was
/// read; the caller answers the core itself).
fn load_history(
    me: std::sync::Weak<Shared>,
    store: Store,
    job: &str,
    from: u64,
    to: u64,
) -> std::io::Result<()> {
    let job = job.to_string();
    std::thread::Builder::new()
        .name("accrue-coord-history".into())
        .spawn(move || {
            let steps = crate::shell::store::committed_steps_between(&store, &job, from, to)
                .map_err(|e| e.to_string());
            if let Some(shared) = me.upgrade() {
                if let Err(status) = shared.apply(Event::HistoryLoaded { job, from, steps }) {
                    error!(%status, "handing the replay history read from the store to the core failed");
                }
            }
        })
        .map(|_| ())
}

/// Moves `job`'s old step records to a cold file on a thread of its own
/// when due: tens of megabytes read, written and synced at W = 1024 must
/// not hold the state lock (issue 19). A move that fails is logged and
/// due again at the next commit.
fn cool_off_lock(store: &Store, job: &str, step: u64) {
    let cooling = match store.cooling(job, step) {
        Ok(Some(c)) => c,
        Ok(None) => return,
        Err(err) => {
            warn!(%job, %err, "checking for old step records to move failed");
            return;
        }
    };
    let job = job.to_string();
    let spawned = std::thread::Builder::new()
        .name("accrue-coord-cool".into())
        .spawn(move || {
            if let Err(err) = cooling.run() {
                warn!(%job, %err, "moving old step records to the cold files failed");
            }
        });
    if let Err(err) = spawned {
        warn!(%err, "starting the move of old step records failed");
    }
}

#[cfg(test)]
#[path = "shared_tests.rs"]
mod tests;
