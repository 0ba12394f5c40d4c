//! Running one step plan ([`run_step`]) and classifying its failures
//! ([`error_kind`], [`blamed_peer`]): the part of the runner that is a
//! plain function of an executor and a plan, tested with fakes.

use std::collections::BTreeSet;
use std::time::Instant;

use super::{fault, wire, CollectiveError, StepExecutor};

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
/// microbatches. The plan's `max_tokens` (its step's budget per microbatch)
/// gives the padding a padded layout would have wasted; `idle_s` is the
/// time since the previous plan finished.
pub fn run_step(
    exec: &mut dyn StepExecutor,
    plan: &wire::StepPlan,
    idle_s: f64,
    aborted: &dyn Fn() -> bool,
) -> StepOutcome {
    let fail = |e: &anyhow::Error, message: String| {
        StepOutcome::Failed(wire::WorkerError {
            job_id: plan.job_id.clone(),
            generation: plan.generation,
            step: plan.step,
            kind: error_kind(e) as i32,
            message,
            peer_rank: blamed_peer(e),
        })
    };
    let Some(norms) = plan.normalizers else {
        return StepOutcome::Failed(wire::WorkerError {
            job_id: plan.job_id.clone(),
            generation: plan.generation,
            step: plan.step,
            kind: wire::ErrorKind::InvalidPlan as i32,
            message: format!("step {}: the plan carries no normalizers", plan.step),
            peer_rank: None,
        });
    };
    let max_tokens = u64::from(plan.max_tokens);
    let mut sums = wire::MetricSums {
        idle_s,
        microbatches: plan.microbatches.len() as u32,
        ..Default::default()
    };
    let mut docs = BTreeSet::new();
    // Collective time is measured apart and taken out of compute and
    // optimizer time, so the four phases add up to the step's wall time.
    let coll_start = crate::collective::timed::spent_s();
    let compute = Instant::now();
    for (i, mb) in plan.microbatches.iter().enumerate() {
        if aborted() {
            exec.zero_grad();
            return StepOutcome::Aborted;
        }
        if mb.token_ids.is_empty() && !exec.collective_per_microbatch() {
            continue;
        }
        let result = exec.microbatch(i, mb, &norms);
        if i == 0 {
            // Gradients of the first microbatch accumulated, step half done.
            fault::point(fault::Point::MidMicrobatch, plan.step, plan.rank);
        }
        match result {
            Ok(o) => {
                for (k, v) in &o.extra {
                    *sums.extra.entry(k.clone()).or_insert(0.0) += v;
                }
                sums.loss_sum += o.loss_sum;
                sums.loss_tokens += o.loss_tokens;
                sums.tokens += o.tokens;
                sums.model_flops += exec.model_flops(mb, o.loss_tokens);
                if o.tokens > 0 {
                    sums.padding_tokens += max_tokens.saturating_sub(o.tokens);
                }
                docs.extend(mb.sequences.iter().map(|s| s.doc_id.as_str()));
            }
            Err(_) if aborted() => {
                // The abort interrupted a collective: not a failure.
                exec.zero_grad();
                return StepOutcome::Aborted;
            }
            Err(e) => {
                exec.zero_grad();
                return fail(
                    &e,
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
    let coll_compute = crate::collective::timed::spent_s() - coll_start;
    sums.compute_s = (compute.elapsed().as_secs_f64() - coll_compute).max(0.0);
    if aborted() {
        exec.zero_grad();
        return StepOutcome::Aborted;
    }
    // Peers are (or will be) inside the gradient reduction.
    fault::point(fault::Point::InCollective, plan.step, plan.rank);
    let opt = Instant::now();
    match exec.optimizer_step(plan.lr) {
        Ok(norm) => sums.grad_norm = norm,
        Err(_) if aborted() => {
            exec.zero_grad();
            return StepOutcome::Aborted;
        }
        Err(e) => {
            exec.zero_grad();
            return fail(&e, format!("step {}, optimizer step: {e:#}", plan.step));
        }
    }
    let coll_total = crate::collective::timed::spent_s() - coll_start;
    sums.collective_s = coll_total;
    sums.optimizer_s = (opt.elapsed().as_secs_f64() - (coll_total - coll_compute)).max(0.0);
    crate::metrics::global().observe_step(plan, &sums);
    StepOutcome::Done(sums)
}

/// COLLECTIVE_TIMEOUT for a failed collective, NON_FINITE when the error
/// says a value was not finite (the trainer's guards say "non-finite"),
/// else INTERNAL.
pub fn error_kind(e: &anyhow::Error) -> wire::ErrorKind {
    if collective_error(e).is_some() {
        return wire::ErrorKind::CollectiveTimeout;
    }
    let text = format!("{e:#}").to_lowercase();
    if text.contains("non-finite") || text.contains("not finite") {
        wire::ErrorKind::NonFinite
    } else {
        wire::ErrorKind::Internal
    }
}

fn collective_error(e: &anyhow::Error) -> Option<&CollectiveError> {
    e.chain().find_map(|c| c.downcast_ref::<CollectiveError>())
}

/// The peer a failed collective blames (the WorkerError's `peer_rank`).
pub fn blamed_peer(e: &anyhow::Error) -> Option<u32> {
    collective_error(e)?.peer().map(|p| p as u32)
}
