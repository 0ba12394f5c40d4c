//! One microbatch's loss and gradients for the log-prob objectives (DPO,
//! policy gradient): log-probs from [`head::token_logps`], the objective's
//! math per pair or token, then [`head::weighted_nll`] with the resulting
//! per-token weights. Metric sums follow DESIGN.md "The math": sums here,
//! means at the coordinator after summing over microbatches and ranks.

use std::collections::BTreeMap;

use anyhow::bail;
use tch::Tensor;

use super::dpo::{self, DpoParams, PairLogps};
use super::head;
use super::kind::{Normalization, Objective};
use super::pg::{self, PgParams, TokenIn};
use crate::batch::{MicrobatchMeta, PackedBatch, StepNorms};
use crate::error::StepError;
use crate::model::loss::{self, ChunkedLoss};

/// A microbatch's gradients (to apply with `loss::backward_into_model`) and
/// metric sums.
#[derive(Debug)]
pub struct ObjectiveOut {
    pub grads: ChunkedLoss,
    /// Σ pair losses (DPO) or Σ token losses (PG), unnormalised.
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// Preference pairs (DPO; 0 otherwise).
    pub pairs: u64,
    pub extra: BTreeMap<String, f64>,
}

/// An objective's math on one row's per-token log-probs: each token's
/// weight in the weighted NLL whose gradient is the objective's, and the
/// metric sums. Pure arithmetic on the row (no tensors), so a row split
/// over ranks (context parallelism) gathers its log-probs, runs this the
/// same on every rank, and backpropagates each rank's tokens' weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RowWeights {
    /// Per row position (0 where no loss).
    pub weights: Vec<f64>,
    pub loss_sum: f64,
    pub loss_tokens: u64,
    pub pairs: u64,
    pub extra: BTreeMap<String, f64>,
}

impl RowWeights {
    pub fn into_out(self, grads: ChunkedLoss) -> ObjectiveOut {
        ObjectiveOut {
            grads,
            loss_sum: self.loss_sum,
            loss_tokens: self.loss_tokens,
            pairs: self.pairs,
            extra: self.extra,
        }
    }
}

/// DPO over the pairs of one microbatch: each pair's two sequences sit in
/// this microbatch (the planner never splits a pair); `ref` log-probs come
/// from the plan (`ref_logp` scalar, cached pass) or from `live_ref`, the
/// per-token log-probs of a frozen reference model on the same row.
#[allow(clippy::too_many_arguments)]
pub fn dpo(
    hidden: &Tensor,
    weight: &Tensor,
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    k: &DpoParams,
    pairs_total: u64,
    chunk_tokens: usize,
    live_ref: Option<&[f64]>,
    softcap: Option<f64>,
) -> anyhow::Result<ObjectiveOut> {
    let targets = loss::shifted_targets(&batch.labels, &batch.cu_seq_lens);
    let lp = head::token_logps(hidden, weight, &targets, chunk_tokens, softcap)?;
    let w = dpo_weights(batch, meta, k, pairs_total, &lp, live_ref)?;
    let grads = head::weighted_nll(hidden, weight, &targets, &w.weights, chunk_tokens, softcap)?;
    Ok(w.into_out(grads))
}

/// [`dpo()`]'s math on the row's per-token log-probs `lp`.
pub fn dpo_weights(
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    k: &DpoParams,
    pairs_total: u64,
    lp: &[f64],
    live_ref: Option<&[f64]>,
) -> anyhow::Result<RowWeights> {
    let targets = loss::shifted_targets(&batch.labels, &batch.cu_seq_lens);
    let docs = batch.documents();
    if meta.seqs.len() != docs {
        return Err(StepError::invalid(format!(
            "{} sequence entries for {docs} sequences",
            meta.seqs.len()
        )));
    }
    if pairs_total == 0 {
        return Err(StepError::invalid(
            "the step's pair count is 0 but this microbatch holds pairs",
        ));
    }
    let sums = head::sequence_sums(lp, &targets, &batch.cu_seq_lens);
    let ref_sums = live_ref.map(|r| head::sequence_sums(r, &targets, &batch.cu_seq_lens));
    let ref_of = |i: usize| -> anyhow::Result<f64> {
        match &ref_sums {
            Some(r) => Ok(r[i].0),
            None => meta.seqs[i].ref_logp.ok_or_else(|| {
                StepError::data(format!(
                    "document {} role {}: no ref_logp in the plan (cached reference pass missing)",
                    meta.seqs[i].doc_id, meta.seqs[i].role
                ))
            }),
        }
    };
    // Pair the sequences by document id. A pair can sit in a step twice
    // (a step that spans an epoch boundary): its k-th chosen goes with its
    // k-th rejected — the copies are identical, so any matching is right.
    let mut roles: BTreeMap<&str, [Vec<usize>; 2]> = BTreeMap::new();
    for (i, s) in meta.seqs.iter().enumerate() {
        match roles
            .entry(s.doc_id.as_str())
            .or_default()
            .get_mut(s.role as usize)
        {
            Some(v) => v.push(i),
            None => {
                return Err(StepError::invalid(format!(
                    "document {}: unknown role {}",
                    s.doc_id, s.role
                )))
            }
        }
    }
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for (doc, [chosen, rejected]) in &roles {
        if chosen.len() != rejected.len() {
            return Err(StepError::invalid(format!(
                "document {doc}: {} chosen and {} rejected sequences in this microbatch (a pair's two sequences must sit together)",
                chosen.len(),
                rejected.len()
            )));
        }
        pairs.extend(chosen.iter().copied().zip(rejected.iter().copied()));
    }
    let mut weights = vec![0.0; targets.len()];
    let mut extra = BTreeMap::new();
    let mut add = |k: &str, v: f64| *extra.entry(k.to_string()).or_insert(0.0) += v;
    let mut loss_sum = 0.0;
    let mut loss_tokens = 0;
    let scale = 1.0 / pairs_total as f64;
    let mb_pairs = pairs.len() as u64;
    for (c, r) in pairs {
        let out = dpo::pair(
            &PairLogps {
                policy_chosen: sums[c].0,
                policy_rejected: sums[r].0,
                ref_chosen: ref_of(c)?,
                ref_rejected: ref_of(r)?,
                chosen_tokens: sums[c].1,
                rejected_tokens: sums[r].1,
            },
            k,
        );
        for (seq, d) in [(c, out.d_chosen), (r, out.d_rejected)] {
            let (s, e) = (
                batch.cu_seq_lens[seq] as usize,
                batch.cu_seq_lens[seq + 1] as usize,
            );
            for t in s..e {
                if targets[t] != -100 {
                    // ∂(Σ w·nll)/∂logp = −w, and we want ∂L/∂logp = d/P.
                    weights[t] = -d * scale;
                }
            }
        }
        loss_sum += out.loss;
        loss_tokens += sums[c].1 + sums[r].1;
        add("rewards/chosen", out.reward_chosen);
        add("rewards/rejected", out.reward_rejected);
        add("rewards/margin", out.margin());
        add("rewards/accuracy", f64::from(u8::from(out.correct())));
        add("logps/chosen", out.logp_chosen);
        add("logps/rejected", out.logp_rejected);
    }
    Ok(RowWeights {
        weights,
        loss_sum,
        loss_tokens,
        pairs: mb_pairs,
        extra,
    })
}

/// Policy gradient over the rollouts of one microbatch: each sequence
/// carries its `advantage` scalar (group-relative, from the coordinator);
/// `old_logprobs` (if any) give the PPO ratio; the KL term's reference is
/// `live_ref` (a frozen model's row log-probs) or else the plan's cached
/// `ref_logprobs`.
#[allow(clippy::too_many_arguments)]
pub fn policy_gradient(
    hidden: &Tensor,
    weight: &Tensor,
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    k: &PgParams,
    norm: Normalization,
    norms: &StepNorms,
    chunk_tokens: usize,
    live_ref: Option<&[f64]>,
    softcap: Option<f64>,
) -> anyhow::Result<ObjectiveOut> {
    let targets = loss::shifted_targets(&batch.labels, &batch.cu_seq_lens);
    let lp = head::token_logps(hidden, weight, &targets, chunk_tokens, softcap)?;
    let w = pg_weights(batch, meta, k, norm, norms, &lp, live_ref)?;
    let grads = head::weighted_nll(hidden, weight, &targets, &w.weights, chunk_tokens, softcap)?;
    Ok(w.into_out(grads))
}

/// [`policy_gradient`]'s math on the row's per-token log-probs `lp`.
pub fn pg_weights(
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    k: &PgParams,
    norm: Normalization,
    norms: &StepNorms,
    lp: &[f64],
    live_ref: Option<&[f64]>,
) -> anyhow::Result<RowWeights> {
    let targets = loss::shifted_targets(&batch.labels, &batch.cu_seq_lens);
    let docs = batch.documents();
    if meta.seqs.len() != docs {
        return Err(StepError::invalid(format!(
            "{} sequence entries for {docs} sequences",
            meta.seqs.len()
        )));
    }
    for (what, v) in [
        ("old", &meta.old_logprobs),
        ("reference", &meta.ref_logprobs),
    ] {
        if !v.is_empty() && v.len() != targets.len() {
            return Err(StepError::invalid(format!(
                "{} {what} log-probs for {} tokens",
                v.len(),
                targets.len()
            )));
        }
    }
    let cached_ref = live_ref.is_none() && k.kl_coef != 0.0;
    if cached_ref && meta.ref_logprobs.is_empty() {
        return Err(StepError::data(
            "kl_coef > 0 with a cached reference, but the plan carries no ref_logprobs",
        ));
    }
    let mut weights = vec![0.0; targets.len()];
    let mut extra = BTreeMap::new();
    let (mut loss_sum, mut loss_tokens) = (0.0, 0u64);
    let (mut clipped, mut kl_sum) = (0.0, 0.0);
    // Σ |trainer − sampler| log-prob over tokens with a sampler log-prob:
    // the train/inference mismatch (routing replay closes it for MoE).
    let (mut mismatch, mut with_old) = (0.0, false);
    for (i, s) in meta.seqs.iter().enumerate() {
        let a = s.advantage.ok_or_else(|| {
            StepError::data(format!(
                "document {}: no advantage in the plan (rollouts need one)",
                s.doc_id
            ))
        })?;
        let (b, e) = (
            batch.cu_seq_lens[i] as usize,
            batch.cu_seq_lens[i + 1] as usize,
        );
        let n_seq = (b..e).filter(|&t| targets[t] != -100).count() as f64;
        let denom = match norm {
            Normalization::Token => norms.loss_tokens as f64,
            Normalization::Sequence => n_seq * norms.sequences as f64,
            Normalization::Constant(c) => c,
        };
        if n_seq > 0.0 && denom <= 0.0 {
            return Err(StepError::invalid(format!(
                "document {}: the step's loss normaliser is 0",
                s.doc_id
            )));
        }
        for t in (b..e).filter(|&t| targets[t] != -100) {
            // Row t predicts token t+1 (same document): its old log-prob.
            // NaN marks a rollout without old log-probs packed next to ones
            // with them (the coordinator refuses non-finite values at
            // ingest, so NaN means only that): on-policy for its tokens.
            let old_logp = meta
                .old_logprobs
                .get(t + 1)
                .map(|&x| f64::from(x))
                .filter(|x| x.is_finite());
            let ref_logp = match live_ref {
                Some(r) => Some(r[t]),
                None if cached_ref => {
                    let r = f64::from(meta.ref_logprobs[t + 1]);
                    if !r.is_finite() {
                        return Err(StepError::data(format!(
                            "document {}: no cached reference log-prob for token {} (the reference pass did not cover it)",
                            s.doc_id,
                            t + 1 - b
                        )));
                    }
                    Some(r)
                }
                None => None,
            };
            if let Some(o) = old_logp {
                mismatch += (lp[t] - o).abs();
                with_old = true;
            }
            let out = pg::token(
                &TokenIn {
                    logp: lp[t],
                    old_logp,
                    ref_logp,
                    advantage: a,
                },
                k,
            );
            weights[t] = -out.d_logp / denom;
            loss_sum += out.loss;
            loss_tokens += 1;
            clipped += f64::from(u8::from(out.clipped));
            kl_sum += out.kl;
        }
        *extra.entry("advantage".to_string()).or_insert(0.0) += a * n_seq;
    }
    extra.insert("clip_fraction".into(), clipped);
    if with_old {
        extra.insert("logprob_diff".into(), mismatch);
    }
    if live_ref.is_some() || cached_ref {
        extra.insert("kl".into(), kl_sum);
    }
    Ok(RowWeights {
        weights,
        loss_sum,
        loss_tokens,
        pairs: 0,
        extra,
    })
}

/// The job's log-prob objective's math on one row's per-token log-probs
/// `lp` ([`dpo_weights`] or [`pg_weights`]).
pub fn weights(
    objective: &Objective,
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    norms: &StepNorms,
    lp: &[f64],
    live_ref: Option<&[f64]>,
) -> anyhow::Result<RowWeights> {
    match objective {
        Objective::Dpo { params, .. } => {
            dpo_weights(batch, meta, params, norms.pairs, lp, live_ref)
        }
        Objective::Pg { params, norm, .. } => {
            pg_weights(batch, meta, params, *norm, norms, lp, live_ref)
        }
        Objective::Sft => bail!("the sft objective has no log-prob head"),
    }
}

/// The job's log-prob objective on one microbatch: [`dpo()`] or
/// [`policy_gradient`] with the step's normalisers (both trainers call
/// this; SFT goes through the plain chunked loss instead).
#[allow(clippy::too_many_arguments)]
pub fn objective(
    objective: &Objective,
    hidden: &Tensor,
    weight: &Tensor,
    batch: &PackedBatch,
    meta: &MicrobatchMeta,
    norms: &StepNorms,
    chunk_tokens: usize,
    live_ref: Option<&[f64]>,
    softcap: Option<f64>,
) -> anyhow::Result<ObjectiveOut> {
    match objective {
        Objective::Dpo { params, .. } => dpo(
            hidden,
            weight,
            batch,
            meta,
            params,
            norms.pairs,
            chunk_tokens,
            live_ref,
            softcap,
        ),
        Objective::Pg { params, norm, .. } => policy_gradient(
            hidden,
            weight,
            batch,
            meta,
            params,
            *norm,
            norms,
            chunk_tokens,
            live_ref,
            softcap,
        ),
        Objective::Sft => bail!("the sft objective has no log-prob head"),
    }
}
