//! AdamW with `torch.optim.AdamW` semantics (single-tensor path) and global
//! norm clipping like `torch.nn.utils.clip_grad_norm_`.
//!
//! Per parameter, at step t (the optimizer's own count, from 1):
//! `p ← p·(1 − lr·wd)`; `m ← β1·m + (1−β1)·g`; `v ← β2·v + (1−β2)·g²`;
//! `p ← p − lr/(1−β1ᵗ) · m / (√v / √(1−β2ᵗ) + ε)`.
//! Moments are float32 whatever the parameter dtype.

use tch::{Kind, Tensor};

/// AdamW hyper-parameters (the lr comes per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// AdamW state: first and second moments per parameter, in the order of
/// the parameter list it was created with.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub exp_avg: Vec<Tensor>,
    pub exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &[Tensor]) -> AdamW {
        let zeros = || {
            params
                .iter()
                .map(|p| Tensor::zeros(p.size(), (Kind::Float, p.device())))
                .collect::<Vec<_>>()
        };
        AdamW {
            cfg,
            step: 0,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
        }
    }

    /// One update of every parameter with a defined gradient.
    pub fn step(&mut self, params: &[Tensor], lr: f64) {
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
        self.step_with_grads(params, &grads, lr);
    }

    /// One update of `params[i]` from `grads[i]` (undefined ones skipped):
    /// for sharded trainers whose gradients live in flat shards rather than
    /// in the parameters' `.grad()`.
    pub fn step_with_grads(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) {
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        let step_size = lr / bias1;
        tch::no_grad(|| {
            for (i, p) in params.iter().enumerate() {
                let g = &grads[i];
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let mut p32 = p.to_kind(Kind::Float);
                if c.weight_decay != 0.0 {
                    let _ = p32.g_mul_scalar_(1.0 - lr * c.weight_decay);
                }
                let m = &mut self.exp_avg[i];
                let _ = m.lerp_(&g, 1.0 - c.beta1);
                let v = &mut self.exp_avg_sq[i];
                let _ = v.g_mul_scalar_(c.beta2);
                let _ = v.addcmul_(&(&g * (1.0 - c.beta2)), &g);
                let denom = v.sqrt() / bias2_sqrt + c.eps;
                let _ = p32.addcdiv_(&(&*m * -step_size), &denom);
                if p.kind() != Kind::Float {
                    p.shallow_clone().copy_(&p32);
                }
            }
        });
    }
}

/// Σ g² over the given gradients (f64): a rank's share of the squared
/// global norm, summed across ranks before the square root.
pub fn sum_of_squares(grads: &[Tensor]) -> f64 {
    let parts: Vec<Tensor> = grads
        .iter()
        .filter(|g| g.defined() && g.numel() > 0)
        .map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double))
        .collect();
    if parts.is_empty() {
        return 0.0;
    }
    f64::try_from(Tensor::stack(&parts, 0).sum(Kind::Double)).unwrap_or(f64::NAN)
}

/// The factor `clip_grad_norm_` scales the gradients by for a global
/// `norm` (it multiplies even when the factor is 1), or `None` when
/// clipping is off (`max_norm` 0). Both engines clip with it.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    (max_norm > 0.0).then(|| (max_norm / (norm + 1e-6)).min(1.0))
}
