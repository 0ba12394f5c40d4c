//! Runs the coordinator's work on a dedicated thread: step plans, aborts and
//! checkpoints, against a [`StepExecutor`] (the libtorch `Trainer` in the
//! real worker, a fake in tests).
//!
//! Why a std thread: a step is seconds to minutes of CPU/GPU work, and the
//! session's heartbeats must keep flowing on the tokio runtime meanwhile. The
//! thread owns the executor (libtorch state is not shared), takes [`Work`]
//! from a queue in order, and sends its answers as ready-made
//! `WorkerMessage`s on an unbounded channel the session forwards.
//!
//! On `Configure` the thread joins the generation's collective (world 1:
//! [`Solo`]; more ranks: through the injected [`Connector`], the CPU TCP
//! ring in the real worker, in-process ranks in tests) and hands it to the
//! executor; a re-configure rebuilds the collective and keeps the replica
//! when it is at the configured step (and its shards still fit).
//!
//! A step's metrics are *sums* (DESIGN.md "The math"): Σ loss over loss
//! tokens, tokens, documents, padding, and the time split; the coordinator
//! forms the means after summing over ranks.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use accrue_proto::v1 as wire;
use accrue_proto::v1::worker_message::Msg;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use crate::collective::{Collective, CollectiveError, Solo};
use crate::config::JobConfig;

/// What one microbatch's forward/backward reports (sums, not means).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchOutcome {
    /// Σ per-token loss over the microbatch's loss tokens (SFT, PG), or Σ
    /// per-pair loss (DPO), unscaled.
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// Real tokens in the row.
    pub tokens: u64,
    /// Objective-specific sums (`pairs`, `rewards/chosen`, …).
    pub extra: BTreeMap<String, f64>,
}

/// One sequence's summed log-prob from a reference plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SequenceLogp {
    pub logp: f64,
    pub loss_tokens: u64,
}

/// The training engine a [`Runner`] drives: one model replica with its
/// optimizer. Gradients accumulate across `microbatch` calls and are
/// consumed once by `optimizer_step`.
pub trait StepExecutor {
    /// Forward/backward of one non-empty microbatch under the job's
    /// objective, normalised by the step's global `norms` from the plan
    /// (SFT: each loss token scaled by `1 / norms.loss_tokens`); gradients
    /// accumulate.
    fn microbatch(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
        norms: &wire::Normalizers,
    ) -> anyhow::Result<MicrobatchOutcome>;
    /// Reference plans: each sequence's log-prob summed over its loss
    /// tokens under the job's initial weights, forward only.
    fn sequence_logps(
        &mut self,
        _index: usize,
        _mb: &wire::Microbatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        anyhow::bail!("this engine cannot run reference plans")
    }
    /// Clip, step the optimizer at `lr`, zero the gradients; returns the
    /// global gradient norm before clipping. On a non-finite norm it fails
    /// and leaves the parameters untouched.
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<f64>;
    /// Drops the accumulated gradients (abort, failed step).
    fn zero_grad(&mut self);
    /// Writes this rank's part of the checkpoint (every rank calls it, in
    /// parallel); returns once every rank's part is written.
    fn save_checkpoint(&mut self, dir: &Path) -> anyhow::Result<()>;
    /// Whether the replica's state stays valid as `rank` of `world` (a new
    /// generation at the same step); false makes the runner rebuild it.
    fn fits(&self, _rank: usize, _world: usize) -> bool {
        true
    }
    /// Joins a new generation's collective, keeping the replica.
    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()>;
    /// True when every microbatch, padding included, runs collectives
    /// (FSDP gathers per unit): empty microbatches must then be run too,
    /// or ranks would diverge.
    fn collective_per_microbatch(&self) -> bool {
        false
    }
    /// Training FLOPs of a microbatch run with `loss_tokens` targets (for
    /// MFU; `model::flops`). 0 when the executor cannot tell.
    fn model_flops(&self, _mb: &wire::Microbatch, _loss_tokens: u64) -> f64 {
        0.0
    }
}

/// Builds an executor for a job and this rank's collective, restoring from
/// a checkpoint directory if given.
pub type Factory = Arc<
    dyn Fn(&JobConfig, Option<&Path>, Box<dyn Collective>) -> anyhow::Result<Box<dyn StepExecutor>>
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

/// The libtorch trainer.
pub fn default_factory() -> Factory {
    crate::runner_trainer::factory()
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
}

/// The data of `manifest.json` beside a checkpoint (rank 0 writes it last,
/// so its presence means the checkpoint is complete).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Manifest {
    pub job: String,
    /// The job's name (`job.name`): a job of the same name whose
    /// `model.init` is this directory resumes from it; any other job only
    /// takes its weights.
    #[serde(default)]
    pub name: String,
    pub step: u64,
    pub cursor: ManifestCursor,
    pub world_size: u32,
    pub generation: u64,
}

/// The data cursor as the coordinator's `cursor::Cursor` serialises it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, serde::Deserialize)]
pub struct ManifestCursor {
    pub epoch: u64,
    pub position: u64,
    pub overflow: Vec<u64>,
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    Done(wire::MetricSums),
    Failed(wire::WorkerError),
    /// Aborted by the coordinator: gradients dropped, nothing to report.
    Aborted,
}

/// Runs one plan: every non-empty microbatch (empty padding ones are
/// counted, not run), then the optimizer step. `aborted` is polled between
/// microbatches. `max_tokens` is the spec's budget per microbatch, for the
/// padding a padded layout would have wasted; `idle_s` is the time since
/// the previous plan finished.
pub fn run_step(
    exec: &mut dyn StepExecutor,
    plan: &wire::StepPlan,
    max_tokens: u64,
    idle_s: f64,
    aborted: &dyn Fn() -> bool,
) -> StepOutcome {
    let fail = |e: &anyhow::Error, message: String| {
        StepOutcome::Failed(wire::WorkerError {
            job_id: plan.job_id.clone(),
            generation: plan.generation,
            step: plan.step,
            kind: error_kind(e) as i32,
            message,
            peer_rank: blamed_peer(e),
        })
    };
    let norms = plan.normalizers.unwrap_or_default();
    let mut sums = wire::MetricSums {
        idle_s,
        microbatches: plan.microbatches.len() as u32,
        ..Default::default()
    };
    let mut docs = BTreeSet::new();
    let compute = Instant::now();
    for (i, mb) in plan.microbatches.iter().enumerate() {
        if aborted() {
            exec.zero_grad();
            return StepOutcome::Aborted;
        }
        if mb.token_ids.is_empty() && !exec.collective_per_microbatch() {
            continue;
        }
        match exec.microbatch(i, mb, &norms) {
            Ok(o) => {
                for (k, v) in &o.extra {
                    *sums.extra.entry(k.clone()).or_insert(0.0) += v;
                }
                sums.loss_sum += o.loss_sum;
                sums.loss_tokens += o.loss_tokens;
                sums.tokens += o.tokens;
                sums.model_flops += exec.model_flops(mb, o.loss_tokens);
                if o.tokens > 0 {
                    sums.padding_tokens += max_tokens.saturating_sub(o.tokens);
                }
                docs.extend(mb.sequences.iter().map(|s| s.doc_id.as_str()));
            }
            Err(e) => {
                exec.zero_grad();
                return fail(
                    &e,
                    format!(
                        "step {}, microbatch {i} of {}: {e:#}",
                        plan.step,
                        plan.microbatches.len()
                    ),
                );
            }
        }
    }
    sums.documents = docs.len() as u64;
    sums.compute_s = compute.elapsed().as_secs_f64();
    if aborted() {
        exec.zero_grad();
        return StepOutcome::Aborted;
    }
    let opt = Instant::now();
    match exec.optimizer_step(plan.lr) {
        Ok(norm) => sums.grad_norm = norm,
        Err(e) => {
            exec.zero_grad();
            return fail(&e, format!("step {}, optimizer step: {e:#}", plan.step));
        }
    }
    sums.optimizer_s = opt.elapsed().as_secs_f64();
    StepOutcome::Done(sums)
}

/// COLLECTIVE_TIMEOUT for a failed collective, NON_FINITE when the error
/// says a value was not finite (the trainer's guards say "non-finite"),
/// else INTERNAL.
pub fn error_kind(e: &anyhow::Error) -> wire::ErrorKind {
    if collective_error(e).is_some() {
        return wire::ErrorKind::CollectiveTimeout;
    }
    let text = format!("{e:#}").to_lowercase();
    if text.contains("non-finite") || text.contains("not finite") {
        wire::ErrorKind::NonFinite
    } else {
        wire::ErrorKind::Internal
    }
}

fn collective_error(e: &anyhow::Error) -> Option<&CollectiveError> {
    e.chain().find_map(|c| c.downcast_ref::<CollectiveError>())
}

/// The peer a failed collective blames (the WorkerError's `peer_rank`).
pub fn blamed_peer(e: &anyhow::Error) -> Option<u32> {
    collective_error(e)?.peer().map(|p| p as u32)
}

/// `data.max_tokens` of the spec (the coordinator's default when absent).
pub fn spec_max_tokens(spec_toml: &str) -> u64 {
    toml::from_str::<toml::Value>(spec_toml)
        .ok()
        .and_then(|v| v.get("data")?.get("max_tokens")?.as_integer())
        .map_or(4096, |n| n.max(0) as u64)
}

/// The runner thread's handle: queue work, flag aborts, join on shutdown.
pub struct Runner {
    queue: Option<mpsc::Sender<Work>>,
    /// (generation, step) of the last aborted step.
    aborted: Arc<Mutex<Option<(u64, u64)>>>,
    progress: Arc<Progress>,
    /// Work queued or running.
    pending: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
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
        let progress = Arc::new(Progress::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let left = pending.clone();
        let (a, p) = (aborted.clone(), progress.clone());
        // The executor is built and lives on the thread: libtorch state
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
                    progress: p,
                    job: None,
                    last_done: Instant::now(),
                };
                while let Ok(w) = rx.recv() {
                    state.handle(w);
                    // After the answer is sent: zero means all answers are out.
                    left.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .expect("spawning the runner thread");
        Runner {
            queue: Some(queue),
            aborted,
            progress,
            pending,
            thread: Some(thread),
        }
    }

    /// Queues work. An abort also takes effect at once, between the current
    /// step's microbatches.
    pub fn submit(&self, work: Work) {
        if let Work::Abort(a) = &work {
            *self.aborted.lock().unwrap_or_else(|p| p.into_inner()) = Some((a.generation, a.step));
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
    /// Last step whose update the executor holds.
    step: u64,
    max_tokens: u64,
    name: String,
    exec: Box<dyn StepExecutor>,
}

struct Thread {
    factory: Factory,
    connector: Connector,
    listener: Option<TcpListener>,
    out: UnboundedSender<wire::WorkerMessage>,
    aborted: Arc<Mutex<Option<(u64, u64)>>>,
    progress: Arc<Progress>,
    job: Option<Held>,
    last_done: Instant,
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
                info!(job = %a.job_id, step = a.step, reason = %a.reason, "step aborted");
            }
        }
    }

    fn configure(&mut self, c: wire::Configure) {
        // A replica of this job already at the configured step is kept
        // (a new generation or a reconnect); anything else is rebuilt.
        let (rank, world) = (c.rank as usize, c.world_size.max(1) as usize);
        let keep = self
            .job
            .as_ref()
            .is_some_and(|h| h.job == c.job_id && h.step == c.step && h.exec.fits(rank, world));
        if !keep {
            // Frees the old replica (and its collective) before joining.
            self.job = None;
        }
        let checked = match self.connect(&c) {
            Err(e) => Err(e),
            Ok(coll) => match self.job.as_mut() {
                Some(h) => h.exec.set_collective(coll).map_err(|e| {
                    let msg = format!("configure: joining generation {}: {e:#}", c.generation);
                    (wire::ErrorKind::InvalidPlan, msg, None)
                }),
                None => self.build(&c, coll).map(|h| self.job = Some(h)),
            },
        };
        if let Err((kind, msg, peer)) = checked {
            return self.error_blaming(&c.job_id, c.generation, c.step, kind, msg, peer);
        }
        let h = self.job.as_mut().expect("configured above");
        h.generation = c.generation;
        h.rank = c.rank;
        h.world_size = c.world_size;
        h.exec.zero_grad();
        self.progress
            .generation
            .store(c.generation, Ordering::Relaxed);
        self.progress.step.store(c.step, Ordering::Relaxed);
        self.last_done = Instant::now();
        info!(job = %c.job_id, generation = c.generation, rank = c.rank, step = c.step, kept = keep, "configured");
        self.send(Msg::Ready(wire::Ready {
            job_id: c.job_id,
            generation: c.generation,
            step: c.step,
        }));
    }

    /// This rank's collective for the generation `c` describes.
    fn connect(&self, c: &wire::Configure) -> Result<Box<dyn Collective>, ConfigureError> {
        if c.world_size <= 1 {
            return Ok(Box::new(Solo));
        }
        let failed = |e: CollectiveError| {
            let msg = format!(
                "configure: joining the collective of generation {} as rank {} of {}: {e}",
                c.generation, c.rank, c.world_size
            );
            let peer = e.peer().map(|p| p as u32);
            (wire::ErrorKind::CollectiveTimeout, msg, peer)
        };
        let listener = self.listener.as_ref().ok_or_else(|| {
            failed(CollectiveError::Setup(
                "this worker has no collective listener".into(),
            ))
        })?;
        let coll = (self.connector)(listener, c).map_err(failed)?;
        if (coll.rank(), coll.world_size()) != (c.rank as usize, c.world_size as usize) {
            let msg = format!(
                "configure: the collective says rank {} of {}, the coordinator rank {} of {}",
                coll.rank(),
                coll.world_size(),
                c.rank,
                c.world_size
            );
            return Err((wire::ErrorKind::Internal, msg, None));
        }
        Ok(coll)
    }

    /// A fresh replica for `c`: the spec parsed, the model built or restored.
    fn build(
        &self,
        c: &wire::Configure,
        coll: Box<dyn Collective>,
    ) -> Result<Held, ConfigureError> {
        let cfg = JobConfig::from_toml(&c.spec_toml).map_err(|e| {
            let msg = format!("configure: the job spec does not parse: {e}");
            (wire::ErrorKind::InvalidPlan, msg, None)
        })?;
        let restore = (!c.restore_from.is_empty()).then(|| PathBuf::from(&c.restore_from));
        if let Some(dir) = &restore {
            check_restore_step(dir, c.step)?;
        }
        let exec = (self.factory)(&cfg, restore.as_deref(), coll).map_err(|e| {
            let from = restore
                .as_ref()
                .map_or("the model's init".into(), |p| p.display().to_string());
            let msg = format!("configure: building the model from {from}: {e:#}");
            (wire::ErrorKind::Internal, msg, None)
        })?;
        Ok(Held {
            job: c.job_id.clone(),
            generation: c.generation,
            rank: c.rank,
            world_size: c.world_size,
            step: c.step,
            max_tokens: spec_max_tokens(&c.spec_toml),
            name: cfg.job.name.clone(),
            exec,
        })
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
            let result = reference::run_reference(h.exec.as_mut(), p);
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
        let aborted = self.aborted.clone();
        let is_aborted = move || *aborted.lock().unwrap_or_else(|e| e.into_inner()) == Some(key);
        let idle_s = self.last_done.elapsed().as_secs_f64();
        let outcome = run_step(h.exec.as_mut(), p, h.max_tokens, idle_s, &is_aborted);
        self.last_done = Instant::now();
        match outcome {
            StepOutcome::Done(sums) => {
                h.step = p.step;
                self.progress.step.store(p.step, Ordering::Relaxed);
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
            StepOutcome::Aborted => info!(step = p.step, "step aborted mid-way"),
        }
    }

    fn checkpoint(&mut self, c: &wire::CheckpointRequest) {
        let Some(h) = self.job.as_mut().filter(|h| h.job == c.job_id) else {
            let msg = format!(
                "checkpoint of step {}: job {} is not configured here",
                c.step, c.job_id
            );
            return self.error(&c.job_id, 0, c.step, wire::ErrorKind::InvalidPlan, msg);
        };
        let dir = PathBuf::from(&c.dir);
        let rank = h.rank;
        // Every rank writes its part in parallel; rank 0 adds the manifest
        // once all parts are written (write_checkpoint).
        {
            let manifest = Manifest {
                job: c.job_id.clone(),
                name: h.name.clone(),
                step: c.step,
                cursor: c
                    .cursor
                    .as_ref()
                    .map_or_else(Default::default, |k| ManifestCursor {
                        epoch: k.epoch,
                        position: k.position,
                        overflow: k.overflow.clone(),
                    }),
                world_size: h.world_size,
                generation: h.generation,
            };
            if let Err(e) = write_checkpoint(h.exec.as_mut(), h.rank, &dir, &manifest) {
                let msg = format!("checkpoint of step {} to {}: {e:#}", c.step, dir.display());
                let (job, generation) = (h.job.clone(), h.generation);
                let (kind, peer) = (error_kind(&e), blamed_peer(&e));
                return self.error_blaming(&job, generation, c.step, kind, msg, peer);
            }
            info!(step = c.step, rank = h.rank, dir = %dir.display(), "checkpoint written");
        }
        self.send(Msg::CheckpointDone(wire::CheckpointDone {
            job_id: c.job_id.clone(),
            step: c.step,
            rank,
            path: c.dir.clone(),
        }));
    }
}

/// A replica restored from `dir` must hold the step it is configured at:
/// training on from an older checkpoint while reporting a newer step would
/// silently diverge from the other ranks.
fn check_restore_step(dir: &Path, step: u64) -> Result<(), ConfigureError> {
    let path = dir.join("manifest.json");
    let Ok(bytes) = std::fs::read(&path) else {
        return Ok(()); // a plain HF directory: no step of ours to compare
    };
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
        let msg = format!("configure: {}: {e}", path.display());
        (wire::ErrorKind::InvalidPlan, msg, None)
    })?;
    if m.step != step {
        let msg = format!(
            "configure: {} holds step {}, but this replica is configured at step {step}; \
             refusing to train from mismatched state",
            dir.display(),
            m.step
        );
        return Err((wire::ErrorKind::InvalidPlan, msg, None));
    }
    Ok(())
}

/// The executor's files (every rank, in parallel), then, on rank 0 once
/// every rank's files are written, `manifest.json` (to a temporary name and
/// renamed, so a reader never sees half of it: its presence means the
/// checkpoint is complete).
pub fn write_checkpoint(
    exec: &mut dyn StepExecutor,
    rank: u32,
    dir: &Path,
    manifest: &Manifest,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    exec.save_checkpoint(dir)?;
    if rank != 0 {
        return Ok(());
    }
    let tmp = dir.join("manifest.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(manifest)?)?;
    std::fs::rename(&tmp, dir.join("manifest.json"))?;
    Ok(())
}

/// A configure failure: kind, message, blamed peer.
type ConfigureError = (wire::ErrorKind, String, Option<u32>);

mod publish;
mod reference;

#[cfg(test)]
mod tests;
