//! The coordinator state machine: [`Coordinator::handle`] applies one
//! event and returns the effects to carry out. A job's events run on its
//! [`JobCtx`] (built once per event); then `schedule` forms generations for
//! waiting jobs and dispatches steps to ready generations, and the
//! messages of relayed generations are routed through their hubs.

use std::collections::BTreeMap;

use super::ctx::JobCtx;
use super::effects::Effects;
use super::error::{CoreError, Result};
use super::events::Event;
use super::events::{Restored, Submission};
use super::job::Job;
use super::options::CoordinatorOptions;
use super::phase::Work;
use super::types::{AbortReason, JobId, Why, WorkerId};
use super::workers::{Worker, WorkerState, Workers};

/// All jobs and workers, and the rules that move them.
#[derive(Debug, Default)]
pub struct Coordinator {
    pub(crate) opts: CoordinatorOptions,
    pub(crate) jobs: BTreeMap<JobId, Job>,
    /// Submission order, for FIFO scheduling.
    pub(crate) job_order: Vec<JobId>,
    pub(crate) workers: Workers,
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

    /// How late heartbeats are read now (see `liveness`).
    pub fn heartbeat_backlog_ms(&self) -> i64 {
        self.workers.liveness.backlog_ms()
    }

    /// Workers in registration order.
    pub fn workers(&self) -> impl Iterator<Item = &Worker> {
        self.workers.in_order()
    }

    pub fn worker(&self, id: &str) -> Option<&Worker> {
        self.workers.get(id)
    }

    /// A worker's rank among the generators of its job's generation
    /// (disaggregated RL), if it is one.
    pub fn generator_rank(&self, w: &Worker) -> Option<u32> {
        let job = self.jobs.get(w.job.as_deref()?)?;
        job.gen()?.generators.rank_of(&w.id)
    }

    /// The id a registering worker that held `previous` gets back: that
    /// one when no live registration holds it (unknown here, or lost),
    /// else none (it takes a fresh id). A registration not yet followed by
    /// its session holds its id too: two processes claiming one id (a
    /// worker restarted twice, a duplicated pod) must not share a record.
    /// Decided and applied under one lock (the shell's), with
    /// [`Event::RegisterWorker`].
    pub fn reusable_id(&self, previous: &str) -> Option<WorkerId> {
        let taken = self
            .workers
            .get(previous)
            .is_some_and(|w| w.state != WorkerState::Lost);
        (!previous.is_empty() && !taken).then(|| previous.to_string())
    }

    /// The context of job `id` for one event, if the job is known.
    pub(crate) fn ctx<'a>(
        &'a mut self,
        id: &str,
        now: i64,
        fx: &'a mut Effects,
    ) -> Option<JobCtx<'a>> {
        let job = self.jobs.get_mut(id)?;
        Some(JobCtx {
            id: id.to_string(),
            job,
            workers: &mut self.workers,
            opts: &self.opts,
            now,
            fx,
        })
    }

    /// Applies one event. Admin errors leave the state unchanged.
    pub fn handle(&mut self, event: Event, now_ms: i64) -> Result<Effects> {
        let mut fx = Effects::default();
        let scheduling = self.apply(event, now_ms, &mut fx)?;
        // The checkpoints the workers lost in this event still owed will
        // never complete, whichever job asked (before anything is asked
        // again).
        for w in self.workers.take_lost() {
            for j in self.jobs.values_mut() {
                j.acks.checkpoints.drop_owed_by(&w);
            }
        }
        if scheduling {
            self.schedule(now_ms, &mut fx);
        }
        let jobs = &self.jobs;
        let current = |job: &str| jobs.get(job)?.active().map(|a| a.gen.id);
        super::routing::route(fx.then_mut(), &self.workers, current);
        Ok(fx)
    }

    /// Applies `event`; false when it can change nothing a schedule acts on.
    fn apply(&mut self, event: Event, now: i64, fx: &mut Effects) -> Result<bool> {
        match event {
            Event::RegisterWorker { id, reg } => {
                if self.reusable_id(&id).is_none() {
                    return Err(CoreError::WorkerIdInUse(id));
                }
                self.workers.register(id, reg, now);
            }
            Event::SessionOpened { worker } => {
                let heard = self.workers.liveness.heard(now, None);
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.state = WorkerState::Idle;
                    w.heard = heard;
                    w.job = None;
                    w.rank = None;
                    if w.draining {
                        // Drained before it was lost: released now (it
                        // never got its release, or it may have been lost).
                        w.state = WorkerState::Draining;
                        tracing::info!(worker, "a drained worker came back: released");
                        fx.push(super::effects::Effect::Send {
                            worker: worker.clone(),
                            msg: super::effects::ToWorker::Release {
                                job: String::new(),
                                reason: "drained".into(),
                            },
                        });
                    }
                }
            }
            Event::SessionClosed { worker } => {
                let why = Why::new(
                    AbortReason::WorkerLost,
                    format!("worker {worker} lost: session closed"),
                );
                self.lose_worker(&worker, why, now, fx);
            }
            // Liveness only: it can make no job formable or dispatchable,
            // so nothing to schedule (issue 19: composing a waiting job's
            // generation on each of 4096 workers' heartbeats starved them).
            Event::Heartbeat { worker, lag_ms } => {
                self.workers.heard_from(&worker, now, lag_ms);
                return Ok(false);
            }
            Event::Heartbeats { beats } => {
                for b in beats {
                    self.workers
                        .heard_from(&b.worker, b.at_ms.min(now), b.lag_ms);
                }
                return Ok(false);
            }
            Event::Tick { stalled_ms } => {
                let timeout = self.opts.heartbeat_timeout_ms;
                self.workers.liveness.tick(now, stalled_ms, timeout);
                self.tick(now, fx);
            }
            Event::DrainWorker { worker } => self.drain(&worker, now, fx)?,
            Event::SubmitJob {
                id,
                spec,
                spec_toml,
                docs,
                start,
            } => {
                let s = Submission {
                    id,
                    spec,
                    spec_toml,
                    docs,
                    start,
                };
                self.submit(s, now, fx)?;
            }
            Event::RestoreJob {
                rec,
                spec,
                docs,
                reference,
                history,
            } => {
                let r = Restored {
                    rec: *rec,
                    spec,
                    docs,
                    reference,
                    history,
                };
                self.restore(r, now);
            }
            // Changes nothing a schedule could act on.
            Event::PlanAhead { job } => {
                if let Some(mut cx) = self.ctx(&job, now, fx) {
                    cx.plan_ahead();
                }
                return Ok(false);
            }
            Event::PersistFailed { jobs, error } => {
                for job in jobs {
                    if let Some(mut cx) = self.ctx(&job, now, fx) {
                        cx.persist_failed(&error);
                    }
                }
            }
            e => self.apply_to_job(e, now, fx)?,
        }
        Ok(true)
    }

    /// Applies an event about one job on its context: a worker's message
    /// (the worker is heard from first), an admin request, the shell's
    /// answer to an effect.
    fn apply_to_job(&mut self, event: Event, now: i64, fx: &mut Effects) -> Result<()> {
        if let Some(w) = event.from_worker() {
            self.workers.heard_from(w, now, None);
        }
        let Some(id) = event.job().map(str::to_string) else {
            return Ok(());
        };
        let Some(mut cx) = self.ctx(&id, now, fx) else {
            // A worker's message about a job this coordinator does not
            // know is dropped; an admin request is answered.
            return match event.is_request() {
                true => Err(CoreError::JobNotFound(id)),
                false => Ok(()),
            };
        };
        cx.apply(event)
    }

    /// Forms generations for waiting jobs (FIFO) and dispatches the next step
    /// of every ready, running job.
    fn schedule(&mut self, now: i64, fx: &mut Effects) {
        for id in self.job_order.clone() {
            if let Some(mut cx) = self.ctx(&id, now, fx) {
                cx.schedule();
            }
        }
    }

    /// Drains a worker (an operator's DrainWorker, or the worker's own
    /// Leave on SIGTERM): an idle one is released now; one in a job (being
    /// configured, training, or in a paused job) leaves at the job's next
    /// step boundary, which is now when no step is in flight. Asking again
    /// is harmless: nothing is sent twice, except a Release to a drained
    /// worker that has since reconnected (its first one may be lost).
    fn drain(&mut self, worker: &str, now: i64, fx: &mut Effects) -> Result<()> {
        let w = self
            .workers
            .get_mut(worker)
            .ok_or_else(|| CoreError::WorkerNotFound(worker.into()))?;
        let released = w.draining && w.state == WorkerState::Draining;
        w.draining = true;
        if w.job.is_none() && w.connected() {
            if released {
                return Ok(());
            }
            // Nothing to finish: it can go now.
            tracing::info!(worker, "draining an idle worker: released");
            w.state = WorkerState::Draining;
            fx.push(super::effects::Effect::Send {
                worker: worker.to_string(),
                msg: super::effects::ToWorker::Release {
                    job: String::new(),
                    reason: "drained".into(),
                },
            });
        } else if let Some(job) = w.job.clone() {
            w.state = WorkerState::Draining;
            tracing::info!(worker, job = %job, "draining: the worker leaves at the step boundary");
            if let Some(mut cx) = self.ctx(&job, now, fx) {
                // With no step in flight the boundary is now (unless the
                // drain's checkpoint is already being written).
                let at_boundary = cx
                    .job
                    .active()
                    .is_some_and(|a| matches!(a.work, Work::Idle));
                if at_boundary {
                    cx.regroup();
                }
            }
        }
        Ok(())
    }

    /// Loses silent workers, and members silent on a plan or a round past
    /// its deadline.
    fn tick(&mut self, now_ms: i64, fx: &mut Effects) {
        for w in self.workers.silent(now_ms, self.opts.heartbeat_timeout_ms) {
            let why = Why::new(
                AbortReason::WorkerLost,
                format!("worker {w} lost: missed heartbeats"),
            );
            self.lose_worker(&w, why, now_ms, fx);
        }
        // Members alive but silent on a plan past its deadline (a hung
        // trainer thread still heartbeats) are lost as well.
        let mut overdue = Vec::new();
        for job in self.jobs.values() {
            let (Some(deadline), Some(a), Some(f)) =
                (job.step_deadline_ms(), job.active(), job.inflight())
            else {
                continue;
            };
            if now_ms <= deadline {
                continue;
            }
            let waited_s = (now_ms - f.started_ms) as f64 / 1000.0;
            for (rank, m) in a.gen.members.iter().enumerate() {
                if !f.results.contains_key(&(rank as u32)) {
                    let detail = format!(
                        "worker {m} (rank {rank}) gave no result for step {} in {waited_s:.0} s (the step deadline)",
                        f.planned.step
                    );
                    overdue.push((m.clone(), detail));
                }
            }
        }
        // The same for a generation round (a hung sampler).
        for job in self.jobs.values() {
            let (Some(deadline), Some((r, workers))) = (job.round_deadline_ms(), job.round_on())
            else {
                continue;
            };
            if now_ms <= deadline {
                continue;
            }
            let waited_s = (now_ms - r.started_ms) as f64 / 1000.0;
            for (rank, m) in workers.iter().enumerate() {
                if !r.answers.contains_key(&(rank as u32)) {
                    let detail = format!(
                        "worker {m} (rank {rank}) gave no completions for generation round {} in {waited_s:.0} s (the step deadline)",
                        r.id
                    );
                    overdue.push((m.clone(), detail));
                }
            }
        }
        for (w, detail) in overdue {
            let why = Why::new(AbortReason::StepDeadline, detail);
            self.lose_worker(&w, why, now_ms, fx);
        }
    }
    /// A worker is gone: its session ends and, when it was in a job, that
    /// job's generation ends (its step in flight is aborted and re-planned
    /// from the same cursor).
    pub(crate) fn lose_worker(&mut self, worker: &str, why: Why, now: i64, fx: &mut Effects) {
        let Some(Some(job)) = self.workers.lose(worker, &why, fx) else {
            return;
        };
        if let Some(mut cx) = self.ctx(&job, now, fx) {
            cx.end_generation(why, false);
        }
    }
}
