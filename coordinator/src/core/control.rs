//! Operator controls: cancel, pause/resume at a step boundary, drain a
//! worker, trigger a checkpoint, change step settings (docs/tokens per
//! step, `max_tokens`, learning rate) from the next new step on. Each
//! refuses (and changes nothing) when the job or worker is unknown, the
//! input is invalid, or the job is in a state where the action makes no
//! sense.

use super::ctx::JobCtx;
use super::effects::Persist;
use super::error::{CoreError, Result};
use super::job::Job;
use super::phase::{Phase, Work};
use super::planner;
use super::types::{End, EventKind, JobState};
use crate::job::settings::{record_change, JobUpdate, UpdateContext};

impl JobCtx<'_> {
    pub(crate) fn cancel(&mut self) -> Result<()> {
        let state = self.job.rec.state;
        if state.is_terminal() {
            return Err(CoreError::bad_state(&self.id, state, "cancel"));
        }
        self.finish(End::Cancelled);
        Ok(())
    }

    pub(crate) fn pause(&mut self) -> Result<()> {
        match self.job.rec.state {
            JobState::Running if self.job.inflight().is_some() => self.job.requests.pause = true,
            JobState::Running | JobState::Pending => self.pause_now(),
            JobState::Paused => {}
            s => return Err(CoreError::bad_state(&self.id, s, "pause")),
        }
        Ok(())
    }

    /// Pauses the job at its current step boundary.
    pub(crate) fn pause_now(&mut self) {
        self.job.rec.state = JobState::Paused;
        self.job.rec.reason = "paused by operator".into();
        self.persist_job();
        let msg = format!("paused at step {}", self.job.rec.step);
        self.event(EventKind::State, msg);
    }

    pub(crate) fn resume(&mut self) -> Result<()> {
        let job = &mut *self.job;
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
                self.fx.persist(Persist::Job(Box::new(job.rec.clone())));
                let msg = format!("resumed at step {}", job.rec.step);
                self.fx.push(job.event(EventKind::State, msg, self.now));
            }
            JobState::Running | JobState::Pending => job.requests.pause = false,
            s => return Err(CoreError::bad_state(self.id.as_str(), s, "resume")),
        }
        Ok(())
    }

    pub(crate) fn trigger_checkpoint(&mut self) -> Result<()> {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(
                self.id.as_str(),
                job.rec.state,
                "checkpoint",
            ));
        }
        let idle_gen = job
            .active()
            .is_some_and(|a| a.gen.all_ready() && !matches!(a.work, Work::InFlight(_)));
        if idle_gen {
            job.request_checkpoint(self.fx);
        } else {
            job.requests.checkpoint = true;
        }
        Ok(())
    }

    /// Validates `update` against the job's settings and data and records
    /// it, effective from the job's next new step: the in-flight step, or
    /// an aborted one waiting to be re-planned, keeps its settings and so
    /// its documents.
    pub(crate) fn update_job(&mut self, update: JobUpdate) -> Result<()> {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() || matches!(job.phase, Phase::Ended) {
            return Err(CoreError::bad_state(
                self.id.as_str(),
                job.rec.state,
                "update",
            ));
        }
        let problems = job.settings().check(&update, &update_context(job));
        if !problems.is_empty() {
            return Err(CoreError::InvalidUpdate {
                job: self.id.as_str().into(),
                problems,
            });
        }
        let from = job.next_new_step();
        record_change(&mut job.rec.changes, from, update.clone(), self.now);
        if update.docs_per_step.is_some() || update.tokens_per_step.is_some() {
            job.rec.total_steps = planner::estimated_total_steps(job, from);
        }
        tracing::info!(job = %self.id, from_step = from, change = %update.describe(), "step settings changed");
        self.fx.persist(Persist::Job(Box::new(job.rec.clone())));
        let msg = format!("from step {from}: {}", update.describe());
        self.fx.push(job.event(EventKind::Config, msg, self.now));
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
        .map(|d| (d.id.to_string(), d.tokens()));
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
