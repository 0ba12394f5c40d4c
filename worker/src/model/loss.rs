//! Chunked LM head + cross-entropy: the `[T, V]` logits never exist whole.
//!
//! Labels follow HF semantics, shifted inside each packed document: token t
//! predicts `labels[t + 1]` of the same document; the last token of a
//! document predicts nothing; `-100` is ignored. Only positions with a
//! target go through the LM head at all (prompt tokens cost nothing here).
//!
//! Gradient: the hidden states and the head weight are detached into leaves;
//! each chunk computes its logits `[C, V]`, its summed NLL, and backpropagates
//! `scale · NLL` into those leaves right away, so at most one chunk's logits
//! (and their gradient) are alive. The leaves' gradients are then pushed into
//! the model with one backward of `⟨hidden, g_h⟩ + ⟨W, g_W⟩`, whose gradient
//! is exactly `(g_h, g_W)` — this also handles a head tied to the embedding.
//! A chunk whose loss is not finite stops before anything reaches the
//! model's parameters.

use anyhow::bail;
use tch::{Kind, Reduction, Tensor};

/// Per-token targets after the per-document shift (`-100` = none).
pub fn shifted_targets(labels: &[i64], cu_seq_lens: &[i64]) -> Vec<i64> {
    let mut out = vec![-100; labels.len()];
    for w in cu_seq_lens.windows(2) {
        let (s, e) = (w[0] as usize, w[1] as usize);
        if e > s + 1 {
            out[s..e - 1].copy_from_slice(&labels[s + 1..e]);
        }
    }
    out
}

/// The outcome of [`chunked_nll`].
#[derive(Debug)]
pub struct ChunkedLoss {
    /// Σ per-token NLL (unscaled), accumulated in f64.
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// `scale · ∂NLL/∂hidden`, `[T, H]` (undefined when no loss token).
    pub grad_hidden: Tensor,
    /// `scale · ∂NLL/∂W`, `[V, H]`.
    pub grad_weight: Tensor,
}

/// A non-finite chunk loss.
#[derive(Debug, thiserror::Error)]
#[error("non-finite loss {value} in loss chunk {chunk} (tokens {start}..{end} of the loss tokens)")]
pub struct NonFiniteLoss {
    pub value: f64,
    pub chunk: usize,
    pub start: usize,
    pub end: usize,
}

/// NLL over the targets in chunks of `chunk_tokens` and the gradients of
/// `scale · NLL` w.r.t. `hidden: [T, H]` and `weight: [V, H]` (not yet
/// applied to the model: see [`backward_into_model`]).
pub fn chunked_nll(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    chunk_tokens: usize,
    scale: f64,
) -> anyhow::Result<ChunkedLoss> {
    if chunk_tokens == 0 {
        bail!("loss_chunk_tokens must be positive");
    }
    let device = hidden.device();
    let h = hidden.detach().set_requires_grad(true);
    let w = weight.detach().set_requires_grad(true);
    let rows: Vec<i64> = (0..targets.len() as i64)
        .filter(|&t| targets[t as usize] != -100)
        .collect();
    let mut loss_sum = 0.0;
    for (i, chunk) in rows.chunks(chunk_tokens).enumerate() {
        let idx = Tensor::from_slice(chunk).to_device(device);
        let tgt: Vec<i64> = chunk.iter().map(|&r| targets[r as usize]).collect();
        let tgt = Tensor::from_slice(&tgt).to_device(device);
        let logits = h.index_select(0, &idx).matmul(&w.tr()).to_kind(Kind::Float);
        let nll = logits.cross_entropy_loss::<Tensor>(&tgt, None, Reduction::Sum, -100, 0.0);
        let value = f64::try_from(&nll)?;
        if !value.is_finite() {
            let start = i * chunk_tokens;
            return Err(NonFiniteLoss {
                value,
                chunk: i,
                start,
                end: start + chunk.len(),
            }
            .into());
        }
        loss_sum += value;
        (nll * scale).backward();
    }
    Ok(ChunkedLoss {
        loss_sum,
        loss_tokens: rows.len() as u64,
        grad_hidden: h.grad(),
        grad_weight: w.grad(),
    })
}

/// Backpropagates the chunked loss's gradients through the model:
/// accumulates into the parameters' `.grad` (never resets them).
pub fn backward_into_model(hidden: &Tensor, weight: &Tensor, loss: &ChunkedLoss) {
    if !loss.grad_hidden.defined() {
        return;
    }
    let surrogate = (hidden * &loss.grad_hidden).sum(Kind::Float)
        + (weight * &loss.grad_weight).sum(Kind::Float);
    surrogate.backward();
}
