//! The LM head for objectives whose loss is a function of log-probs (DPO,
//! policy gradient), still in chunks so `[tokens, vocab]` logits never exist
//! whole. Two passes over the chunks:
//! 1. [`token_logps`]: every target's log-prob, without autograd;
//! 2. the objective turns them into per-token weights `w_t` (its derivative
//!    with respect to each log-prob, negated), and [`weighted_nll`]
//!    backpropagates `Σ_t w_t·nll_t`, whose gradient with respect to
//!    `logp_t` is exactly `−w_t`.
//!
//! The second pass recomputes each chunk's logits; that costs one extra
//! head forward per microbatch and keeps memory at one chunk.

use anyhow::bail;
use tch::{Kind, Reduction, Tensor};

use crate::model::loss::{cap_logits, target_rows, ChunkedLoss, NonFiniteLoss};

/// The log-prob of every row's target (`0.0` where the row has none), in
/// chunks of `chunk_tokens` target rows, without autograd.
pub fn token_logps(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    chunk_tokens: usize,
    softcap: Option<f64>,
) -> anyhow::Result<Vec<f64>> {
    if chunk_tokens == 0 {
        bail!("loss_chunk_tokens must be positive");
    }
    let device = hidden.device();
    let mut out = vec![0.0; targets.len()];
    let rows = target_rows(targets);
    tch::no_grad(|| -> anyhow::Result<()> {
        for chunk in rows.chunks(chunk_tokens) {
            let idx = Tensor::from_slice(chunk).to_device(device);
            let tgt: Vec<i64> = chunk.iter().map(|&r| targets[r as usize]).collect();
            let tgt = Tensor::from_slice(&tgt).to_device(device).unsqueeze(1);
            let logits = hidden
                .index_select(0, &idx)
                .matmul(&weight.tr())
                .to_kind(Kind::Float);
            let lp = cap_logits(logits, softcap)
                .log_softmax(-1, Kind::Float)
                .gather(1, &tgt, false)
                .squeeze_dim(1)
                .to_kind(Kind::Double);
            let lp = Vec::<f64>::try_from(&lp)?;
            for (&r, v) in chunk.iter().zip(lp) {
                out[r as usize] = v;
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Per document of `cu_seq_lens`: the row log-probs moved onto the tokens
/// they predict — entry `j` of a sequence is the log-prob of its token `j`
/// given the tokens before it, 0 for token 0 and for unlabelled tokens —
/// the alignment of the wire's `old_logprobs`/`ref_logprobs`.
pub fn token_aligned(token_logps: &[f64], targets: &[i64], cu_seq_lens: &[i64]) -> Vec<Vec<f32>> {
    cu_seq_lens
        .windows(2)
        .map(|w| {
            let (s, e) = (w[0] as usize, w[1] as usize);
            std::iter::once(0.0)
                .chain((s..e.saturating_sub(1)).map(|t| {
                    if targets[t] == -100 {
                        0.0
                    } else {
                        token_logps[t] as f32
                    }
                }))
                .take(e - s)
                .collect()
        })
        .collect()
}

/// A reference plan's answer for each sequence of a microbatch: its summed
/// log-prob and loss tokens, and with `per_token` its [`token_aligned`]
/// log-probs (policy gradient). A non-finite sum is an error naming the
/// sequence.
pub fn reference_sequences(
    token_logps: &[f64],
    targets: &[i64],
    cu_seq_lens: &[i64],
    per_token: bool,
) -> anyhow::Result<Vec<crate::batch::SequenceLogp>> {
    let sums = sequence_sums(token_logps, targets, cu_seq_lens);
    if let Some((i, _)) = sums.iter().enumerate().find(|(_, s)| !s.0.is_finite()) {
        return Err(crate::error::StepError::non_finite(format!(
            "reference log-prob of sequence {i}"
        )));
    }
    let mut tokens = if per_token {
        token_aligned(token_logps, targets, cu_seq_lens)
    } else {
        Vec::new()
    }
    .into_iter();
    Ok(sums
        .into_iter()
        .map(|(logp, loss_tokens)| crate::batch::SequenceLogp {
            logp,
            loss_tokens,
            tokens: tokens.next().unwrap_or_default(),
        })
        .collect())
}

/// Per document of `cu_seq_lens`: (Σ target log-probs, target count).
pub fn sequence_sums(token_logps: &[f64], targets: &[i64], cu_seq_lens: &[i64]) -> Vec<(f64, u64)> {
    cu_seq_lens
        .windows(2)
        .map(|w| {
            let (s, e) = (w[0] as usize, w[1] as usize);
            (s..e)
                .filter(|&t| targets[t] != -100)
                .fold((0.0, 0u64), |(sum, n), t| (sum + token_logps[t], n + 1))
        })
        .collect()
}

/// `Σ_t weights[t]·nll_t` over the target rows, in chunks, with its
/// gradients w.r.t. `hidden` and `weight` (apply them with
/// `loss::backward_into_model`). `loss_sum` reports `Σ_t weights[t]·nll_t`.
pub fn weighted_nll(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    weights: &[f64],
    chunk_tokens: usize,
    softcap: Option<f64>,
) -> anyhow::Result<ChunkedLoss> {
    if chunk_tokens == 0 {
        bail!("loss_chunk_tokens must be positive");
    }
    if weights.len() != targets.len() {
        bail!(
            "{} token weights for {} tokens",
            weights.len(),
            targets.len()
        );
    }
    let device = hidden.device();
    let h = hidden.detach().set_requires_grad(true);
    let w = weight.detach().set_requires_grad(true);
    let rows = target_rows(targets);
    let mut loss_sum = 0.0;
    for (i, chunk) in rows.chunks(chunk_tokens).enumerate() {
        let idx = Tensor::from_slice(chunk).to_device(device);
        let tgt: Vec<i64> = chunk.iter().map(|&r| targets[r as usize]).collect();
        let tgt = Tensor::from_slice(&tgt).to_device(device);
        let wt: Vec<f32> = chunk.iter().map(|&r| weights[r as usize] as f32).collect();
        let wt = Tensor::from_slice(&wt).to_device(device);
        let logits = h.index_select(0, &idx).matmul(&w.tr()).to_kind(Kind::Float);
        let logits = cap_logits(logits, softcap);
        let nll = logits.cross_entropy_loss::<Tensor>(&tgt, None, Reduction::None, -100, 0.0);
        let loss = (nll * wt).sum(Kind::Float);
        let value = f64::try_from(&loss)?;
        NonFiniteLoss::check(value, i, chunk_tokens, chunk.len())?;
        loss_sum += value;
        loss.backward();
    }
    Ok(ChunkedLoss {
        loss_sum,
        loss_tokens: rows.len() as u64,
        grad_hidden: h.grad(),
        grad_weight: w.grad(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::loss;
    use tch::Device;

    #[test]
    fn token_aligned_puts_each_rows_log_prob_on_the_token_it_predicts() {
        // Two documents [0,4) and [4,9); label -100 at token 3 (no target
        // for row 2) and no row predicts across the boundary.
        let (_, _, targets) = setup();
        let rows: Vec<f64> = (0..9).map(|t| -(t as f64) - 1.0).collect();
        let got = token_aligned(&rows, &targets, &[0, 4, 9]);
        assert_eq!(
            got,
            vec![
                vec![0.0, -1.0, -2.0, 0.0],
                vec![0.0, -5.0, -6.0, -7.0, -8.0]
            ]
        );
        // Summing the aligned values gives the sequence sums.
        let sums = sequence_sums(&rows, &targets, &[0, 4, 9]);
        for (seq, (sum, _)) in got.iter().zip(sums) {
            assert_eq!(seq.iter().map(|&x| f64::from(x)).sum::<f64>(), sum);
        }
    }

    fn setup() -> (Tensor, Tensor, Vec<i64>) {
        tch::manual_seed(7);
        let h = Tensor::randn([9, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 8], (Kind::Float, Device::Cpu));
        let labels: Vec<i64> = vec![1, 2, 3, -100, 5, 6, 7, 8, 9];
        let targets = loss::shifted_targets(&labels, &[0, 4, 9]);
        (h, w, targets)
    }

    /// Log-probs equal minus the per-token NLL of the plain computation,
    /// whatever the chunk size.
    #[test]
    fn token_logps_match_full_log_softmax() {
        let (h, w, targets) = setup();
        let full = h.matmul(&w.tr()).log_softmax(-1, Kind::Double);
        for chunk in [1, 2, 5, 100] {
            let lp = token_logps(&h, &w, &targets, chunk, None).unwrap();
            for (t, &tg) in targets.iter().enumerate() {
                let want = if tg == -100 {
                    0.0
                } else {
                    full.double_value(&[t as i64, tg])
                };
                assert!((lp[t] - want).abs() < 1e-5, "chunk {chunk} row {t}");
            }
        }
        let sums = sequence_sums(
            &token_logps(&h, &w, &targets, 3, None).unwrap(),
            &targets,
            &[0, 4, 9],
        );
        assert_eq!(sums.iter().map(|s| s.1).collect::<Vec<_>>(), vec![2, 4]);
    }

    /// With uniform weights the weighted loss is the SFT chunked loss,
    /// gradients included.
    #[test]
    fn uniform_weights_reproduce_the_sft_loss() {
        let (h, w, targets) = setup();
        let scale = 0.25;
        let sft = loss::chunked_nll(&h, &w, &targets, 3, scale, None).unwrap();
        let ws = vec![scale; targets.len()];
        let weighted = weighted_nll(&h, &w, &targets, &ws, 2, None).unwrap();
        assert!((weighted.loss_sum - scale * sft.loss_sum).abs() < 1e-4);
        let d = (&weighted.grad_hidden - &sft.grad_hidden).abs().max();
        assert!(d.double_value(&[]) < 1e-6);
        let d = (&weighted.grad_weight - &sft.grad_weight).abs().max();
        assert!(d.double_value(&[]) < 1e-6);
    }
}
