//! Running one step plan ([`run_step`]): the part of the runner that is a
//! plain function of a trainer and a plan, tested with fakes. Failures
//! carry their kind (`crate::error::classify`).

use std::time::Instant;

use super::fault;
use crate::batch::{MicrobatchMeta, PackedBatch};
use crate::convert;
use crate::error::classify;
use crate::train::Trainer;
use crate::wire;

/// How a step ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    Done(wire::MetricSums),
    Failed(wire::WorkerError),
    /// Aborted by the coordinator: gradients dropped, nothing to report.
    Aborted,
}

/// Plan `p` failed with `e`: its error, typed by `classify` (kind and
/// blamed peer), with `message` for people.
pub(super) fn plan_error(
    p: &wire::StepPlan,
    e: &anyhow::Error,
    message: String,
) -> wire::WorkerError {
    let (kind, peer_rank) = classify(e);
    wire::WorkerError {
        job_id: p.job_id.clone(),
        generation: p.generation,
        step: p.step,
        kind: kind as i32,
        message,
        peer_rank,
        weight_ring: false,
    }
}

/// Runs one plan: every non-empty microbatch (empty padding ones are
/// counted, not run), then the optimizer step. `aborted` is polled between
/// microbatches. The plan's `max_tokens` (its step's budget per microbatch)
/// gives the padding a padded layout would have wasted; `idle_s` is the
/// time since the previous plan finished.
pub fn run_step(
    exec: &mut dyn Trainer,
    plan: &wire::StepPlan,
    idle_s: f64,
    aborted: &dyn Fn() -> bool,
) -> StepOutcome {
    let fail =
        |e: &anyhow::Error, message: String| StepOutcome::Failed(plan_error(plan, e, message));
    let norms = match convert::norms(plan.normalizers.as_ref()) {
        Ok(n) => n,
        Err(e) => {
            let e = anyhow::Error::from(e);
            return fail(&e, format!("step {}: {e}", plan.step));
        }
    };
    let max_tokens = u64::from(plan.max_tokens);
    let mut sums = wire::MetricSums {
        idle_s,
        microbatches: plan.microbatches.len() as u32,
        ..Default::default()
    };
    // A document is counted at its first sequence (role 0; a DPO pair's
    // rejected side is role 1): the same document twice in one step (an
    // epoch boundary inside it) counts twice, as it is trained twice. Each
    // microbatch holds one source's documents: its sums are that source's
    // (the coordinator names the sources).
    let mut documents = 0u64;
    // Collective time is measured apart and taken out of compute and
    // optimizer time, so the four phases add up to the step's wall time.
    let coll_start = crate::collective::timed::spent_s();
    let device = exec.device();
    crate::gpu_memory::reset_peak(device);
    let compute = Instant::now();
    // What needs the whole step first (Qwen3-MoE's load-balancing loss)
    // gets every microbatch before the first one runs.
    let mut whole: Vec<PackedBatch> = Vec::new();
    let mut metas: Vec<MicrobatchMeta> = Vec::new();
    if exec.needs_whole_step() {
        for (i, mb) in plan.microbatches.iter().enumerate() {
            match convert::microbatch(mb) {
                Ok((b, m)) => {
                    whole.push(b);
                    metas.push(m);
                }
                Err(e) => {
                    let e = anyhow::Error::from(e);
                    return fail(&e, format!("step {}, microbatch {i}: {e:#}", plan.step));
                }
            }
        }
        if let Err(e) = exec.begin_step(&whole) {
            exec.zero_grad();
            if aborted() {
                return StepOutcome::Aborted;
            }
            return fail(&e, format!("step {}: {e:#}", plan.step));
        }
    }
    for (i, mb) in plan.microbatches.iter().enumerate() {
        if aborted() {
            exec.zero_grad();
            return StepOutcome::Aborted;
        }
        if mb.token_ids.is_empty() && !exec.collective_per_microbatch() {
            continue;
        }
        // A row the plan got wrong is refused before anything runs on it;
        // the error names the microbatch and keeps its kind.
        let converted = match (whole.get_mut(i), metas.get_mut(i)) {
            (Some(b), Some(m)) => Ok((std::mem::take(b), std::mem::take(m))),
            _ => convert::microbatch(mb),
        };
        let result = converted
            .map_err(anyhow::Error::from)
            .and_then(|(batch, meta)| {
                let o = exec.train_microbatch(i, &batch, &meta, &norms)?;
                Ok((o, batch.cu_seq_lens))
            });
        if i == 0 {
            // Gradients of the first microbatch accumulated, step half done.
            fault::point(fault::Point::MidMicrobatch, plan.step, plan.rank);
        }
        match result {
            Ok((o, cu_seq_lens)) => {
                sums.pairs += o.pairs;
                for (k, v) in &o.extra {
                    *sums.extra.entry(k.clone()).or_insert(0.0) += v;
                }
                sums.loss_sum += o.loss_sum;
                sums.loss_tokens += o.loss_tokens;
                sums.tokens += o.tokens;
                sums.model_flops += exec.model_flops(&cu_seq_lens, o.loss_tokens);
                if o.tokens > 0 {
                    sums.padding_tokens += max_tokens.saturating_sub(o.tokens);
                }
                let firsts = mb.sequences.iter().filter(|s| s.role == 0).count() as u64;
                documents += firsts;
                if !mb.sequences.is_empty() {
                    let src = sums.sources.entry(mb.source).or_default();
                    src.loss_sum += o.loss_sum;
                    src.loss_tokens += o.loss_tokens;
                    src.tokens += o.tokens;
                    src.pairs += o.pairs;
                    for (k, v) in &o.extra {
                        *src.extra.entry(k.clone()).or_insert(0.0) += v;
                    }
                    src.documents += firsts;
                }
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
    sums.documents = documents;
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
        Ok(stats) => sums.grad_norm = stats.grad_norm,
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
    if let Some(p) = crate::gpu_memory::peak(device) {
        sums.gpu_memory_peak_allocated_bytes = p.allocated;
        sums.gpu_memory_peak_reserved_bytes = p.reserved;
    }
    crate::metrics::global().observe_step(plan, &sums);
    StepOutcome::Done(sums)
}
