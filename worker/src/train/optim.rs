//! AdamW with `torch.optim.AdamW` semantics and global norm clipping like
//! `torch.nn.utils.clip_grad_norm_`, over flat buffers.
//!
//! Per element, at step t (the optimizer's own count, from 1), for a
//! parameter whose group decays (weight decay groups: HF ReplicatedTrainer and
//! open-instruct leave biases and norm weights out, see [`Segment`]):
//! `p ← p·(1 − lr·wd)`; `m ← lerp(m, g, 1−β1)`; `v ← β2·v + (1−β2)·g²`;
//! `p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε)`.
//! Moments are float32 whatever the parameter dtype.
//!
//! The trainers keep parameters, gradients and moments as a few flat
//! tensors (ddp: one of each; zero2: this rank's shard; fsdp: one per unit
//! shard), so the update is one call per contiguous run of one decay group
//! ([`Segment`]). On float32 CPU buffers it is one pass
//! (`accrue_kernels::adamw_f32`): each element of the parameter, gradient and
//! moments is read once and written once, with the clip factor applied on
//! the fly; elsewhere (CUDA, bfloat16 parameters) it is the same sequence of
//! in-place ATen operations torch's foreach implementation runs.

pub mod kernel;
pub use kernel::StepScalars;

use std::ops::Range;

use tch::{Device, Kind, Tensor};

/// AdamW hyper-parameters (the lr comes per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// A contiguous run of a flat buffer and whether its weight decays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub range: Range<usize>,
    pub decay: bool,
}

/// Whether the parameter `name` takes weight decay under `no_decay` (a
/// parameter whose HF name contains one of the substrings does not).
pub fn decays(name: &str, no_decay: &[String]) -> bool {
    !no_decay.iter().any(|p| name.contains(p.as_str()))
}

/// The segments of `range` of a flat layout whose element `i` decays iff
/// `decay(i)` holds on runs given as `(range, decay)`, relative to
/// `range.start` (the runs need not be sorted; they must tile the layout).
pub fn segments_within(runs: &[Segment], range: Range<usize>) -> Vec<Segment> {
    let mut out: Vec<Segment> = runs
        .iter()
        .filter_map(|s| {
            let lo = s.range.start.max(range.start);
            let hi = s.range.end.min(range.end);
            (lo < hi).then(|| Segment {
                range: lo - range.start..hi - range.start,
                decay: s.decay,
            })
        })
        .collect();
    out.sort_by_key(|s| s.range.start);
    // Merge neighbours of the same group: fewer, longer calls.
    let mut merged: Vec<Segment> = Vec::with_capacity(out.len());
    for s in out {
        match merged.last_mut() {
            Some(last) if last.decay == s.decay && last.range.end == s.range.start => {
                last.range.end = s.range.end;
            }
            _ => merged.push(s),
        }
    }
    merged
}

/// AdamW state: first and second moments, one flat float32 tensor per
/// flat parameter tensor it steps (in the order given at creation).
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub exp_avg: Vec<Tensor>,
    pub exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    /// Zero moments for flat tensors of `lens` elements on `device`.
    pub fn new(cfg: AdamWConfig, lens: &[usize], device: Device) -> AdamW {
        let zeros = || {
            lens.iter()
                .map(|&n| Tensor::zeros([n as i64], (Kind::Float, device)))
                .collect::<Vec<_>>()
        };
        AdamW {
            cfg,
            step: 0,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
        }
    }

    fn scalars(&self, lr: f64, grad_scale: f64) -> StepScalars {
        let c = self.cfg;
        let t = self.step as i32;
        StepScalars {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            decay_factor: 1.0 - lr * c.weight_decay,
            step_size: lr / (1.0 - c.beta1.powi(t)),
            bias2_sqrt: (1.0 - c.beta2.powi(t)).sqrt(),
            grad_scale,
        }
    }

    /// One update of every flat parameter tensor `params[i]` (float32 or
    /// the model's dtype) from the float32 gradient `grads[i]` scaled by
    /// `grad_scale` (the clip factor), decaying only the `segments[i]`
    /// marked so. The tensors must be flat, contiguous and as long as
    /// their moments.
    pub fn update(
        &mut self,
        params: &[Tensor],
        grads: &[Tensor],
        segments: &[Vec<Segment>],
        lr: f64,
        grad_scale: f64,
    ) {
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        assert_eq!(params.len(), self.exp_avg.len(), "one moment per parameter");
        self.step += 1;
        let s = self.scalars(lr, grad_scale);
        let decay = self.cfg.weight_decay != 0.0;
        tch::no_grad(|| {
            for (i, (p, g)) in params.iter().zip(grads).enumerate() {
                let (m, v) = (&self.exp_avg[i], &self.exp_avg_sq[i]);
                for seg in &segments[i] {
                    let part =
                        |t: &Tensor| t.narrow(0, seg.range.start as i64, seg.range.len() as i64);
                    kernel::adamw(
                        &part(p),
                        &part(g),
                        &part(m),
                        &part(v),
                        &s,
                        decay && seg.decay,
                    );
                }
            }
        });
    }
}

/// Σ g² over the given gradients (f64): a rank's share of the squared
/// global norm, summed across ranks before the square root.
pub fn sum_of_squares(grads: &[Tensor]) -> f64 {
    grads
        .iter()
        .filter(|g| g.defined() && g.numel() > 0)
        .map(kernel::sum_sq)
        .sum()
}

/// The factor `clip_grad_norm_` scales the gradients by for a global
/// `norm` (it multiplies even when the factor is 1), or `None` when
/// clipping is off (`max_norm` 0). Both trainers clip with it.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    (max_norm > 0.0).then(|| (max_norm / (norm + 1e-6)).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_cut_to_a_range_and_merged() {
        let runs = vec![
            Segment {
                range: 10..20,
                decay: false,
            },
            Segment {
                range: 0..6,
                decay: true,
            },
            Segment {
                range: 6..10,
                decay: true,
            },
        ];
        assert_eq!(
            segments_within(&runs, 3..15),
            vec![
                Segment {
                    range: 0..7,
                    decay: true
                },
                Segment {
                    range: 7..12,
                    decay: false
                }
            ]
        );
        assert!(segments_within(&runs, 20..20).is_empty());
        let no = vec!["bias".to_string(), "norm".to_string()];
        assert!(decays("model.layers.0.mlp.up_proj.weight", &no));
        assert!(!decays("model.layers.0.self_attn.q_proj.bias", &no));
        assert!(!decays(
            "model.layers.3.post_attention_layernorm.weight",
            &no
        ));
        assert!(!decays("model.norm.weight", &no));
        assert!(decays("model.norm.weight", &[]));
    }
}
