//! RMSNorm as in HF `LlamaRMSNorm` (normalise in float32, scale in the
//! parameter dtype) or, for Gemma, `Gemma3RMSNorm` (weights are offsets
//! from 1 and the scaling is done in float32 before the cast back).

use tch::{nn, Kind, Tensor};

/// `weight * x / sqrt(mean(x^2) + eps)`, or `(1 + weight) * …`.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
    plus_one: bool,
}

impl RmsNorm {
    pub fn new(p: nn::Path, size: usize, eps: f64) -> RmsNorm {
        Self::with(p, size, eps, false)
    }

    /// `plus_one`: Gemma's `(1 + w)` form, whose weights start at 0.
    pub fn with(p: nn::Path, size: usize, eps: f64, plus_one: bool) -> RmsNorm {
        let init = if plus_one { 0.0 } else { 1.0 };
        let weight = p.var("weight", &[size as i64], nn::Init::Const(init));
        RmsNorm {
            weight,
            eps,
            plus_one,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = x.to_kind(Kind::Float);
        let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = xf * (var + self.eps).rsqrt();
        if self.plus_one {
            (normed * (self.weight.to_kind(Kind::Float) + 1.0)).to_kind(kind)
        } else {
            &self.weight * normed.to_kind(kind)
        }
    }
}
