//! Weights out (`rl.publish_every = n`, issue 5): after every committed
//! step N with N % n == 0, every rank of the generation writes the policy
//! as Hugging Face safetensors into `OUTPUT_DIR/policy/step-N/`; once all
//! of them have answered, the watch stream announces it (kind "policy"),
//! so an external generator can reload. Publishing never holds up
//! training: the next step is planned at once, and the workers write the
//! policy before they take it (their work queue is ordered).

use std::path::PathBuf;

use tracing::info;

use super::ctx::JobCtx;
use super::effects::{Effect, Effects, ToWorker};
use super::job::Job;
use super::types::EventKind;

/// `OUTPUT_DIR/policy/step-N`.
pub fn policy_dir(job: &Job, step: u64) -> PathBuf {
    job.spec
        .job
        .output_dir
        .join("policy")
        .join(format!("step-{step}"))
}

/// After a commit: asks every member to publish when the step is due
/// (`rl.publish_every`; with generator workers every `rl.sync_every()`).
pub(crate) fn request_if_due(job: &mut Job, fx: &mut Effects) {
    let every = match job.spec.rl.generators {
        Some(_) => Some(job.spec.rl.sync_every()),
        None => job.spec.rl.publish_every,
    };
    let Some(every) = every.filter(|&n| n > 0) else {
        return;
    };
    if job.rec.step.is_multiple_of(every) {
        request(job, fx);
    }
}

/// Asks every member to publish the committed step's policy now: to disk,
/// or, for a job's own generators, as a snapshot in memory that trainer
/// rank 0 broadcasts over the weight ring (never through disk).
pub(crate) fn request(job: &mut Job, fx: &mut Effects) {
    let step = job.rec.step;
    let Some((generation, members)) = job.gen().map(|g| (g.id, g.members.clone())) else {
        return;
    };
    let dir = job
        .spec
        .rl
        .generators
        .is_none()
        .then(|| policy_dir(job, step));
    // The coordinator owns the tokenizer: its files complete the folder.
    if let Some(dir) = &dir {
        fx.push(Effect::WriteTokenizer {
            job: job.rec.id.clone(),
            dir: dir.clone(),
            step: None,
        });
    }
    for m in &members {
        fx.push(Effect::Send {
            worker: m.clone(),
            msg: ToWorker::PublishPolicy {
                job: job.rec.id.clone(),
                step,
                dir: dir.clone(),
            },
        });
    }
    job.acks.policies.expect((generation, step), members);
}

impl JobCtx<'_> {
    /// A worker of generation `generation` wrote its part of step `step`'s
    /// policy; the last one announces it on the watch stream. Answers to
    /// another generation's request count for nothing: a generator told
    /// to load a snapshot the current trainer rank 0 has not taken would
    /// fail the job.
    pub(crate) fn on_policy_published(&mut self, worker: &str, generation: u64, step: u64) {
        let job = &mut *self.job;
        if !job.acks.policies.ack(&(generation, step), worker) {
            return;
        }
        if job.spec.rl.generators.is_some() {
            info!(
                job = %self.id,
                step, "policy snapshot taken for the generators"
            );
        } else {
            let dir = policy_dir(job, step);
            info!(job = %self.id, step, dir = %dir.display(), "policy published");
            let msg = format!("policy of step {step} published to {}", dir.display());
            self.fx.push(job.event(EventKind::Policy, msg, self.now));
        }
        // The job's engine loads it next (`crate::rl::engine`).
        if let Some(e) = job.data.engine_mut() {
            e.published = e.published.max(Some(step));
        }
    }
}
