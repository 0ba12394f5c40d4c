//! Weights out (`rl.publish_every = n`, issue 5): after every committed
//! step N with N % n == 0, every rank of the generation writes the policy
//! as Hugging Face safetensors into `OUTPUT_DIR/policy/step-N/`; once all
//! of them have answered, the watch stream announces it (kind "policy"),
//! so an external generator can reload. Publishing never holds up
//! training: the next step is planned at once, and the workers write the
//! policy before they take it (their work queue is ordered).

use std::collections::BTreeSet;
use std::path::PathBuf;

use tracing::info;

use super::jobs::Job;
use super::machine::{publish_event, Coordinator};
use super::{Effect, ToWorker};

/// `OUTPUT_DIR/policy/step-N`.
pub fn policy_dir(job: &Job, step: u64) -> PathBuf {
    job.spec
        .job
        .output_dir
        .join("policy")
        .join(format!("step-{step}"))
}

/// After a commit: asks every member to publish when the step is due.
pub(super) fn request_if_due(job: &mut Job, fx: &mut Vec<Effect>) {
    let Some(every) = job.spec.rl.publish_every.filter(|&n| n > 0) else {
        return;
    };
    let step = job.rec.step;
    let Some(gen) = job.gen.as_ref().filter(|_| step.is_multiple_of(every)) else {
        return;
    };
    let dir = policy_dir(job, step);
    for m in &gen.members {
        fx.push(Effect::Send {
            worker: m.clone(),
            msg: ToWorker::PublishPolicy {
                job: job.rec.id.clone(),
                step,
                dir: dir.clone(),
            },
        });
    }
    job.publish_acks
        .insert(step, gen.members.iter().cloned().collect::<BTreeSet<_>>());
}

impl Coordinator {
    /// A worker wrote its part of step `step`'s policy; the last one
    /// announces it on the watch stream.
    pub(super) fn on_policy_published(
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
        let Some(waiting) = job.publish_acks.get_mut(&step) else {
            return;
        };
        waiting.remove(worker);
        if !waiting.is_empty() {
            return;
        }
        job.publish_acks.remove(&step);
        let dir = policy_dir(job, step);
        info!(job = job_id, step, dir = %dir.display(), "policy published");
        publish_event(
            fx,
            job,
            "policy",
            format!("policy of step {step} published to {}", dir.display()),
            now_ms,
        );
    }
}
