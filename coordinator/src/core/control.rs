//! Operator controls: cancel, pause/resume at a step boundary, drain a
//! worker, trigger a checkpoint. Each refuses (and changes nothing) when the
//! job or worker is unknown or in a state where the action makes no sense.

use super::jobs::{Generation, JobState};
use super::machine::{bad_state, enter_paused, publish_event, request_checkpoint, Coordinator};
use super::workers::WorkerState;
use super::{CoreError, Effect, Result, ToWorker};

impl Coordinator {
    pub(super) fn cancel(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
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

    pub(super) fn pause(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| CoreError::JobNotFound(job_id.into()))?;
        match job.rec.state {
            JobState::Running if job.inflight.is_some() => job.pause_requested = true,
            JobState::Running | JobState::Pending => enter_paused(job, now_ms, fx),
            JobState::Paused => {}
            s => return Err(bad_state(job_id, s, "pause")),
        }
        Ok(())
    }

    pub(super) fn resume(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
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

    pub(super) fn drain(&mut self, worker: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
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
                self.regroup(&job, now_ms, fx);
            }
        }
        Ok(())
    }

    pub(super) fn trigger_checkpoint(&mut self, job_id: &str, fx: &mut Vec<Effect>) -> Result<()> {
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
}
