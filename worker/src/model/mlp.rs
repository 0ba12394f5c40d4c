//! SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` (HF `LlamaMLP`).

use tch::{nn, Tensor};

use super::config::LlamaConfig;
use super::linear::{fused_linear, linear};

#[derive(Debug)]
pub struct Mlp {
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
}

impl Mlp {
    pub fn new(p: nn::Path, cfg: &LlamaConfig) -> Mlp {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Mlp {
            gate_proj: linear(&p / "gate_proj", h, i, cfg.mlp_bias),
            up_proj: linear(&p / "up_proj", h, i, cfg.mlp_bias),
            down_proj: linear(&p / "down_proj", i, h, cfg.mlp_bias),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        use tch::nn::Module;
        // gate and up as one matmul (weights concatenated at run time).
        let gu = fused_linear(x, &[&self.gate_proj, &self.up_proj]);
        let i = self.gate_proj.ws.size()[0];
        let gated = gu.narrow(1, 0, i).silu() * gu.narrow(1, i, i);
        self.down_proj.forward(&gated)
    }
}
