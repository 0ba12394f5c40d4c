//! The runner thread's state and its work loop: it owns the trainer,
//! takes [`Work`] in order and answers with ready-made `WorkerMessage`s.
//! Configure, checkpoint and publish are implemented beside this file.

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use super::fault;
use super::probe;
use super::reference;
use super::step::{plan_error, run_step, StepOutcome};
use super::weight_server::{Cmd, WeightServer};
use super::work::{Connector, Factory, Progress, Work};
use super::writer::Writer;
use crate::collective::{AbortHandle, Collective};
use crate::train::Trainer;
use crate::wire;
use crate::wire::worker_message::Msg;

/// The in-flight step's abort target: (generation, step) being run and the
/// handle of its generation's collective.
#[derive(Default)]
pub(super) struct InFlight {
    pub(super) running: Option<PlanKey>,
    /// (generation, handle) of the current collective.
    pub(super) collective: Option<(u64, AbortHandle)>,
}

/// Which plan: steps and generations restart at 1 for every job, so a
/// plan is only named by all three (a worker kept across jobs must not
/// take an old job's abort for a new job's step).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PlanKey {
    pub(super) job: String,
    pub(super) generation: u64,
    pub(super) step: u64,
}

impl PlanKey {
    pub(super) fn of(p: &wire::StepPlan) -> PlanKey {
        PlanKey {
            job: p.job_id.clone(),
            generation: p.generation,
            step: p.step,
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The job the thread holds a replica of.
pub(super) struct Held {
    pub(super) job: String,
    pub(super) generation: u64,
    pub(super) rank: u32,
    pub(super) world_size: u32,
    /// Train-step results go to rank 0 over the collective, which sends
    /// them all (`Configure.gather_results`).
    pub(super) gather_results: bool,
    /// Last step whose update the trainer holds.
    pub(super) step: u64,
    pub(super) name: String,
    pub(super) exec: Box<dyn Trainer>,
}

impl Held {
    /// This replica as `RegisterRequest.held` reports it.
    pub(super) fn held_state(&self) -> wire::HeldState {
        wire::HeldState {
            job_id: self.job.clone(),
            step: self.step,
            world_size: self.world_size,
            rank: self.rank,
            generation: self.generation,
        }
    }
}

pub(super) struct Thread {
    pub(super) factory: Factory,
    pub(super) connector: Connector,
    pub(super) listener: Option<TcpListener>,
    /// Where trainers are built (`--device`).
    pub(super) device: tch::Device,
    pub(super) out: UnboundedSender<wire::WorkerMessage>,
    pub(super) aborted: Arc<Mutex<Option<PlanKey>>>,
    pub(super) in_flight: Arc<Mutex<InFlight>>,
    pub(super) progress: Arc<Progress>,
    pub(super) job: Option<Held>,
    pub(super) last_done: Instant,
    /// The background checkpoint writer (one write at a time).
    pub(super) writer: Writer,
    /// ReplicatedTrainer rank 0 of a disaggregated generation: its weight server
    /// (`super::weights`), and the server's inbox as the runner's handle
    /// sees it (`SyncWeights` skips the work queue).
    pub(super) weights: Option<WeightServer>,
    pub(super) weight_tx: Arc<Mutex<Option<mpsc::Sender<Cmd>>>>,
    /// The weight ring joined at configure, until the server takes it.
    pub(super) weight_ring: Option<Box<dyn Collective>>,
}

impl Thread {
    /// Joins the ring `c` describes (a training ring, or a weight ring's
    /// synthetic configure) on this worker's listener.
    pub(super) fn join_ring(
        &self,
        c: &wire::Configure,
    ) -> Result<Box<dyn Collective>, crate::collective::CollectiveError> {
        let listener = self.listener.as_ref().ok_or_else(|| {
            crate::collective::CollectiveError::Setup(
                "this worker has no collective listener".into(),
            )
        })?;
        (self.connector)(listener, c)
    }

    pub(super) fn send(&self, msg: Msg) {
        let _ = self.out.send(wire::WorkerMessage { msg: Some(msg) });
    }

    pub(super) fn error(
        &self,
        job: &str,
        generation: u64,
        step: u64,
        kind: wire::ErrorKind,
        message: String,
        peer_rank: Option<u32>,
    ) {
        let peer = peer_rank.map(Peer::Rank);
        self.error_blaming(job, generation, step, kind, message, peer);
    }

    /// [`Self::error`] naming a peer of either ring.
    pub(super) fn error_blaming(
        &self,
        job: &str,
        generation: u64,
        step: u64,
        kind: wire::ErrorKind,
        message: String,
        peer: Option<Peer>,
    ) {
        warn!(job, step, %message, ?peer, "worker error");
        let (peer_rank, weight_ring) = match peer {
            None => (None, false),
            Some(Peer::Rank(r)) => (Some(r), false),
            Some(Peer::WeightRing(r)) => (Some(r), true),
        };
        self.send(Msg::Error(wire::WorkerError {
            job_id: job.into(),
            generation,
            step,
            kind: kind as i32,
            message,
            peer_rank,
            weight_ring,
        }));
    }

    /// The thread is about to die: the job it holds fails with `why`
    /// (the coordinator prints it) rather than waiting on a silent worker.
    pub(super) fn fatal(&mut self, why: &str) {
        let held = self
            .job
            .take()
            .map(|h| (h.job.clone(), h.generation, h.step));
        self.progress.set_held(None);
        if let Some((job, generation, step)) = held {
            self.error(
                &job,
                generation,
                step,
                wire::ErrorKind::Internal,
                why.to_string(),
                None,
            );
        }
    }

    pub(super) fn handle(&mut self, work: Work) {
        match work {
            Work::Configure(c) => self.configure(*c),
            Work::Plan(p) => self.plan(&p),
            Work::Checkpoint(c) => self.checkpoint(&c),
            Work::Publish(p) if p.target() == wire::PolicyTarget::Generators => {
                self.publish_for_generators(&p)
            }
            Work::Publish(p) => self.publish(&p),
            Work::Generate(g) => self.generate(&g),
            Work::Sync(s) => self.sync_weights(&s),
            Work::Abort(a) => {
                if let Some(h) = &mut self.job {
                    h.exec.zero_grad();
                }
                info!(job = %a.job_id, step = a.step, reason = ?a.reason(), detail = %a.detail, "step aborted");
            }
        }
    }

    /// The replica of `job`, or `None` after reporting that `what` (of
    /// `step`) came for a job not configured here.
    pub(super) fn replica(&mut self, job: &str, step: u64, what: &str) -> Option<&mut Held> {
        if self.job.as_ref().is_none_or(|h| h.job != job) {
            let msg = format!("{what} of step {step}: job {job} is not configured here");
            self.error(job, 0, step, wire::ErrorKind::InvalidPlan, msg, None);
            return None;
        }
        self.job.as_mut()
    }

    /// Sends plan `p`'s result.
    fn result(&self, p: &wire::StepPlan, sums: wire::MetricSums, logps: Vec<wire::SequenceLogp>) {
        let mut r = result_of(p, sums);
        r.logps = logps;
        self.send(Msg::StepResult(r));
    }

    /// Runs probe plan `p` (the coordinator bisecting a non-finite step)
    /// and answers with the microbatches that were non-finite.
    fn probe(&mut self, p: &wire::StepPlan) {
        let Some(h) = self.job.as_mut().filter(|h| h.job == p.job_id) else {
            return;
        };
        let key = PlanKey::of(p);
        lock(&self.in_flight).running = Some(key.clone());
        let aborted = self.aborted.clone();
        let is_aborted = move || lock(&aborted).as_ref() == Some(&key);
        let result = guarded(p, || probe::run_probe(h.exec.as_mut(), p, &is_aborted));
        lock(&self.in_flight).running = None;
        self.last_done = Instant::now();
        match result {
            Ok(Some((sums, nonfinite))) => {
                info!(
                    step = p.step,
                    microbatches = p.microbatches.len(),
                    ?nonfinite,
                    "probe done"
                );
                let mut r = result_of(p, sums);
                r.nonfinite_microbatches = nonfinite;
                self.send(Msg::StepResult(r));
            }
            Ok(None) => info!(step = p.step, "probe aborted"),
            Err(e) => {
                warn!(step = p.step, message = %e.message, "probe failed");
                self.send(Msg::Error(e));
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
                None,
            );
        };
        if p.kind == wire::PlanKind::Probe as i32 {
            return self.probe(p);
        }
        let eval = p.kind == wire::PlanKind::Eval as i32;
        if p.kind == wire::PlanKind::Reference as i32 || eval {
            let result = guarded(p, || match eval {
                true => reference::run_eval(h.exec.as_mut(), p),
                false => reference::run_reference(h.exec.as_mut(), p),
            });
            self.last_done = Instant::now();
            match result {
                Ok((sums, logps)) => {
                    info!(
                        chunk = p.step,
                        sequences = logps.len(),
                        "reference chunk done"
                    );
                    self.result(p, sums, logps);
                }
                Err(e) => {
                    warn!(chunk = p.step, message = %e.message, "reference chunk failed");
                    self.send(Msg::Error(e));
                }
            }
            return;
        }
        let key = PlanKey::of(p);
        if p.replay {
            info!(
                step = p.step,
                generation = p.generation,
                "replaying a committed step"
            );
        }
        // A worker stopped "before step N" has finished writing its earlier
        // checkpoints (a stop mid-write is `in_checkpoint_write`): the fault
        // tests then corrupt or restore those, whatever the machine's load.
        if fault::armed(fault::Point::BeforeStep, p.step, p.rank) {
            self.writer.wait();
        }
        fault::point(fault::Point::BeforeStep, p.step, p.rank);
        // Set before the abort flag is polled: an abort arriving from now
        // on also interrupts the step's collective.
        lock(&self.in_flight).running = Some(key.clone());
        let aborted = self.aborted.clone();
        let is_aborted = move || lock(&aborted).as_ref() == Some(&key);
        let idle_s = self.last_done.elapsed().as_secs_f64();
        let outcome = guarded(p, || Ok(run_step(h.exec.as_mut(), p, idle_s, &is_aborted)))
            .unwrap_or_else(StepOutcome::Failed);
        self.last_done = Instant::now();
        let outcome = match outcome {
            StepOutcome::Done(sums) => {
                h.step = p.step;
                self.progress.step.store(p.step, Ordering::Relaxed);
                self.progress.set_held(Some(h.held_state()));
                info!(
                    step = p.step,
                    loss = sums.loss_sum / sums.loss_tokens.max(1) as f64,
                    "step done"
                );
                let mine = result_of(p, sums);
                if h.gather_results && h.world_size > 1 {
                    // Still `running`: an abort interrupts the gather too.
                    let gathered = guarded(p, || gather(h.exec.group(), p, mine, &is_aborted));
                    match gathered {
                        Ok(Some(all)) if p.rank == 0 => Gathered::All(all),
                        Ok(Some(_)) => Gathered::Sent,
                        Ok(None) => Gathered::AbortedGathering,
                        Err(e) => Gathered::Failed(e),
                    }
                } else {
                    Gathered::Own(Box::new(mine))
                }
            }
            StepOutcome::Failed(e) => Gathered::Failed(e),
            StepOutcome::Aborted => Gathered::Aborted,
        };
        lock(&self.in_flight).running = None;
        match outcome {
            Gathered::Own(r) => self.send(Msg::StepResult(*r)),
            Gathered::All(results) => self.send(Msg::StepResults(wire::StepResults {
                job_id: p.job_id.clone(),
                generation: p.generation,
                step: p.step,
                results,
            })),
            Gathered::Sent => {}
            Gathered::AbortedGathering => info!(
                step = p.step,
                "step aborted while its results were gathered: its update is applied and held"
            ),
            Gathered::Failed(e) => {
                warn!(step = p.step, message = %e.message, "step failed");
                self.send(Msg::Error(e));
            }
            Gathered::Aborted => info!(
                step = p.step,
                replay = p.replay,
                "step aborted mid-way: gradients dropped, parameters untouched"
            ),
        }
    }
}

/// This rank's result of plan `p`.
fn result_of(p: &wire::StepPlan, sums: wire::MetricSums) -> wire::StepResult {
    wire::StepResult {
        job_id: p.job_id.clone(),
        generation: p.generation,
        step: p.step,
        rank: p.rank,
        sums: Some(sums),
        logps: Vec::new(),
        nonfinite_microbatches: Vec::new(),
    }
}

/// Where a train step's answer goes.
enum Gathered {
    /// This rank sends its own result (not gathering, or world size 1).
    Own(Box<wire::StepResult>),
    /// Rank 0 gathered every rank's result: it sends them all.
    All(Vec<wire::StepResult>),
    /// Gathered by rank 0, which sends it: nothing to send here.
    Sent,
    Failed(wire::WorkerError),
    Aborted,
    /// Aborted after the update, while the results were gathered.
    AbortedGathering,
}

/// Gathers every rank's result of train plan `p` over the generation's
/// collective (after the update, so rank 0 holds them only once every rank
/// has applied it): Some(all, in rank order) on success, None when the
/// step was aborted meanwhile. A failed gather fails the step as a failed
/// collective does (its kind and blamed peer kept).
fn gather(
    coll: &mut dyn Collective,
    p: &wire::StepPlan,
    mine: wire::StepResult,
    aborted: &dyn Fn() -> bool,
) -> Result<Option<Vec<wire::StepResult>>, wire::WorkerError> {
    use prost::Message;
    let fail = |e: anyhow::Error| {
        plan_error(
            p,
            &e,
            format!("step {}, gathering the results: {e:#}", p.step),
        )
    };
    let all = match crate::collective::bytes::all_gather_bytes(coll, &mine.encode_to_vec()) {
        Ok(all) => all,
        Err(_) if aborted() => return Ok(None),
        Err(e) => return Err(fail(e.into())),
    };
    let results = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            wire::StepResult::decode(b.as_slice())
                .map_err(|e| fail(anyhow::anyhow!("rank {r}'s result does not decode: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(results))
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
        Err(plan_error(p, &e, format!("step {}: {e:#}", p.step)))
    })
}

/// A configure failure: kind, message, blamed peer.
pub(super) type ConfigureError = (wire::ErrorKind, String, Option<Peer>);

/// The peer a worker error blames: a rank of the generation's training
/// ring, or of its weight ring (trainer rank 0, then the generators).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Rank(u32),
    WeightRing(u32),
}
