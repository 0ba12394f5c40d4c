//! Probe plans (`PlanKind::Probe`): the coordinator bisecting a
//! non-finite step's documents. Each microbatch runs forward and backward
//! on its own (gradients zeroed before it), then its loss and this rank's
//! gradients are checked; nothing is reduced across ranks and no optimizer
//! step is taken, so the replica's state does not move.

use std::time::Instant;

use crate::convert;
use crate::error::classify;
use crate::train::Trainer;
use crate::wire;

/// A probe's answer: this rank's sums and its non-finite microbatches;
/// `None` when the coordinator aborted it.
pub type ProbeResult = Option<(wire::MetricSums, Vec<u32>)>;

/// Runs a probe plan. A microbatch whose loss or gradient is not finite is
/// flagged, not an error; any other failure is the plan's error.
pub fn run_probe(
    exec: &mut dyn Trainer,
    plan: &wire::StepPlan,
    aborted: &dyn Fn() -> bool,
) -> Result<ProbeResult, wire::WorkerError> {
    let fail = |e: &anyhow::Error, i: usize| {
        let (kind, peer_rank) = classify(e);
        wire::WorkerError {
            job_id: plan.job_id.clone(),
            generation: plan.generation,
            step: plan.step,
            kind: kind as i32,
            message: format!("probe of step {}, microbatch {i}: {e:#}", plan.step),
            peer_rank,
            weight_ring: false,
        }
    };
    let norms = convert::norms(plan.normalizers.as_ref()).map_err(|e| fail(&e.into(), 0))?;
    let start = Instant::now();
    let mut sums = wire::MetricSums {
        microbatches: plan.microbatches.len() as u32,
        ..Default::default()
    };
    let mut flagged = Vec::new();
    for (i, mb) in plan.microbatches.iter().enumerate() {
        if aborted() {
            exec.zero_grad();
            return Ok(None);
        }
        // fsdp runs empty microbatches too: every rank issues the same
        // collectives, and a non-finite gradient reaches its shards.
        if mb.token_ids.is_empty() && !exec.collective_per_microbatch() {
            continue;
        }
        let (batch, meta) = convert::microbatch(mb).map_err(|e| fail(&e.into(), i))?;
        let finite = match exec.probe_microbatch(i, &batch, &meta, &norms) {
            Ok((o, finite)) => {
                sums.tokens += o.tokens;
                sums.loss_tokens += o.loss_tokens;
                finite
            }
            Err(e) if classify(&e).0 == wire::ErrorKind::NonFinite => false,
            Err(_) if aborted() => {
                exec.zero_grad();
                return Ok(None);
            }
            Err(e) => {
                exec.zero_grad();
                return Err(fail(&e, i));
            }
        };
        if !finite {
            flagged.push(i as u32);
        }
        sums.documents += mb.sequences.len() as u64;
    }
    exec.zero_grad();
    sums.compute_s = start.elapsed().as_secs_f64();
    Ok(Some((sums, flagged)))
}
