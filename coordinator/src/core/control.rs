//! Operator controls: cancel, pause/resume at a step boundary, drain a
//! worker, trigger a checkpoint, change step settings (docs/tokens per
//! step, `max_tokens`, learning rate) from the next new step on. Each
//! refuses (and changes nothing) when the job or worker is unknown, the
//! input is invalid, or the job is in a state where the action makes no
//! sense.

use super::jobs::{Generation, Job, JobState};
use super::machine::{bad_state, enter_paused, publish_event, request_checkpoint, Coordinator};
use super::step::{self, PlanKind, PlannedStep};
use super::workers::WorkerState;
use super::{CoreError, Effect, Result, ToWorker};
use crate::manifest::{self, JobUpdate, StepManifest};
use crate::spec::StepSize;

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

    /// Drains a worker (an operator's DrainWorker, or the worker's own
    /// Leave on SIGTERM): an idle one is released now; one in a job (being
    /// configured, training, or in a paused job) leaves at the job's next
    /// step boundary, which is now when no step is in flight. Asking again
    /// is harmless: nothing is sent twice, except a Release to a drained
    /// worker that has since reconnected (its first one may be lost).
    pub(super) fn drain(&mut self, worker: &str, now_ms: i64, fx: &mut Vec<Effect>) -> Result<()> {
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
            if self
                .jobs
                .get(&job)
                .is_some_and(|j| j.inflight.is_none() && !j.regroup_after_checkpoint)
            {
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

    /// Validates `update` against the job's spec and data and records it,
    /// effective from the job's next new step: the in-flight step, or an
    /// aborted one waiting to be re-planned, keeps its settings and so its
    /// documents.
    pub(super) fn update_job(
        &mut self,
        job_id: &str,
        update: JobUpdate,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) -> Result<()> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| CoreError::JobNotFound(job_id.into()))?;
        if job.rec.state.is_terminal() {
            return Err(bad_state(job_id, job.rec.state, "update"));
        }
        let problems = manifest::validate_update(&job.spec, &job.docs, &update);
        if !problems.is_empty() {
            return Err(CoreError::InvalidUpdate {
                job: job_id.into(),
                problems,
            });
        }
        let from = job.next_new_step();
        manifest::push_change(&mut job.rec.changes, from, update, now_ms);
        if update.docs_per_step.is_some() || update.tokens_per_step.is_some() {
            job.rec.total_steps = job.estimated_total_steps(from);
        }
        tracing::info!(job = job_id, from_step = from, change = %update.describe(), "step settings changed");
        fx.push(Effect::PersistJob(job.rec.clone()));
        let msg = format!("from step {from}: {}", update.describe());
        publish_event(fx, job, "config", msg, now_ms);
        Ok(())
    }
}

impl Job {
    /// The first step a change made now applies to.
    pub fn next_new_step(&self) -> u64 {
        self.rec.step.max(self.attempts.0) + 1
    }

    /// With operator changes in effect, the plan's learning rate follows
    /// the changed base over the job's (re-estimated) schedule length.
    pub(super) fn with_schedule_lr(&self, mut p: PlannedStep) -> PlannedStep {
        if p.kind == PlanKind::Train && !self.rec.changes.is_empty() {
            let spec = manifest::spec_at(&self.spec, &self.rec.changes, p.step);
            p.lr = spec.optimizer.lr_at(p.step, self.rec.total_steps);
        }
        p
    }

    /// Counts a dispatch of a training step (a re-dispatch after an abort
    /// is another attempt of the same step).
    pub(super) fn note_dispatch(&mut self, p: &PlannedStep) {
        if p.kind != PlanKind::Train {
            return;
        }
        self.attempts = match self.attempts {
            (s, n) if s == p.step => (s, n + 1),
            _ => (p.step, 1),
        };
    }

    /// The manifest of `planned`, committing in generation `generation`.
    pub(super) fn manifest_of(&self, planned: &PlannedStep, generation: u64) -> StepManifest {
        let settings = manifest::settings_at(&self.spec, &self.rec.changes, planned.step);
        let attempts = if self.attempts.0 == planned.step {
            self.attempts.1
        } else {
            1
        };
        StepManifest::of(planned, generation, settings, attempts, false)
    }

    /// Total steps when the settings change from step `from` on: the steps
    /// before it plus what the rest of the stream needs at the new size.
    /// Unchanged for `job.steps` jobs and when unknown (0).
    fn estimated_total_steps(&self, from: u64) -> u64 {
        if self.spec.job.steps.is_some() || self.rec.total_steps == 0 {
            return self.rec.total_steps;
        }
        let cursor = match &self.inflight {
            Some(f) if f.planned.kind == PlanKind::Train && f.planned.step + 1 == from => {
                &f.planned.cursor_after
            }
            _ => &self.rec.cursor,
        };
        let spec = manifest::spec_at(&self.spec, &self.rec.changes, from);
        let order = step::order_of(&spec, self.stream_len());
        let units = order.candidates(cursor).map(|c| c.index as usize);
        let (remaining, per_step) = match spec.step_size() {
            StepSize::Docs(n) => {
                let rem: u64 = match &self.rollouts {
                    Some(r) => units.map(|u| r.units[u].len() as u64).sum(),
                    None => units.count() as u64,
                };
                (rem, n)
            }
            StepSize::Tokens(t) => {
                let tokens = |i: usize| self.docs[i].tokens();
                let rem: u64 = match &self.rollouts {
                    Some(r) => units
                        .flat_map(|u| r.units[u].iter())
                        .map(|&d| tokens(d as usize))
                        .sum(),
                    None => units.map(tokens).sum(),
                };
                (rem, t)
            }
            StepSize::MicrobatchesPerRank(_) => return self.rec.total_steps,
        };
        (from - 1) + remaining.div_ceil(per_step.max(1))
    }
}
