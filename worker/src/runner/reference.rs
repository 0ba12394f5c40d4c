//! Reference plans (`reference = "cached"`): forward only, every
//! sequence's log-prob under the job's initial weights (per token too for
//! policy-gradient jobs), reported with the sequence's document id and
//! role. No gradient, no optimizer step, and the replica's step does not
//! move.

use std::time::Instant;

use crate::convert;
use crate::error::classify;
use crate::train::Trainer;
use crate::wire;

/// Runs a reference plan's microbatches; an error names the microbatch.
pub fn run_reference(
    exec: &mut dyn Trainer,
    plan: &wire::StepPlan,
) -> Result<(wire::MetricSums, Vec<wire::SequenceLogp>), wire::WorkerError> {
    run_logps(
        exec,
        plan,
        |e, i, b| e.reference_logps(i, b),
        "reference chunk",
    )
}

/// Runs an eval plan's microbatches: the same report as a reference plan,
/// under the current weights (the coordinator forms the eval metrics).
pub fn run_eval(
    exec: &mut dyn Trainer,
    plan: &wire::StepPlan,
) -> Result<(wire::MetricSums, Vec<wire::SequenceLogp>), wire::WorkerError> {
    run_logps(exec, plan, |e, i, b| e.eval_logps(i, b), "eval chunk")
}

type LogpsFn = fn(
    &mut dyn Trainer,
    usize,
    &crate::batch::PackedBatch,
) -> anyhow::Result<Vec<crate::batch::SequenceLogp>>;

fn run_logps(
    exec: &mut dyn Trainer,
    plan: &wire::StepPlan,
    logps_of: LogpsFn,
    what: &str,
) -> Result<(wire::MetricSums, Vec<wire::SequenceLogp>), wire::WorkerError> {
    let start = Instant::now();
    let mut sums = wire::MetricSums {
        microbatches: plan.microbatches.len() as u32,
        ..Default::default()
    };
    let mut logps = Vec::new();
    for (i, mb) in plan.microbatches.iter().enumerate() {
        // A trainer with collectives per microbatch (fsdp) runs empty
        // ones too, so every rank issues the same collectives.
        if mb.token_ids.is_empty() && !exec.collective_per_microbatch() {
            continue;
        }
        let got = convert::microbatch(mb)
            .map_err(anyhow::Error::from)
            .and_then(|(batch, _)| logps_of(exec, i, &batch))
            .map_err(|e| {
                let (kind, peer_rank) = classify(&e);
                wire::WorkerError {
                    job_id: plan.job_id.clone(),
                    generation: plan.generation,
                    step: plan.step,
                    kind: kind as i32,
                    message: format!("{what} {}, microbatch {i}: {e:#}", plan.step),
                    peer_rank,
                    weight_ring: false,
                }
            })?;
        if got.len() != mb.sequences.len() {
            return Err(wire::WorkerError {
                job_id: plan.job_id.clone(),
                generation: plan.generation,
                step: plan.step,
                kind: wire::ErrorKind::InvalidPlan as i32,
                message: format!(
                    "{what} {}, microbatch {i}: {} sequences in cu_seq_lens, {} sequence entries",
                    plan.step,
                    got.len(),
                    mb.sequences.len()
                ),
                peer_rank: None,
                weight_ring: false,
            });
        }
        sums.tokens += accrue_proto::unpack_u32(&mb.token_ids).map_or(0, |t| t.len() as u64);
        sums.documents += mb.sequences.len() as u64;
        for (s, l) in mb.sequences.iter().zip(got) {
            sums.loss_tokens += l.loss_tokens;
            logps.push(wire::SequenceLogp {
                doc_id: accrue_proto::doc_label(s),
                role: s.role,
                logp: l.logp,
                loss_tokens: l.loss_tokens,
                token_logps: accrue_proto::pack_f32(&l.tokens),
            });
        }
    }
    sums.compute_s = start.elapsed().as_secs_f64();
    Ok((sums, logps))
}
