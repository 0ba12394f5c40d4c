//! Operator controls: cancel, pause/resume at a step boundary, drain a
//! worker, trigger a checkpoint, change step settings (docs/tokens per
//! step, `max_tokens`, learning rate) from the next new step on. Each
//! refuses (and changes nothing) when the job or worker is unknown, the
//! input is invalid, or the job is in a state where the action makes no
//! sense.

use super::effects::{Effect, Effects, Persist, ToWorker};
use super::error::{CoreError, Result};
use super::jobs::{Job, Phase, Work};
use super::machine::Coordinator;
use super::planner;
use super::types::{End, EventKind, JobState};
use super::workers::WorkerState;
use crate::job::settings::{record_change, JobUpdate, UpdateContext};

impl Coordinator {
    pub(crate) fn cancel(&mut self, job_id: &str, now_ms: i64, fx: &mut Effects) -> Result<()> {
        let state = self.job(job_id)?.rec.state;
        if state.is_terminal() {
            return Err(CoreError::bad_state(job_id, state, "cancel"));
        }
        self.finish(job_id, End::Cancelled, now_ms, fx);
        Ok(())
    }

    pub(crate) fn pause(&mut self, job_id: &str, now_ms: i64, fx: &mut Effects) -> Result<()> {
        let job = self.job_mut(job_id)?;
        match job.rec.state {
            JobState::Running if job.inflight().is_some() => job.requests.pause = true,
            JobState::Running | JobState::Pending => job.pause_now(now_ms, fx),
            JobState::Paused => {}
            s => return Err(CoreError::bad_state(job_id, s, "pause")),
        }
        Ok(())
    }

    pub(crate) fn resume(&mut self, job_id: &str, now_ms: i64, fx: &mut Effects) -> Result<()> {
        let job = self.job_mut(job_id)?;
        match job.rec.state {
            JobState::Paused => {
                let formed = job.gen().is_some();
                job.rec.state = if formed {
                    JobState::Running
                } else {
                    JobState::Pending
                };
                job.rec.reason = if formed {
                    String::new()
                } else {
                    "waiting for workers".into()
                };
                fx.persist(Persist::Job(Box::new(job.rec.clone())));
                let msg = format!("resumed at step {}", job.rec.step);
                fx.push(job.event(EventKind::State, msg, now_ms));
            }
            JobState::Running | JobState::Pending => job.requests.pause = false,
            s => return Err(CoreError::bad_state(job_id, s, "resume")),
        }
        Ok(())
    }

    /// Drains a worker (an operator's DrainWorker, or the worker's own
    /// Leave on SIGTERM): an idle one is released now; one in a job (being
    /// configured, training, or in a paused job) leaves at the job's next
    /// step boundary, which is now when no step is in flight. Asking again
    /// is harmless: nothing is sent twice, except a Release to a drained
    /// worker that has since reconnected (its first one may be lost).
    pub(crate) fn drain(&mut self, worker: &str, now_ms: i64, fx: &mut Effects) -> Result<()> {
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
            fx.push(Effect::Send {
                worker: worker.to_string(),
                msg: ToWorker::Release {
                    job: String::new(),
                    reason: "drained".into(),
                },
            });
        } else if let Some(job) = w.job.clone() {
            w.state = WorkerState::Draining;
            tracing::info!(worker, job = %job, "draining: the worker leaves at the step boundary");
            // With no step in flight the boundary is now (unless the
            // drain's checkpoint is already being written).
            let at_boundary = self
                .jobs
                .get(&job)
                .and_then(Job::active)
                .is_some_and(|a| matches!(a.work, Work::Idle));
            if at_boundary {
                self.regroup(&job, now_ms, fx);
            }
        }
        Ok(())
    }

    pub(crate) fn trigger_checkpoint(&mut self, job_id: &str, fx: &mut Effects) -> Result<()> {
        let job = self.job_mut(job_id)?;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(job_id, job.rec.state, "checkpoint"));
        }
        let idle_gen = job
            .active()
            .is_some_and(|a| a.gen.all_ready() && !matches!(a.work, Work::InFlight(_)));
        if idle_gen {
            job.request_checkpoint(fx);
        } else {
            job.requests.checkpoint = true;
        }
        Ok(())
    }

    /// Validates `update` against the job's settings and data and records
    /// it, effective from the job's next new step: the in-flight step, or
    /// an aborted one waiting to be re-planned, keeps its settings and so
    /// its documents.
    pub(crate) fn update_job(
        &mut self,
        job_id: &str,
        update: JobUpdate,
        now_ms: i64,
        fx: &mut Effects,
    ) -> Result<()> {
        let job = self.job_mut(job_id)?;
        if job.rec.state.is_terminal() || matches!(job.phase, Phase::Ended) {
            return Err(CoreError::bad_state(job_id, job.rec.state, "update"));
        }
        let problems = job.settings().check(&update, &update_context(job));
        if !problems.is_empty() {
            return Err(CoreError::InvalidUpdate {
                job: job_id.into(),
                problems,
            });
        }
        let from = job.next_new_step();
        record_change(&mut job.rec.changes, from, update.clone(), now_ms);
        if update.docs_per_step.is_some() || update.tokens_per_step.is_some() {
            job.rec.total_steps = planner::estimated_total_steps(job, from);
        }
        tracing::info!(job = job_id, from_step = from, change = %update.describe(), "step settings changed");
        fx.persist(Persist::Job(Box::new(job.rec.clone())));
        let msg = format!("from step {from}: {}", update.describe());
        fx.push(job.event(EventKind::Config, msg, now_ms));
        Ok(())
    }
}

/// What an update of `job` is checked against: its longest document (the
/// dataset's, or a streamed job's queued rollouts) and its queue.
fn update_context(job: &Job) -> UpdateContext {
    let queued = job.data.stream.iter().flat_map(|s| s.groups().flatten());
    let longest = job
        .data
        .docs
        .iter()
        .chain(queued)
        .max_by_key(|d| d.tokens())
        .map(|d| (d.id, d.tokens()));
    let files = job.data.stream.is_none();
    UpdateContext {
        longest,
        stream: job.data.stream.as_ref().map(|s| (s.capacity, s.group_size)),
        dataset: files.then(|| crate::job::limits::DatasetSize {
            docs: job.data.docs.len() as u64,
            tokens: job.data.docs.iter().map(|d| d.tokens()).sum(),
        }),
    }
}
