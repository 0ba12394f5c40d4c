//! Qwen3-MoE's load-balancing loss over a whole step, exactly.
//!
//! transformers adds `coef · aux` to the loss of one forward (only with
//! `output_router_logits`), `aux = E · Σ_e f_e · P_e` over that forward's
//! R (token, sparse layer) rows: `f_e` the fraction of top-k choices that
//! went to expert e, `P_e` the mean router probability of e. The counts
//! carry no gradient. It is not a sum over documents, so a step cut into
//! microbatches and ranks needs a definition: Accrue takes the whole step
//! as the forward. R is every token of the step (each document's, prompt
//! included) times the sparse layers, and `C_e` the step's choice counts:
//!
//! ```text
//! ∇(coef · aux) = coef · E / R² · Σ_e C_e · ∇(Σ_t p_te)
//! ```
//!
//! a sum over tokens with per-expert weights `a_e = coef · E · C_e / R²`
//! shared by the whole step. Given `a`, each microbatch adds its tokens'
//! `⟨Σ_t p_t, a⟩` to its backward (`model::moe::Route::aux`) and the
//! gradients add up across microbatches and ranks like the token losses'.
//! `a` needs the step's counts before the first backward: a forward-only
//! pre-pass over the rank's microbatches counts, one all-reduce sums the
//! counts of every rank ([`Passes::begin_step`]). The update is then the
//! same whatever the microbatch split, world size and sharding, and equals
//! transformers' with all the step's documents in one padded batch (its
//! attention mask keeps padding out of the counts) — both tested. The
//! price is one more forward per microbatch, paid only when the loss is on.
//!
//! [`Passes::begin_step`]: super::Passes::begin_step

use anyhow::Context;
use tch::{Device, Tensor};

use crate::batch::{PackedBatch, StepNorms};
use crate::collective::Collective;
use crate::model::config::MoeSpec;

/// The metric the loss is reported as (the step's `aux`, before `coef`).
pub const AUX_METRIC: &str = "router_aux_loss";

/// Sums per-expert counts over the ranks, exactly: the collective sums
/// float32, exact only below 2^24, so each count travels as its low 16 bits
/// and the rest (exact for 256 ranks and counts below 2^40).
pub fn reduce_counts(coll: &mut dyn Collective, local: &[i64]) -> anyhow::Result<Vec<i64>> {
    if coll.world_size() == 1 {
        return Ok(local.to_vec());
    }
    let split: Vec<f32> = local
        .iter()
        .map(|&c| (c & 0xffff) as f32)
        .chain(local.iter().map(|&c| (c >> 16) as f32))
        .collect();
    let mut t = Tensor::from_slice(&split).to_device(coll.device());
    coll.all_reduce_sum(&mut t)
        .context("all_reduce of the step's expert counts")?;
    let v = Vec::<f32>::try_from(&t.to_device(Device::Cpu))?;
    let n = local.len();
    Ok((0..n)
        .map(|e| v[e] as i64 + ((v[n + e] as i64) << 16))
        .collect())
}

/// The weights `a` (see the module docs) from the step's counts, on
/// `device`; `None` when the step routed nothing.
pub fn aux_weights(counts: &[i64], spec: &MoeSpec, device: Device) -> Option<Tensor> {
    let choices: i64 = counts.iter().sum();
    if choices == 0 {
        return None;
    }
    let rows = choices as f64 / spec.top_k as f64;
    let scale = spec.aux_loss_coef * spec.experts as f64 / (rows * rows);
    let a: Vec<f32> = counts.iter().map(|&c| (c as f64 * scale) as f32).collect();
    Some(Tensor::from_slice(&a).to_device(device))
}

/// The metric of routing replay: tokens a microbatch trained with the
/// generator's experts (the coordinator reports it per loss token).
pub const REPLAYED_METRIC: &str = "routing_replayed";

/// How many of `mb`'s tokens replay a routing (`None`: it carries none).
pub fn replayed_metric(mb: &PackedBatch) -> Option<(String, f64)> {
    let tokens = mb.tokens();
    if mb.routing.is_empty() || tokens == 0 {
        return None;
    }
    let width = mb.routing.len() / tokens;
    let replayed = mb
        .routing
        .chunks(width.max(1))
        .filter(|row| row.first().is_some_and(|&e| e >= 0))
        .count();
    Some((REPLAYED_METRIC.to_string(), replayed as f64))
}

/// Adds a microbatch's routing metrics to its `extra` sums: the
/// load-balancing loss's (its `share`, with the loss on: `aux` is the
/// model's spec then) and routing replay's.
pub fn report(
    extra: &mut std::collections::BTreeMap<String, f64>,
    share: Option<f64>,
    aux: Option<MoeSpec>,
    norms: &StepNorms,
    mb: &PackedBatch,
) {
    if let (Some(share), Some(spec)) = (share, aux) {
        let (k, v) = aux_metric(share, &spec, norms);
        *extra.entry(k).or_insert(0.0) += v;
    }
    if let Some((k, v)) = replayed_metric(mb) {
        *extra.entry(k).or_insert(0.0) += v;
    }
}

/// A microbatch's share of the loss (`⟨Σ_t p_t, a⟩` summed over its
/// sparse layers) as the metric sum the coordinator divides by the step's
/// loss tokens (or pairs) into the step's `aux`.
pub fn aux_metric(share: f64, spec: &MoeSpec, norms: &StepNorms) -> (String, f64) {
    let denom = if norms.pairs > 0 {
        norms.pairs
    } else {
        norms.loss_tokens
    };
    (
        AUX_METRIC.to_string(),
        share / spec.aux_loss_coef * denom as f64,
    )
}
