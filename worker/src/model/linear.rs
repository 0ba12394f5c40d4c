//! The model's linear layers: HF's `weight: [out, in]` layout, several
//! linears sharing an input run as one matmul, and PEFT's LoRA adapter on
//! the layers a `[lora]` job targets (`x Wᵀ + s · (x Aᵀ) Bᵀ`, see
//! [`super::lora`]).

use tch::{nn, Tensor};

use super::adapter::Adapter;

/// A linear layer, with a LoRA adapter when its module is targeted.
#[derive(Debug)]
pub struct Linear {
    pub base: nn::Linear,
    pub adapter: Option<Adapter>,
}

impl Linear {
    /// `x Wᵀ (+ b)`, plus the adapter's output when it has one and
    /// adapters are on.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        use tch::nn::Module;
        let y = self.base.forward(x);
        match self.active() {
            Some(a) => a.add_to(y, x),
            None => y,
        }
    }

    /// The adapter when it takes part in this forward.
    fn active(&self) -> Option<&Adapter> {
        self.adapter.as_ref().filter(|a| a.enabled())
    }

    /// `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.base.ws
    }
}

/// A linear layer (`weight: [out, in]`), zero until [`super::init`] or a
/// checkpoint fills it.
pub(crate) fn linear(p: nn::Path, inp: usize, out: usize, bias: bool) -> Linear {
    let ws = p.var("weight", &[out as i64, inp as i64], nn::Init::Const(0.0));
    let bs = bias.then(|| p.var("bias", &[out as i64], nn::Init::Const(0.0)));
    Linear {
        base: nn::Linear { ws, bs },
        adapter: None,
    }
}

/// Below this many rows the weight concatenation (a copy of every weight
/// per call) costs more than the matmul launches it saves: generation's
/// decode steps (one row per sequence) run the linears one by one.
const FUSE_MIN_ROWS: i64 = 64;

/// `x Wᵀ (+ b)` for several linears sharing the input `x`, as one matmul
/// over their concatenated weights: outputs side by side, `[T, Σ out]`.
/// Adapters add their outputs to their own layer's columns.
pub(crate) fn fused_linear(x: &Tensor, layers: &[&Linear]) -> Tensor {
    if x.size()[0] < FUSE_MIN_ROWS {
        let outs: Vec<Tensor> = layers.iter().map(|l| l.forward(x)).collect();
        return Tensor::cat(&outs, 1);
    }
    let y = fused_base(x, layers);
    if layers.iter().all(|l| l.active().is_none()) {
        return y;
    }
    let sizes: Vec<i64> = layers.iter().map(|l| l.base.ws.size()[0]).collect();
    let parts: Vec<Tensor> = y
        .split_with_sizes(&sizes, 1)
        .into_iter()
        .zip(layers)
        .map(|(p, l)| match l.active() {
            Some(a) => a.add_to(p, x),
            None => p,
        })
        .collect();
    Tensor::cat(&parts, 1)
}

/// The base layers' outputs (no adapter) as one matmul.
fn fused_base(x: &Tensor, layers: &[&Linear]) -> Tensor {
    let w = Tensor::cat(&layers.iter().map(|l| &l.base.ws).collect::<Vec<_>>(), 0);
    let y = x.matmul(&w.tr());
    if layers.iter().all(|l| l.base.bs.is_some()) {
        let b = Tensor::cat(
            &layers
                .iter()
                .filter_map(|l| l.base.bs.as_ref())
                .collect::<Vec<_>>(),
            0,
        );
        y + b
    } else if layers.iter().any(|l| l.base.bs.is_some()) {
        // Mixed biases (not a Llama/Qwen2 layout): add each where it is.
        let sizes: Vec<i64> = layers.iter().map(|l| l.base.ws.size()[0]).collect();
        let parts: Vec<Tensor> = y
            .split_with_sizes(&sizes, 1)
            .into_iter()
            .zip(layers)
            .map(|(p, l)| match &l.base.bs {
                Some(b) => p + b,
                None => p,
            })
            .collect();
        Tensor::cat(&parts, 1)
    } else {
        y
    }
}
