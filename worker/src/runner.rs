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
//! A step's metrics are *sums* (DESIGN.md "The math"): Σ loss over loss
//! tokens, tokens, documents, padding, and the time split; the coordinator
//! forms the means after summing over ranks.

use std::collections::BTreeSet;
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

use crate::config::JobConfig;

/// What one microbatch's forward/backward reports (sums, not means).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MicrobatchOutcome {
    /// Σ per-token loss over the microbatch's loss tokens (unscaled).
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// Real tokens in the row.
    pub tokens: u64,
}

/// The training engine a [`Runner`] drives: one model replica with its
/// optimizer. Gradients accumulate across `microbatch` calls and are
/// consumed once by `optimizer_step`.
pub trait StepExecutor {
    /// Forward/backward of one non-empty microbatch, each loss token scaled
    /// by `1 / global_loss_tokens`; gradients accumulate.
    fn microbatch(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome>;
    /// Clip, step the optimizer at `lr`, zero the gradients; returns the
    /// global gradient norm before clipping. On a non-finite norm it fails
    /// and leaves the parameters untouched.
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<f64>;
    /// Drops the accumulated gradients (abort, failed step).
    fn zero_grad(&mut self);
    /// Writes `config.json`, `model.safetensors` and the optimizer state.
    fn save_checkpoint(&self, dir: &Path) -> anyhow::Result<()>;
    /// Training FLOPs of a microbatch run with `loss_tokens` targets (for
    /// MFU; `model::flops`). 0 when the executor cannot tell.
    fn model_flops(&self, _mb: &wire::Microbatch, _loss_tokens: u64) -> f64 {
        0.0
    }
}

/// Builds an executor for a job, restoring from a checkpoint directory if given.
pub type Factory =
    Arc<dyn Fn(&JobConfig, Option<&Path>) -> anyhow::Result<Box<dyn StepExecutor>> + Send + Sync>;

/// The libtorch trainer.
pub fn default_factory() -> Factory {
    crate::runner_trainer::factory()
}

/// Work for the runner thread, in arrival order.
#[derive(Debug)]
pub enum Work {
    Configure(Box<wire::Configure>),
    Plan(Box<wire::StepPlan>),
    Checkpoint(wire::CheckpointRequest),
    Abort(wire::Abort),
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
    let fail = |kind: wire::ErrorKind, message: String| {
        StepOutcome::Failed(wire::WorkerError {
            job_id: plan.job_id.clone(),
            generation: plan.generation,
            step: plan.step,
            kind: kind as i32,
            message,
            peer_rank: None,
        })
    };
    let global = plan.normalizers.as_ref().map_or(0, |n| n.loss_tokens);
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
        if mb.token_ids.is_empty() {
            continue;
        }
        match exec.microbatch(i, mb, global) {
            Ok(o) => {
                sums.loss_sum += o.loss_sum;
                sums.loss_tokens += o.loss_tokens;
                sums.tokens += o.tokens;
                sums.model_flops += exec.model_flops(mb, o.loss_tokens);
                sums.padding_tokens += max_tokens.saturating_sub(o.tokens);
                docs.extend(mb.sequences.iter().map(|s| s.doc_id.as_str()));
            }
            Err(e) => {
                exec.zero_grad();
                return fail(
                    error_kind(&e),
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
            return fail(
                error_kind(&e),
                format!("step {}, optimizer step: {e:#}", plan.step),
            );
        }
    }
    sums.optimizer_s = opt.elapsed().as_secs_f64();
    StepOutcome::Done(sums)
}

/// NON_FINITE when the error says a value was not finite (the trainer's
/// guards say "non-finite"), else INTERNAL.
pub fn error_kind(e: &anyhow::Error) -> wire::ErrorKind {
    let text = format!("{e:#}").to_lowercase();
    if text.contains("non-finite") || text.contains("not finite") {
        wire::ErrorKind::NonFinite
    } else {
        wire::ErrorKind::Internal
    }
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
    /// Starts the thread; its answers go to `out`.
    pub fn spawn(factory: Factory, out: UnboundedSender<wire::WorkerMessage>) -> Runner {
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
                    factory,
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
    exec: Box<dyn StepExecutor>,
}

struct Thread {
    factory: Factory,
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
        warn!(job, step, %message, "worker error");
        self.send(Msg::Error(wire::WorkerError {
            job_id: job.into(),
            generation,
            step,
            kind: kind as i32,
            message,
            peer_rank: None,
        }));
    }

    fn handle(&mut self, work: Work) {
        match work {
            Work::Configure(c) => self.configure(*c),
            Work::Plan(p) => self.plan(&p),
            Work::Checkpoint(c) => self.checkpoint(&c),
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
        let keep = self
            .job
            .as_ref()
            .is_some_and(|h| h.job == c.job_id && h.step == c.step);
        let checked = check_world_size(&c).and_then(|()| {
            if !keep {
                self.job = None;
                self.job = Some(self.build(&c)?);
            }
            Ok(())
        });
        if let Err((kind, msg)) = checked {
            return self.error(&c.job_id, c.generation, c.step, kind, msg);
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

    /// A fresh replica for `c`: the spec parsed, the model built or restored.
    fn build(&self, c: &wire::Configure) -> Result<Held, (wire::ErrorKind, String)> {
        let cfg = JobConfig::from_toml(&c.spec_toml).map_err(|e| {
            let msg = format!("configure: the job spec does not parse: {e}");
            (wire::ErrorKind::InvalidPlan, msg)
        })?;
        let restore = (!c.restore_from.is_empty()).then(|| PathBuf::from(&c.restore_from));
        let exec = (self.factory)(&cfg, restore.as_deref()).map_err(|e| {
            let from = restore
                .as_ref()
                .map_or("the model's init".into(), |p| p.display().to_string());
            let msg = format!("configure: building the model from {from}: {e:#}");
            (wire::ErrorKind::Internal, msg)
        })?;
        Ok(Held {
            job: c.job_id.clone(),
            generation: c.generation,
            rank: c.rank,
            world_size: c.world_size,
            step: c.step,
            max_tokens: spec_max_tokens(&c.spec_toml),
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
        let Some(h) = self.job.as_ref().filter(|h| h.job == c.job_id) else {
            let msg = format!(
                "checkpoint of step {}: job {} is not configured here",
                c.step, c.job_id
            );
            return self.error(&c.job_id, 0, c.step, wire::ErrorKind::InvalidPlan, msg);
        };
        let dir = PathBuf::from(&c.dir);
        // Single-replica checkpoints for now: rank 0 writes, the others ack.
        if h.rank == 0 {
            let manifest = Manifest {
                job: c.job_id.clone(),
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
            if let Err(e) = write_checkpoint(h.exec.as_ref(), &dir, &manifest) {
                let msg = format!("checkpoint of step {} to {}: {e:#}", c.step, dir.display());
                let (job, generation) = (h.job.clone(), h.generation);
                return self.error(&job, generation, c.step, wire::ErrorKind::Internal, msg);
            }
            info!(step = c.step, dir = %dir.display(), "checkpoint written");
        }
        self.send(Msg::CheckpointDone(wire::CheckpointDone {
            job_id: c.job_id.clone(),
            step: c.step,
            rank: h.rank,
            path: c.dir.clone(),
        }));
    }
}

/// The executor's files, then `manifest.json` (written to a temporary name
/// and renamed, so a reader never sees half of it).
pub fn write_checkpoint(
    exec: &dyn StepExecutor,
    dir: &Path,
    manifest: &Manifest,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    exec.save_checkpoint(dir)?;
    let tmp = dir.join("manifest.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(manifest)?)?;
    std::fs::rename(&tmp, dir.join("manifest.json"))?;
    Ok(())
}

/// Without a gradient all-reduce, ranks would train diverging replicas:
/// refuse rather than produce silently wrong math.
fn check_world_size(c: &wire::Configure) -> Result<(), (wire::ErrorKind, String)> {
    if c.world_size > 1 {
        let msg = format!(
            "configure: world size {} needs cross-rank gradient reduction, which this \
             worker does not have yet; run with parallel.max_workers = 1",
            c.world_size
        );
        return Err((wire::ErrorKind::InvalidPlan, msg));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
