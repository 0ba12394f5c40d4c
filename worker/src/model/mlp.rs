//! Gated feed-forward: `down(act(gate(x)) * up(x))` with SiLU (HF
//! `LlamaMLP`) or GELU-tanh (Gemma).

use tch::{nn, Tensor};

use super::config::{Act, ModelConfig};
use super::linear::{fused_linear, linear, Linear};

#[derive(Debug)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Act,
}

impl Mlp {
    pub fn new(p: nn::Path, cfg: &ModelConfig, act: Act) -> Mlp {
        Self::sized(p, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, act)
    }

    /// Hidden size `h`, intermediate size `i` (a MoE expert's own).
    pub fn sized(p: nn::Path, h: usize, i: usize, bias: bool, act: Act) -> Mlp {
        Mlp {
            gate_proj: linear(&p / "gate_proj", h, i, bias),
            up_proj: linear(&p / "up_proj", h, i, bias),
            down_proj: linear(&p / "down_proj", i, h, bias),
            act,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        // gate and up as one matmul (weights concatenated at run time).
        let gu = fused_linear(x, &[&self.gate_proj, &self.up_proj]);
        let i = self.gate_proj.weight().size()[0];
        let gate = gu.narrow(1, 0, i);
        let gate = match self.act {
            Act::Silu => gate.silu(),
            Act::GeluTanh => gate.gelu("tanh"),
        };
        self.down_proj.forward(&(gate * gu.narrow(1, i, i)))
    }

    /// The projections by their HF names.
    pub(super) fn linears(&self) -> [(&'static str, &Linear); 3] {
        [
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ]
    }

    /// The projections by their HF names (where LoRA adapters attach).
    pub(super) fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 3] {
        [
            ("gate_proj", &mut self.gate_proj),
            ("up_proj", &mut self.up_proj),
            ("down_proj", &mut self.down_proj),
        ]
    }
}
