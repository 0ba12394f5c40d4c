//! The sparse mixture-of-experts MLP of Qwen3-MoE (transformers'
//! `Qwen3MoeSparseMoeBlock`): a softmax router over `E` experts, the
//! `top_k` most probable per token (their probabilities renormalised when
//! `norm_topk_prob`), each a gated MLP, their outputs summed with those
//! weights. Parameters carry the hub checkpoint's names
//! (`mlp.gate.weight` `[E, H]`, `mlp.experts.{e}.{gate,up,down}_proj.weight`),
//! which is what transformers' `save_pretrained` writes.
//!
//! Tokens are sorted by expert once per call, so each expert runs one
//! matmul over its contiguous rows (no `[T, E]` dense compute, no copy of
//! the output per expert). Nothing is dropped: there is no capacity
//! factor, so a token's output never depends on the other tokens in its
//! microbatch, and the MLP's part of the update is the same whatever the
//! split (the load-balancing loss is the exception: see [`Route::aux`]).
//!
//! Two things come in through [`Route`]: routing replay (the experts a
//! generator chose for each token, used instead of the router's top-k so
//! a training forward computes the generator's policy; the weights still
//! come from this router's probabilities, which is what carries the
//! router's gradient) and the load-balancing loss's per-expert weights.

use tch::{nn, Kind, Tensor};

use super::config::{Act, Arch, ModelConfig, MoeSpec};
use super::mlp::Mlp;

/// How a forward routes a sparse layer's tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct Route<'a> {
    /// Experts per token `[T, top_k]` (int64) to use instead of the
    /// router's top-k; a row of `-1` leaves that token to the router.
    pub replay: Option<&'a Tensor>,
    /// Per-expert weights `a` `[E]` (float32) of the load-balancing loss:
    /// the forward then also returns `⟨Σ_t p_t, a⟩`, `p_t` the token's
    /// router probabilities, whose gradient is the loss's for these
    /// tokens (see `crate::train::routing`).
    pub aux: Option<&'a Tensor>,
}

/// What a sparse layer's forward routed.
#[derive(Debug, Default)]
pub struct Routed {
    /// The experts each token used, `[T, top_k]` int64 (no graph).
    pub chosen: Option<Tensor>,
    /// `⟨Σ_t p_t, route.aux⟩` (a float32 scalar in the graph) when
    /// `route.aux` was given.
    pub aux: Option<Tensor>,
}

/// The router and the experts of one layer.
#[derive(Debug)]
pub struct SparseMoe {
    /// `[E, H]`, no bias.
    gate: Tensor,
    experts: Vec<Mlp>,
    spec: MoeSpec,
}

impl SparseMoe {
    pub fn new(p: nn::Path, cfg: &ModelConfig, spec: &MoeSpec, act: Act) -> SparseMoe {
        let h = cfg.hidden_size;
        let gate = (&p / "gate").var(
            "weight",
            &[spec.experts as i64, h as i64],
            nn::Init::Const(0.0),
        );
        let experts = (0..spec.experts)
            .map(|e| Mlp::sized(&p / "experts" / e, h, spec.intermediate, false, act))
            .collect();
        SparseMoe {
            gate,
            experts,
            spec: *spec,
        }
    }

    /// The layer's output for `x` `[T, H]`, and what it routed.
    pub fn forward(&self, x: &Tensor, route: Route<'_>) -> (Tensor, Routed) {
        let t = x.size()[0];
        let k = self.spec.top_k as i64;
        let experts = self.spec.experts as i64;
        // The router in the parameter dtype, its softmax in float32 (HF).
        let logits = x.matmul(&self.gate.tr());
        let probs = logits.softmax(-1, Kind::Float);
        let chosen = tch::no_grad(|| {
            let (_, top) = probs.topk(k, -1, true, true);
            match route.replay {
                Some(r) => r.where_self(&r.ge(0), &top),
                None => top,
            }
        });
        let mut weights = probs.gather(1, &chosen, false);
        if self.spec.norm_topk_prob {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = weights.to_kind(x.kind());
        let aux = route
            .aux
            .map(|a| (probs.sum_dim_intlist(0, false, Kind::Float) * a).sum(Kind::Float));
        if t == 0 {
            let routed = Routed {
                chosen: Some(chosen),
                aux,
            };
            return (x.zeros_like(), routed);
        }
        // Rows of (token, slot) pairs sorted by expert; stable, so each
        // expert's rows keep token order.
        let flat = chosen.reshape([-1]);
        let (sorted, order) = flat.sort_stable(true, 0, false);
        let counts = Vec::<i64>::try_from(&sorted.bincount::<Tensor>(None, experts))
            .expect("bincount of int64 expert ids");
        let rows = x.index_select(0, &order.divide_scalar_mode(k, "floor"));
        let mut outs = Vec::new();
        let mut start = 0;
        for (e, &n) in counts.iter().enumerate() {
            if n > 0 {
                outs.push(self.experts[e].forward(&rows.narrow(0, start, n)));
            }
            start += n;
        }
        let ys = Tensor::cat(&outs, 0);
        // Back to (token, slot) order, weighted, summed over the slots.
        let ys = ys
            .index_select(0, &order.argsort(0, false))
            .view([t, k, -1]);
        let out = (ys * weights.unsqueeze(-1)).sum_dim_intlist(1, false, x.kind());
        let routed = Routed {
            chosen: Some(chosen),
            aux,
        };
        (out, routed)
    }
}

/// A forward's routing over every sparse layer: [`Route`] per layer.
#[derive(Debug, Default)]
pub struct Routes {
    /// Per sparse layer (in layer order), the experts to replay `[T, top_k]`
    /// int64; empty: the router decides everywhere.
    pub replay: Vec<Tensor>,
    /// The load-balancing loss's per-expert weights `[E]` (float32).
    pub aux: Option<Tensor>,
}

impl Routes {
    /// The route of the `sparse`-th sparse layer (`None`: a dense layer).
    pub fn layer(&self, sparse: Option<usize>) -> Route<'_> {
        match sparse {
            None => Route::default(),
            Some(s) => Route {
                replay: self.replay.get(s),
                aux: self.aux.as_ref(),
            },
        }
    }

    /// A copy sharing the tensors.
    pub fn shallow_clone(&self) -> Routes {
        Routes {
            replay: self.replay.iter().map(Tensor::shallow_clone).collect(),
            aux: self.aux.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// How often each expert was chosen, `[E]` int64, from a sparse layer's
/// `chosen` `[T, top_k]`.
pub fn expert_counts(chosen: &Tensor, experts: usize) -> Tensor {
    chosen
        .reshape([-1])
        .bincount::<Tensor>(None, experts as i64)
}

/// Per sparse layer of `arch`, the experts to replay `[T, top_k]`
/// (int64, on `device`) from a microbatch's flat routing (`sparse × top_k`
/// ids per token); empty routing: none. Checks the length and every id
/// (an expert of the model, or `-1`), and that the model has experts.
pub fn replay_tensors(
    routing: &[i64],
    tokens: usize,
    arch: &Arch,
    device: tch::Device,
) -> Result<Vec<Tensor>, String> {
    if routing.is_empty() {
        return Ok(Vec::new());
    }
    let (Some(spec), Some(width)) = (arch.moe, arch.routing_width()) else {
        return Err("routing given for a model without experts".into());
    };
    let k = spec.top_k;
    let sparse = width / k;
    if routing.len() != tokens * width {
        return Err(format!(
            "routing: {} expert ids for {tokens} tokens, the model routes {sparse} sparse layers × top {k} per token",
            routing.len()
        ));
    }
    if let Some(bad) = routing
        .iter()
        .find(|&&e| e < -1 || e >= spec.experts as i64)
    {
        return Err(format!(
            "routing: expert {bad} outside 0..{} (or -1)",
            spec.experts
        ));
    }
    let all = Tensor::from_slice(routing)
        .view([tokens as i64, sparse as i64, k as i64])
        .to_device(device);
    Ok((0..sparse as i64)
        .map(|s| all.select(1, s).contiguous())
        .collect())
}
