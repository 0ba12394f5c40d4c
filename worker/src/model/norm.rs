//! RMSNorm as in HF `LlamaRMSNorm`: normalise in float32, scale in the
//! parameter dtype.

use tch::{nn, Kind, Tensor};

/// `weight * x / sqrt(mean(x^2) + eps)`.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(p: nn::Path, size: usize, eps: f64) -> RmsNorm {
        let weight = p.var("weight", &[size as i64], nn::Init::Const(1.0));
        RmsNorm { weight, eps }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let xf = x.to_kind(Kind::Float);
        let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = xf * (var + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}
