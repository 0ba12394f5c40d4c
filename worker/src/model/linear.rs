//! The model's linear layers: HF's `weight: [out, in]` layout, and several
//! linears sharing an input run as one matmul.

use tch::{nn, Tensor};

/// A linear layer (`weight: [out, in]`), zero until [`super::init`] or a
/// checkpoint fills it.
pub(crate) fn linear(p: nn::Path, inp: usize, out: usize, bias: bool) -> nn::Linear {
    let ws = p.var("weight", &[out as i64, inp as i64], nn::Init::Const(0.0));
    let bs = bias.then(|| p.var("bias", &[out as i64], nn::Init::Const(0.0)));
    nn::Linear { ws, bs }
}

/// Below this many rows the weight concatenation (a copy of every weight
/// per call) costs more than the matmul launches it saves: generation's
/// decode steps (one row per sequence) run the linears one by one.
const FUSE_MIN_ROWS: i64 = 64;

/// `x Wᵀ (+ b)` for several linears sharing the input `x`, as one matmul
/// over their concatenated weights: outputs side by side, `[T, Σ out]`.
pub(crate) fn fused_linear(x: &Tensor, layers: &[&nn::Linear]) -> Tensor {
    if x.size()[0] < FUSE_MIN_ROWS {
        use tch::nn::Module;
        let outs: Vec<Tensor> = layers.iter().map(|l| l.forward(x)).collect();
        return Tensor::cat(&outs, 1);
    }
    let w = Tensor::cat(&layers.iter().map(|l| &l.ws).collect::<Vec<_>>(), 0);
    let y = x.matmul(&w.tr());
    if layers.iter().all(|l| l.bs.is_some()) {
        let b = Tensor::cat(
            &layers
                .iter()
                .filter_map(|l| l.bs.as_ref())
                .collect::<Vec<_>>(),
            0,
        );
        y + b
    } else if layers.iter().any(|l| l.bs.is_some()) {
        // Mixed biases (not a Llama/Qwen2 layout): add each where it is.
        let sizes: Vec<i64> = layers.iter().map(|l| l.ws.size()[0]).collect();
        let parts: Vec<Tensor> = y
            .split_with_sizes(&sizes, 1)
            .into_iter()
            .zip(layers)
            .map(|(p, l)| match &l.bs {
                Some(b) => p + b,
                None => p,
            })
            .collect();
        Tensor::cat(&parts, 1)
    } else {
        y
    }
}
