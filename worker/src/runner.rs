//! Runs the coordinator's work on a dedicated thread: step plans, aborts and
//! checkpoints, against an [`Engine`] (the libtorch trainers in the real
//! worker, a fake in tests).
//!
//! Why a std thread: a step is seconds to minutes of CPU/GPU work, and the
//! session's heartbeats must keep flowing on the tokio runtime meanwhile. The
//! thread owns the engine (libtorch state is not shared), takes [`Work`]
//! from a queue in order, and sends its answers as ready-made
//! `WorkerMessage`s on an unbounded channel the session forwards.
//!
//! On `Configure` the thread joins the generation's collective (world 1:
//! [`Solo`]; more ranks: through the injected [`Connector`], the CPU TCP
//! ring in the real worker, in-process ranks in tests) and hands it to the
//! engine; a re-configure rebuilds the collective and keeps the replica
//! when it is at the configured step (and its shards still fit).
//!
//! A step's metrics are *sums* (DESIGN.md "The math"): Σ loss over loss
//! tokens, tokens, documents, padding, and the time split; the coordinator
//! forms the means after summing over ranks.
//!
//! Recovery (issue 6): [`configure`] restores from a verified checkpoint or
//! takes the state from the live members that hold it (state sync, no
//! disk); an abort interrupts the in-flight step's collective from the
//! session's thread ([`Runner::submit`]); [`checkpoint`] snapshots state
//! on this thread and writes it on a background one while training goes
//! on; [`fault`] stops the process at named points for fault-injection
//! tests.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use accrue_proto::v1 as wire;
use accrue_proto::v1::worker_message::Msg;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use crate::collective::{AbortHandle, Collective, CollectiveError};
use crate::config::JobConfig;
use crate::train::Engine;

pub use checkpoint::{write_checkpoint, CheckpointManifest, ManifestCursor};

/// Builds an engine for a job and this rank's collective, restoring from
/// a checkpoint directory if given.
pub type Factory = Arc<
    dyn Fn(&JobConfig, Option<&Path>, Box<dyn Collective>) -> anyhow::Result<Box<dyn Engine>>
        + Send
        + Sync,
>;

/// Joins the collective of a generation of more than one rank, from this
/// worker's listener and the configure message (rank, world, peers,
/// generation).
pub type Connector = Arc<
    dyn Fn(&TcpListener, &wire::Configure) -> Result<Box<dyn Collective>, CollectiveError>
        + Send
        + Sync,
>;

/// The libtorch engines, by the job's sharding (`train::build`).
pub fn default_factory() -> Factory {
    Arc::new(crate::train::build)
}

/// How long one collective may wait for a peer before it is an error. A
/// killed peer is noticed at once (its sockets close); this bounds a
/// stalled one, and must exceed the longest compute imbalance between
/// ranks in a step. `ACCRUE_COLLECTIVE_TIMEOUT_S` overrides it.
pub fn collective_timeout() -> std::time::Duration {
    let secs = std::env::var("ACCRUE_COLLECTIVE_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(60.0);
    std::time::Duration::from_secs_f64(secs)
}

/// The collective between worker processes: the CPU TCP ring, with the
/// peers' addresses in rank order from the configure message.
pub fn default_connector() -> Connector {
    Arc::new(|listener, c| {
        let mut peers: Vec<&wire::Peer> = c.peers.iter().collect();
        peers.sort_by_key(|p| p.rank);
        if peers.len() != c.world_size as usize
            || peers.iter().enumerate().any(|(i, p)| p.rank as usize != i)
        {
            return Err(CollectiveError::Setup(format!(
                "configure: {} peers for world size {}, ranks must be 0..{}",
                peers.len(),
                c.world_size,
                c.world_size
            )));
        }
        let addrs: Vec<String> = peers.iter().map(|p| p.collective_addr.clone()).collect();
        let ring = crate::collective::tcp::connect_cpu(
            listener,
            c.rank as usize,
            c.world_size as usize,
            &addrs,
            c.generation,
            collective_timeout(),
        )?;
        Ok(Box::new(ring) as Box<dyn Collective>)
    })
}

/// What a [`Runner`] is built from.
pub struct RunnerConfig {
    pub factory: Factory,
    pub connector: Connector,
    /// This worker's collective endpoint (peers connect to it); needed for
    /// world sizes above 1.
    pub listener: Option<TcpListener>,
}

impl RunnerConfig {
    /// `factory` with the default connector and no listener (world 1 only).
    pub fn new(factory: Factory) -> RunnerConfig {
        RunnerConfig {
            factory,
            connector: default_connector(),
            listener: None,
        }
    }
}

/// Work for the runner thread, in arrival order.
#[derive(Debug)]
pub enum Work {
    Configure(Box<wire::Configure>),
    Plan(Box<wire::StepPlan>),
    Checkpoint(wire::CheckpointRequest),
    Abort(wire::Abort),
    /// Write the policy for an external generator (`rl.publish_every`).
    Publish(wire::PublishPolicy),
}

/// Where the worker stands, read by the heartbeat without touching the thread.
#[derive(Debug, Default)]
pub struct Progress {
    pub generation: AtomicU64,
    /// Last step whose update this worker holds.
    pub step: AtomicU64,
    /// The replica held, reported when re-registering after a coordinator
    /// restart (`RegisterRequest.held`).
    pub held: Mutex<Option<wire::HeldState>>,
}

impl Progress {
    /// The replica this process holds, if any.
    pub fn held(&self) -> Option<wire::HeldState> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_held(&self, held: Option<wire::HeldState>) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = held;
    }
}

/// The in-flight step's abort target: (generation, step) being run and the
/// handle of its generation's collective.
#[derive(Default)]
struct InFlight {
    running: Option<(u64, u64)>,
    /// (generation, handle) of the current collective.
    collective: Option<(u64, AbortHandle)>,
}

/// The runner thread's handle: queue work, flag aborts, join on shutdown.
pub struct Runner {
    queue: Option<mpsc::Sender<Work>>,
    /// (generation, step) of the last aborted step.
    aborted: Arc<Mutex<Option<(u64, u64)>>>,
    in_flight: Arc<Mutex<InFlight>>,
    progress: Arc<Progress>,
    /// Work queued or running, and checkpoint writes in flight.
    pending: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Runner {
    /// Starts the thread for world size 1 ([`RunnerConfig::new`]).
    pub fn spawn(factory: Factory, out: UnboundedSender<wire::WorkerMessage>) -> Runner {
        Runner::start(RunnerConfig::new(factory), out)
    }

    /// Starts the thread; its answers go to `out`.
    pub fn start(cfg: RunnerConfig, out: UnboundedSender<wire::WorkerMessage>) -> Runner {
        let (queue, rx) = mpsc::channel();
        let aborted = Arc::new(Mutex::new(None));
        let in_flight = Arc::new(Mutex::new(InFlight::default()));
        let progress = Arc::new(Progress::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let left = pending.clone();
        let (a, p, f) = (aborted.clone(), progress.clone(), in_flight.clone());
        let writes = pending.clone();
        // The engine is built and lives on the thread: libtorch state
        // need not be Send.
        let thread = std::thread::Builder::new()
            .name("accrue-runner".into())
            .spawn(move || {
                let mut state = Thread {
                    factory: cfg.factory,
                    connector: cfg.connector,
                    listener: cfg.listener,
                    out,
                    aborted: a,
                    in_flight: f,
                    progress: p,
                    job: None,
                    last_done: Instant::now(),
                    writer: checkpoint::Writer::new(writes),
                };
                while let Ok(w) = rx.recv() {
                    state.handle(w);
                    // After the answer is sent: zero means all answers are out.
                    left.fetch_sub(1, Ordering::SeqCst);
                }
                // Pending checkpoint writes finish before the thread ends.
                state.writer.wait();
            })
            .expect("spawning the runner thread");
        Runner {
            queue: Some(queue),
            aborted,
            in_flight,
            progress,
            pending,
            thread: Some(thread),
        }
    }

    /// Queues work. An abort also takes effect at once: between the current
    /// step's microbatches, and, when that step is the one running, by
    /// interrupting its collective (a peer may be frozen). A configure of a
    /// newer generation aborts a step of an older one still running.
    pub fn submit(&self, work: Work) {
        let target = match &work {
            Work::Abort(a) => Some((a.generation, a.step)),
            // A newer generation ends the running step of an older one.
            Work::Configure(c) => lock(&self.in_flight)
                .running
                .filter(|(g, _)| *g < c.generation),
            _ => None,
        };
        if let Some((generation, step)) = target {
            *lock(&self.aborted) = Some((generation, step));
            let f = lock(&self.in_flight);
            if f.running == Some((generation, step)) {
                if let Some((g, abort)) = &f.collective {
                    if *g == generation {
                        info!(generation, step, "aborting the in-flight collective");
                        abort();
                    }
                }
            }
        }
        if let Some(q) = &self.queue {
            self.pending.fetch_add(1, Ordering::SeqCst);
            // The thread only ends on shutdown; a send error cannot happen before.
            let _ = q.send(work);
        }
    }

    /// Work items queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Finishes the queued work (a final checkpoint included) and joins.
    pub fn shutdown(mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The job the thread holds a replica of.
struct Held {
    job: String,
    generation: u64,
    rank: u32,
    world_size: u32,
    /// Last step whose update the engine holds.
    step: u64,
    name: String,
    exec: Box<dyn Engine>,
}

impl Held {
    /// This replica as `RegisterRequest.held` reports it.
    fn held_state(&self) -> wire::HeldState {
        wire::HeldState {
            job_id: self.job.clone(),
            step: self.step,
            world_size: self.world_size,
            rank: self.rank,
            generation: self.generation,
        }
    }
}

struct Thread {
    factory: Factory,
    connector: Connector,
    listener: Option<TcpListener>,
    out: UnboundedSender<wire::WorkerMessage>,
    aborted: Arc<Mutex<Option<(u64, u64)>>>,
    in_flight: Arc<Mutex<InFlight>>,
    progress: Arc<Progress>,
    job: Option<Held>,
    last_done: Instant,
    /// The background checkpoint writer (one write at a time).
    writer: checkpoint::Writer,
}

impl Thread {
    fn send(&self, msg: Msg) {
        let _ = self.out.send(wire::WorkerMessage { msg: Some(msg) });
    }

    fn error(&self, job: &str, generation: u64, step: u64, kind: wire::ErrorKind, message: String) {
        self.error_blaming(job, generation, step, kind, message, None);
    }

    fn error_blaming(
        &self,
        job: &str,
        generation: u64,
        step: u64,
        kind: wire::ErrorKind,
        message: String,
        peer_rank: Option<u32>,
    ) {
        warn!(job, step, %message, ?peer_rank, "worker error");
        self.send(Msg::Error(wire::WorkerError {
            job_id: job.into(),
            generation,
            step,
            kind: kind as i32,
            message,
            peer_rank,
        }));
    }

    fn handle(&mut self, work: Work) {
        match work {
            Work::Configure(c) => self.configure(*c),
            Work::Plan(p) => self.plan(&p),
            Work::Checkpoint(c) => self.checkpoint(&c),
            Work::Publish(p) => self.publish(&p),
            Work::Abort(a) => {
                if let Some(h) = &mut self.job {
                    h.exec.zero_grad();
                }
                info!(job = %a.job_id, step = a.step, reason = ?a.reason(), detail = %a.detail, "step aborted");
            }
        }
    }

    fn plan(&mut self, p: &wire::StepPlan) {
        let Some(h) = self.job.as_mut().filter(|h| h.job == p.job_id) else {
            let msg = format!(
                "step {}: a plan for job {} before its configuration",
                p.step, p.job_id
            );
            return self.error(
                &p.job_id,
                p.generation,
                p.step,
                wire::ErrorKind::InvalidPlan,
                msg,
            );
        };
        if p.kind == wire::PlanKind::Reference as i32 {
            let result = guarded(p, || reference::run_reference(h.exec.as_mut(), p));
            self.last_done = Instant::now();
            match result {
                Ok((sums, logps)) => {
                    info!(
                        chunk = p.step,
                        sequences = logps.len(),
                        "reference chunk done"
                    );
                    self.send(Msg::StepResult(wire::StepResult {
                        job_id: p.job_id.clone(),
                        generation: p.generation,
                        step: p.step,
                        rank: p.rank,
                        sums: Some(sums),
                        logps,
                    }));
                }
                Err(e) => {
                    warn!(chunk = p.step, message = %e.message, "reference chunk failed");
                    self.send(Msg::Error(e));
                }
            }
            return;
        }
        let key = (p.generation, p.step);
        if p.replay {
            info!(
                step = p.step,
                generation = p.generation,
                "replaying a committed step"
            );
        }
        fault::point(fault::Point::BeforeStep, p.step, p.rank);
        // Set before the abort flag is polled: an abort arriving from now
        // on also interrupts the step's collective.
        lock(&self.in_flight).running = Some(key);
        let aborted = self.aborted.clone();
        let is_aborted = move || *lock(&aborted) == Some(key);
        let idle_s = self.last_done.elapsed().as_secs_f64();
        let outcome = guarded(p, || Ok(run_step(h.exec.as_mut(), p, idle_s, &is_aborted)))
            .unwrap_or_else(StepOutcome::Failed);
        lock(&self.in_flight).running = None;
        self.last_done = Instant::now();
        match outcome {
            StepOutcome::Done(sums) => {
                h.step = p.step;
                self.progress.step.store(p.step, Ordering::Relaxed);
                self.progress.set_held(Some(h.held_state()));
                info!(
                    step = p.step,
                    loss = sums.loss_sum / sums.loss_tokens.max(1) as f64,
                    "step done"
                );
                self.send(Msg::StepResult(wire::StepResult {
                    job_id: p.job_id.clone(),
                    generation: p.generation,
                    step: p.step,
                    rank: p.rank,
                    sums: Some(sums),
                    logps: Vec::new(),
                }));
            }
            StepOutcome::Failed(e) => {
                warn!(step = p.step, message = %e.message, "step failed");
                self.send(Msg::Error(e));
            }
            StepOutcome::Aborted => info!(
                step = p.step,
                replay = p.replay,
                "step aborted mid-way: gradients dropped, parameters untouched"
            ),
        }
    }
}

/// Runs `f` for plan `p`, turning a panic (libtorch panics on a C++
/// exception, out-of-memory among them) into the step's error, typed by
/// `error::from_panic`: the step fails loudly instead of the thread dying
/// while the process keeps heartbeating.
fn guarded<T>(
    p: &wire::StepPlan,
    f: impl FnOnce() -> Result<T, wire::WorkerError>,
) -> Result<T, wire::WorkerError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let e = crate::error::from_panic(payload.as_ref());
        let (kind, peer_rank) = crate::error::classify(&e);
        Err(wire::WorkerError {
            job_id: p.job_id.clone(),
            generation: p.generation,
            step: p.step,
            kind: kind as i32,
            message: format!("step {}: {e:#}", p.step),
            peer_rank,
        })
    })
}

/// A configure failure: kind, message, blamed peer.
type ConfigureError = (wire::ErrorKind, String, Option<u32>);

mod checkpoint;
mod configure;
pub mod fault;
mod publish;
mod reference;
mod step;

pub use step::{run_step, StepOutcome};

#[cfg(test)]
mod recovery_tests;
#[cfg(test)]
mod tests;
