//! The coordinator state machine. Each handler mutates state and returns the
//! effects to carry out; `schedule` then forms generations for waiting jobs
//! and dispatches steps to ready generations.

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{info, warn};

use super::jobs::{Generation, InFlight, Job, JobId, JobRecord, JobState};
use super::metrics::{self, StepFacts};
use super::step;
use super::workers::{Registration, Worker, WorkerId, WorkerState};
use super::{CoreError, Effect, Event, Result, ToWorker, WatchItem, WorkerErrorKind};

/// Tunables of the state machine.
#[derive(Debug, Clone)]
pub struct CoordinatorOptions {
    /// A worker silent for this long is declared lost.
    pub heartbeat_timeout_ms: i64,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        Self {
            heartbeat_timeout_ms: 2_000,
        }
    }
}

/// All jobs and workers, and the rules that move them.
#[derive(Debug, Default)]
pub struct Coordinator {
    opts: CoordinatorOptions,
    jobs: BTreeMap<JobId, Job>,
    /// Submission order, for FIFO scheduling.
    job_order: Vec<JobId>,
    workers: BTreeMap<WorkerId, Worker>,
    next_worker_seq: u64,
}

impl Coordinator {
    pub fn new(opts: CoordinatorOptions) -> Self {
        Self {
            opts,
            ..Default::default()
        }
    }

    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.job_order.iter().filter_map(|id| self.jobs.get(id))
    }

    pub fn job(&self, id: &str) -> Result<&Job> {
        self.jobs
            .get(id)
            .ok_or_else(|| CoreError::JobNotFound(id.to_string()))
    }

    pub fn workers(&self) -> impl Iterator<Item = &Worker> {
        let mut w: Vec<&Worker> = self.workers.values().collect();
        w.sort_by_key(|w| w.seq);
        w.into_iter()
    }

    pub fn worker(&self, id: &str) -> Option<&Worker> {
        self.workers.get(id)
    }

    /// Applies one event. Admin errors leave the state unchanged.
    pub fn handle(&mut self, event: Event, now_ms: i64) -> Result<Vec<Effect>> {
        let mut fx = Vec::new();
        match event {
            Event::RegisterWorker { id, reg } => self.register(id, reg, now_ms),
            Event::SessionOpened { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.state = WorkerState::Idle;
                    w.last_seen_ms = now_ms;
                    w.job = None;
                    w.rank = None;
                }
            }
            Event::SessionClosed { worker } => {
                self.lose_worker(&worker, "session closed", now_ms, &mut fx)
            }
            Event::Heartbeat { worker } => self.seen(&worker, now_ms),
            Event::Ready {
                worker,
                job,
                generation,
                step,
            } => {
                self.seen(&worker, now_ms);
                self.on_ready(&worker, &job, generation, step);
            }
            Event::StepResult {
                worker,
                job,
                generation,
                step,
                sums,
            } => {
                self.seen(&worker, now_ms);
                self.on_result(&worker, &job, generation, step, sums, now_ms, &mut fx);
            }
            Event::WorkerError {
                worker,
                job,
                generation,
                step,
                kind,
                message,
            } => {
                self.seen(&worker, now_ms);
                self.on_worker_error(
                    &worker, &job, generation, step, kind, message, now_ms, &mut fx,
                );
            }
            Event::CheckpointDone { worker, job, step } => {
                self.seen(&worker, now_ms);
                self.on_checkpoint_done(&worker, &job, step, now_ms, &mut fx);
            }
            Event::SubmitJob {
                id,
                spec,
                spec_toml,
                docs,
            } => {
                if self.jobs.contains_key(&id) {
                    return Err(CoreError::DuplicateJob(id));
                }
                let rec = JobRecord {
                    id: id.clone(),
                    name: spec.job.name.clone(),
                    spec_toml,
                    state: JobState::Pending,
                    reason: "waiting for workers".into(),
                    step: 0,
                    cursor: Default::default(),
                    generation: 0,
                    submitted_unix_ms: now_ms,
                    last_loss: None,
                    documents: docs.len() as u64,
                    total_steps: step::total_steps(&spec, &docs),
                    last_checkpoint: None,
                };
                info!(job = %id, name = %rec.name, docs = docs.len(), "job submitted");
                fx.push(Effect::PersistJob(rec.clone()));
                self.job_order.push(id.clone());
                self.jobs.insert(id, Job::new(rec, *spec, docs));
            }
            Event::RestoreJob { rec, spec, docs } => {
                let mut rec = *rec;
                if rec.state == JobState::Running {
                    // No generation survives a restart; workers re-join.
                    rec.state = JobState::Pending;
                    rec.reason = "coordinator restarted; waiting for workers".into();
                }
                let id = rec.id.clone();
                self.job_order.push(id.clone());
                self.jobs.insert(id, Job::new(rec, *spec, docs));
            }
            Event::CancelJob { job } => self.cancel(&job, now_ms, &mut fx)?,
            Event::PauseJob { job } => self.pause(&job, now_ms, &mut fx)?,
            Event::ResumeJob { job } => self.resume(&job, now_ms, &mut fx)?,
            Event::DrainWorker { worker } => self.drain(&worker, now_ms, &mut fx)?,
            Event::TriggerCheckpoint { job } => self.trigger_checkpoint(&job, &mut fx)?,
            Event::Tick => self.tick(now_ms, &mut fx),
        }
        self.schedule(now_ms, &mut fx);
        Ok(fx)
    }

    /// The step at whose boundary a triggered checkpoint lands.
    pub fn checkpoint_step(&self, job: &str) -> Result<u64> {
        let j = self.job(job)?;
        Ok(j.inflight.as_ref().map_or(j.rec.step, |f| f.planned.step))
    }

    fn register(&mut self, id: WorkerId, reg: Registration, now_ms: i64) {
        self.next_worker_seq += 1;
        info!(worker = %id, host = %reg.hostname, device = %reg.device, "worker registered");
        self.workers.insert(
            id.clone(),
            Worker {
                id,
                reg,
                state: WorkerState::Registered,
                last_seen_ms: now_ms,
                job: None,
                rank: None,
                draining: false,
                seq: self.next_worker_seq,
            },
        );
    }

    fn seen(&mut self, worker: &str, now_ms: i64) {
        if let Some(w) = self.workers.get_mut(worker) {
            if w.state != WorkerState::Lost {
                w.last_seen_ms = now_ms;
            }
        }
    }

    fn tick(&mut self, now_ms: i64, fx: &mut Vec<Effect>) {
        let timeout = self.opts.heartbeat_timeout_ms;
        let silent: Vec<WorkerId> = self
            .workers
            .values()
            .filter(|w| w.connected() && now_ms - w.last_seen_ms > timeout)
            .map(|w| w.id.clone())
            .collect();
        for w in silent {
            self.lose_worker(&w, "missed heartbeats", now_ms, fx);
        }
    }

    /// A worker is gone: its generation's in-flight step is aborted and the
    /// job waits for a new generation, re-planning from the same cursor.
    fn lose_worker(&mut self, worker: &str, why: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let Some(w) = self.workers.get_mut(worker) else {
            return;
        };
        if w.state == WorkerState::Lost {
            return;
        }
        warn!(worker, reason = why, "worker lost");
        w.state = WorkerState::Lost;
        let job = w.job.take();
        w.rank = None;
        if let Some(job) = job {
            self.dissolve_generation(&job, &format!("worker {worker} lost: {why}"), now_ms, fx);
        }
    }

    /// Ends a job's generation: aborts its in-flight step (the cursor has not
    /// moved, so the same documents are re-planned) and frees its members.
    fn dissolve_generation(
        &mut self,
        job_id: &str,
        reason: &str,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some(gen) = job.gen.take() else { return };
        let aborted = job.inflight.take().map(|f| f.planned.step);
        for m in &gen.members {
            if let Some(w) = self.workers.get_mut(m) {
                if w.state == WorkerState::Lost {
                    continue;
                }
                if let Some(step) = aborted {
                    fx.push(Effect::Send {
                        worker: m.clone(),
                        msg: ToWorker::Abort {
                            job: job_id.to_string(),
                            generation: gen.id,
                            step,
                            reason: reason.to_string(),
                        },
                    });
                }
                w.job = None;
                w.rank = None;
                w.state = if w.draining {
                    WorkerState::Draining
                } else {
                    WorkerState::Idle
                };
            }
        }
        if !job.rec.state.is_terminal() && job.rec.state != JobState::Paused {
            job.rec.state = JobState::Pending;
            job.rec.reason = reason.to_string();
        }
        fx.push(Effect::PersistJob(job.rec.clone()));
        let message = match aborted {
            Some(step) => format!("generation {} ended, step {step} aborted: {reason}", gen.id),
            None => format!("generation {} ended: {reason}", gen.id),
        };
        publish_event(fx, job, "generation", message, now_ms);
    }

    fn on_ready(&mut self, worker: &str, job_id: &str, generation: u64, _step: u64) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some(gen) = job.gen.as_mut().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = job_id,
                generation,
                "ready from a stale generation, ignored"
            );
            return;
        };
        if let Some(rank) = gen.rank_of(worker) {
            gen.ready[rank as usize] = true;
            if let Some(w) = self.workers.get_mut(worker) {
                w.state = if w.draining {
                    WorkerState::Draining
                } else {
                    WorkerState::Active
                };
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_result(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        sums: super::MetricSums,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let (Some(gen), Some(flight)) = (job.gen.as_ref(), job.inflight.as_mut()) else {
            return;
        };
        if gen.id != generation || flight.planned.step != step {
            warn!(
                worker,
                job = job_id,
                generation,
                step,
                "result for a stale step, ignored"
            );
            return;
        }
        let Some(rank) = gen.rank_of(worker) else {
            return;
        };
        flight.results.insert(rank, sums);
        if flight.results.len() == gen.members.len() {
            self.commit(job_id, now_ms, fx);
        }
    }

    /// Every rank reported: the step commits, the cursor moves.
    fn commit(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        let flight = job.inflight.take().expect("committing an in-flight step");
        let gen = job.gen.clone().expect("committing within a generation");
        let planned = &flight.planned;
        let ranks: Vec<_> = flight.results.into_values().collect();
        let facts = StepFacts {
            step: planned.step,
            lr: planned.lr,
            world_size: gen.world_size(),
            generation: gen.id,
            microbatches: planned.microbatches(),
            step_time_s: (now_ms - flight.started_ms).max(0) as f64 / 1000.0,
            unix_ms: now_ms,
        };
        let m = metrics::aggregate(facts, planned.cursor_after.clone(), &ranks);
        job.rec.step = planned.step;
        job.rec.cursor = planned.cursor_after.clone();
        job.rec.last_loss = Some(m.loss);
        info!(
            job = job_id,
            step = m.step,
            loss = m.loss,
            tokens = m.tokens,
            "step committed"
        );
        fx.push(Effect::CommitStep {
            rec: Box::new(job.rec.clone()),
            metrics: Box::new(m.clone()),
            docs: planned.docs.clone(),
        });
        fx.push(Effect::AppendMetrics {
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        fx.push(Effect::Publish {
            job: job_id.to_string(),
            item: WatchItem::Step(m),
        });

        let every = job.spec.checkpoint.every_steps;
        let finished = job.finished();
        let due = (every > 0 && job.rec.step.is_multiple_of(every))
            || job.checkpoint_requested
            || finished;
        if due {
            job.checkpoint_requested = false;
            request_checkpoint(job, fx);
        }
        if finished {
            self.finish(job_id, JobState::Completed, "all steps trained", now_ms, fx);
            return;
        }
        // Drained workers leave at this boundary, and joiners come in: both
        // form a new generation before the next step.
        let leaving = gen
            .members
            .iter()
            .any(|m| self.workers.get(m).is_some_and(|w| w.draining));
        let joining = self.workers.values().any(Worker::available)
            && gen.world_size() < job.spec.parallel.max_workers;
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.pause_requested {
            job.pause_requested = false;
            job.rec.state = JobState::Paused;
            job.rec.reason = "paused by operator".into();
            fx.push(Effect::PersistJob(job.rec.clone()));
            publish_event(
                fx,
                job,
                "state",
                format!("paused after step {}", job.rec.step),
                now_ms,
            );
        }
        if leaving || joining {
            self.release_drained(job_id, fx);
            self.dissolve_generation(job_id, "membership change at step boundary", now_ms, fx);
        }
    }

    /// Sends Release to the draining members of a job's generation.
    fn release_drained(&mut self, job_id: &str, fx: &mut Vec<Effect>) {
        let Some(gen) = self.jobs.get(job_id).and_then(|j| j.gen.clone()) else {
            return;
        };
        for m in gen.members {
            if let Some(w) = self.workers.get_mut(&m).filter(|w| w.draining) {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: job_id.to_string(),
                        reason: "drained".into(),
                    },
                });
                w.state = WorkerState::Draining;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_worker_error(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        let Some(gen) = job.gen.as_ref().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = job_id,
                generation,
                "error from a stale generation, ignored"
            );
            return;
        };
        match kind {
            WorkerErrorKind::CollectiveTimeout {
                peer_rank: Some(peer),
            } => {
                // The silent peer is the suspect, not the reporter.
                if let Some(peer_id) = gen.members.get(peer as usize).cloned() {
                    let why = format!("collective timeout reported by {worker}: {message}");
                    self.lose_worker(&peer_id, &why, now_ms, fx);
                }
            }
            WorkerErrorKind::CollectiveTimeout { peer_rank: None } => {
                let reason = format!("collective timeout at step {step} on {worker}: {message}");
                self.dissolve_generation(job_id, &reason, now_ms, fx);
            }
            WorkerErrorKind::NonFinite
            | WorkerErrorKind::InvalidPlan
            | WorkerErrorKind::Internal => {
                let reason = format!("step {step} failed on worker {worker}: {message}");
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
            }
        }
    }

    fn on_checkpoint_done(
        &mut self,
        worker: &str,
        job_id: &str,
        step: u64,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some((ck_step, acks)) = job.checkpoint_acks.as_mut().filter(|(s, _)| *s == step) else {
            return;
        };
        if let Some(a) = acks.get_mut(worker) {
            *a = true;
        }
        if acks.values().all(|&a| a) {
            let ck_step = *ck_step;
            job.checkpoint_acks = None;
            job.rec.last_checkpoint = Some(ck_step);
            fx.push(Effect::PersistJob(job.rec.clone()));
            publish_event(
                fx,
                job,
                "checkpoint",
                format!("checkpoint of step {ck_step} written"),
                now_ms,
            );
        }
    }

    fn finish(
        &mut self,
        job_id: &str,
        state: JobState,
        reason: &str,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if let (Some(gen), Some(flight)) = (&job.gen, &job.inflight) {
            for m in &gen.members {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Abort {
                        job: job_id.to_string(),
                        generation: gen.id,
                        step: flight.planned.step,
                        reason: reason.to_string(),
                    },
                });
            }
        }
        job.inflight = None;
        if let Some(gen) = job.gen.take() {
            for m in gen.members {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: job_id.to_string(),
                        reason: reason.to_string(),
                    },
                });
                if let Some(w) = self.workers.get_mut(&m) {
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
        job.rec.state = state;
        job.rec.reason = reason.to_string();
        info!(job = job_id, state = ?state, reason, "job finished");
        fx.push(Effect::PersistJob(job.rec.clone()));
        publish_event(fx, job, "state", reason.to_string(), now_ms);
    }

    fn cancel(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
        let state = self.job(job_id)?.rec.state;
        if state.is_terminal() {
            return Err(bad_state(job_id, state, "cancel"));
        }
        self.finish(
            job_id,
            JobState::Cancelled,
            "cancelled by operator",
            now_ms,
            fx,
        );
        Ok(())
    }

    fn pause(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| CoreError::JobNotFound(job_id.into()))?;
        match job.rec.state {
            JobState::Running if job.inflight.is_some() => job.pause_requested = true,
            JobState::Running | JobState::Pending => {
                job.rec.state = JobState::Paused;
                job.rec.reason = "paused by operator".into();
                fx.push(Effect::PersistJob(job.rec.clone()));
                publish_event(
                    fx,
                    job,
                    "state",
                    format!("paused at step {}", job.rec.step),
                    now_ms,
                );
            }
            JobState::Paused => {}
            s => return Err(bad_state(job_id, s, "pause")),
        }
        Ok(())
    }

    fn resume(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| CoreError::JobNotFound(job_id.into()))?;
        match job.rec.state {
            JobState::Paused => {
                job.rec.state = if job.gen.is_some() {
                    JobState::Running
                } else {
                    JobState::Pending
                };
                job.rec.reason = if job.gen.is_some() {
                    String::new()
                } else {
                    "waiting for workers".into()
                };
                fx.push(Effect::PersistJob(job.rec.clone()));
                publish_event(
                    fx,
                    job,
                    "state",
                    format!("resumed at step {}", job.rec.step),
                    now_ms,
                );
            }
            JobState::Running | JobState::Pending => job.pause_requested = false,
            s => return Err(bad_state(job_id, s, "resume")),
        }
        Ok(())
    }

    fn drain(&mut self, worker: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
        let w = self
            .workers
            .get_mut(worker)
            .ok_or_else(|| CoreError::WorkerNotFound(worker.into()))?;
        w.draining = true;
        if w.job.is_none() && w.connected() {
            // Nothing to finish: it can go now.
            w.state = WorkerState::Draining;
            fx.push(Effect::Send {
                worker: worker.to_string(),
                msg: ToWorker::Release {
                    job: String::new(),
                    reason: "drained".into(),
                },
            });
        } else if let Some(job) = w.job.clone() {
            w.state = WorkerState::Draining;
            // With no step in flight the boundary is now.
            if self.jobs.get(&job).is_some_and(|j| j.inflight.is_none()) {
                self.release_drained(&job, fx);
                self.dissolve_generation(&job, "worker drained", now_ms, fx);
            }
        }
        Ok(())
    }

    fn trigger_checkpoint(&mut self, job_id: &str, fx: &mut Vec<Effect>) -> Result<()> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| CoreError::JobNotFound(job_id.into()))?;
        if job.rec.state.is_terminal() {
            return Err(bad_state(job_id, job.rec.state, "checkpoint"));
        }
        let idle_gen =
            job.gen.as_ref().is_some_and(Generation::all_ready) && job.inflight.is_none();
        if idle_gen {
            request_checkpoint(job, fx);
        } else {
            job.checkpoint_requested = true;
        }
        Ok(())
    }

    /// Forms generations for waiting jobs (FIFO) and dispatches the next step
    /// of every ready, running job.
    fn schedule(&mut self, now_ms: i64, fx: &mut Vec<Effect>) {
        for id in self.job_order.clone() {
            let job = &self.jobs[&id];
            if job.rec.state == JobState::Pending && job.gen.is_none() {
                self.form_generation(&id, now_ms, fx);
            }
            let job = &self.jobs[&id];
            let ready = job.gen.as_ref().is_some_and(Generation::all_ready);
            if job.rec.state == JobState::Running && ready && job.inflight.is_none() {
                self.dispatch(&id, now_ms, fx);
            }
        }
    }

    fn form_generation(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = &self.jobs[job_id];
        let (min, max) = (job.spec.parallel.min_workers, job.spec.parallel.max_workers);
        let mut free: Vec<&Worker> = self.workers.values().filter(|w| w.available()).collect();
        free.sort_by_key(|w| w.seq);
        if (free.len() as u32) < min {
            let reason = format!(
                "waiting for workers: {} available, min_workers = {min}",
                free.len()
            );
            let job = self.jobs.get_mut(job_id).expect("known job");
            if job.rec.reason != reason {
                job.rec.reason = reason;
            }
            return;
        }
        let members: Vec<WorkerId> = free
            .iter()
            .take(max as usize)
            .map(|w| w.id.clone())
            .collect();
        let peers: Vec<(WorkerId, String)> = members
            .iter()
            .map(|m| (m.clone(), self.workers[m].reg.collective_addr.clone()))
            .collect();
        let job = self.jobs.get_mut(job_id).expect("known job");
        job.rec.generation += 1;
        job.rec.state = JobState::Running;
        job.rec.reason = String::new();
        let gen = Generation {
            id: job.rec.generation,
            members: members.clone(),
            ready: vec![false; members.len()],
        };
        let restore_from = job.rec.last_checkpoint.map(|s| {
            job.spec
                .job
                .output_dir
                .join("checkpoints")
                .join(format!("step-{s}"))
        });
        for (rank, m) in members.iter().enumerate() {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Configure {
                    job: job_id.to_string(),
                    generation: gen.id,
                    rank: rank as u32,
                    peers: peers.clone(),
                    spec_toml: job.rec.spec_toml.clone(),
                    step: job.rec.step,
                    restore_from: restore_from.clone(),
                },
            });
            let w = self.workers.get_mut(m).expect("member is registered");
            w.job = Some(job_id.to_string());
            w.rank = Some(rank as u32);
            w.state = WorkerState::Configuring;
        }
        info!(
            job = job_id,
            generation = gen.id,
            world_size = members.len(),
            "generation formed"
        );
        fx.push(Effect::PersistJob(job.rec.clone()));
        let msg = format!(
            "generation {} formed with {} workers",
            gen.id,
            members.len()
        );
        job.gen = Some(gen);
        publish_event(fx, job, "generation", msg, now_ms);
    }

    fn dispatch(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.finished() {
            self.finish(job_id, JobState::Completed, "all steps trained", now_ms, fx);
            return;
        }
        let gen = job.gen.as_ref().expect("dispatch within a generation");
        let next = job.rec.step + 1;
        let planned = match step::plan_step(
            &job.spec,
            &job.docs,
            &job.rec.cursor,
            next,
            gen.world_size(),
        ) {
            Ok(Some(p)) => Arc::new(p),
            Ok(None) => {
                self.finish(job_id, JobState::Completed, "data exhausted", now_ms, fx);
                return;
            }
            Err(e) => {
                let reason = format!("planning step {next} failed: {e}");
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
                return;
            }
        };
        for (rank, m) in gen.members.iter().enumerate() {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Plan {
                    job: job_id.to_string(),
                    generation: gen.id,
                    rank: rank as u32,
                    planned: planned.clone(),
                },
            });
        }
        job.inflight = Some(InFlight {
            planned,
            started_ms: now_ms,
            results: BTreeMap::new(),
        });
    }
}

fn request_checkpoint(job: &mut Job, fx: &mut Vec<Effect>) {
    let Some(gen) = job.gen.as_ref() else { return };
    let step = job.rec.step;
    let dir = job
        .spec
        .job
        .output_dir
        .join("checkpoints")
        .join(format!("step-{step}"));
    for m in &gen.members {
        fx.push(Effect::Send {
            worker: m.clone(),
            msg: ToWorker::Checkpoint {
                job: job.rec.id.clone(),
                step,
                dir: dir.clone(),
                cursor: job.rec.cursor.clone(),
            },
        });
    }
    job.checkpoint_acks = Some((
        step,
        gen.members.iter().map(|m| (m.clone(), false)).collect(),
    ));
}

fn publish_event(fx: &mut Vec<Effect>, job: &Job, kind: &str, message: String, now_ms: i64) {
    fx.push(Effect::Publish {
        job: job.rec.id.clone(),
        item: WatchItem::Event {
            kind: kind.to_string(),
            message,
            state: job.rec.state,
            unix_ms: now_ms,
        },
    });
}

fn bad_state(job: &str, state: JobState, action: &'static str) -> CoreError {
    CoreError::BadJobState {
        job: job.to_string(),
        state: format!("{state:?}").to_lowercase(),
        action,
    }
}
