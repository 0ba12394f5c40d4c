//! The decoder of every family Accrue trains (Llama 2/3, Mistral, Qwen2,
//! Qwen3, OLMo 2, Gemma 3: [`super::config::Arch`]) over one packed row, built
//! from a HF `config.json` with parameter paths equal to the HF checkpoint
//! keys (`model.layers.{i}.self_attn.q_proj.weight`, …). Follows
//! transformers' `modeling_llama.py` and tch-rs `examples/llama`.
//!
//! Random init matches HF `_init_weights` (see [`super::init`]): drawn from
//! a private generator per parameter, never libtorch's global one.

use tch::{nn, Device, Kind, Tensor};

use super::attention::{Attention, PackedAttention};
use super::config::{Arch, LayerSpec, ModelConfig};
use super::init::{fill_weights, Init};
use super::mlp::Mlp;
use super::moe::{expert_counts, Route, Routed, Routes, SparseMoe};
use super::norm::RmsNorm;
use super::rope::Rope;

/// One transformer block: attention and MLP with residuals, each with the
/// family's norms around it (before: Llama; after: OLMo 2; both: Gemma 3).
#[derive(Debug)]
pub struct DecoderLayer {
    pub(super) attn_in: Option<RmsNorm>,
    pub(super) self_attn: Attention,
    pub(super) attn_out: Option<RmsNorm>,
    pub(super) mlp_in: Option<RmsNorm>,
    pub(super) mlp: FeedForward,
    pub(super) mlp_out: Option<RmsNorm>,
    /// Index of this layer's RoPE table (see [`Llama::rope_tables`]).
    pub rope: usize,
    /// Its index among the sparse layers (`LayerSpec::sparse`).
    pub sparse: Option<usize>,
}

/// A block's MLP: dense, or Qwen3-MoE's sparse one.
#[derive(Debug)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    fn forward(&self, x: &Tensor, route: Route<'_>) -> (Tensor, Routed) {
        match self {
            FeedForward::Dense(m) => (m.forward(x), Routed::default()),
            FeedForward::Sparse(m) => m.forward(x, route),
        }
    }
}

fn norm_opt(n: &Option<RmsNorm>, x: &Tensor) -> Tensor {
    match n {
        Some(n) => n.forward(x),
        None => x.shallow_clone(),
    }
}

impl DecoderLayer {
    pub fn new(p: nn::Path, cfg: &ModelConfig, arch: &Arch, spec: &LayerSpec) -> DecoderLayer {
        let norm = |name: Option<&str>| {
            name.map(|n| {
                RmsNorm::with(
                    &p / n,
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                    arch.norm_plus_one,
                )
            })
        };
        DecoderLayer {
            attn_in: norm(arch.norms.attn_in),
            self_attn: Attention::new(&p / "self_attn", cfg, arch, spec),
            attn_out: norm(arch.norms.attn_out),
            mlp_in: norm(arch.norms.mlp_in),
            mlp: match (&arch.moe, spec.sparse) {
                (Some(moe), Some(_)) => {
                    FeedForward::Sparse(SparseMoe::new(&p / "mlp", cfg, moe, arch.act))
                }
                _ => FeedForward::Dense(Mlp::new(&p / "mlp", cfg, arch.act)),
            },
            mlp_out: norm(arch.norms.mlp_out),
            rope: spec.rope,
            sparse: spec.sparse,
        }
    }

    /// The block over a packed row (`cu_seq_lens`), attention causal within
    /// each document.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seq_lens: &[i64],
        mode: PackedAttention,
    ) -> Tensor {
        self.forward_routed(x, cos, sin, cu_seq_lens, mode, Route::default())
            .0
    }

    /// [`Self::forward`] with the sparse MLP routed by `route`, and what it
    /// routed.
    pub fn forward_routed(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seq_lens: &[i64],
        mode: PackedAttention,
        route: Route<'_>,
    ) -> (Tensor, Routed) {
        let t = x.size()[0];
        self.forward_with_route(x, cos, sin, route, |attn, q, k, v| {
            let (heads, _, d) = attn.shape();
            attn.attend(q, k, v, cu_seq_lens, mode)
                .transpose(0, 1)
                .reshape([t, heads * d])
        })
    }

    /// The block with the attention core supplied: `core(attention, q, k,
    /// v)` gets q `[heads, T, d]`, k and v `[kv_heads, T, d]` (RoPE
    /// applied) and returns the heads' outputs `[T, heads · d]` — the
    /// packed attention in training, the KV cache in generation. Every
    /// engine runs this one definition of the block.
    pub fn forward_with(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        core: impl FnOnce(&Attention, &Tensor, &Tensor, &Tensor) -> Tensor,
    ) -> Tensor {
        self.forward_with_route(x, cos, sin, Route::default(), core)
            .0
    }

    /// [`Self::forward_with`] with the sparse MLP routed by `route`, and
    /// what it routed.
    pub fn forward_with_route(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        route: Route<'_>,
        core: impl FnOnce(&Attention, &Tensor, &Tensor, &Tensor) -> Tensor,
    ) -> (Tensor, Routed) {
        let attn = &self.self_attn;
        let (q, k, v) = attn.project(&norm_opt(&self.attn_in, x), cos, sin);
        let a = attn.output(&core(attn, &q, &k, &v));
        let h = x + norm_opt(&self.attn_out, &a);
        let (m, routed) = self.mlp.forward(&norm_opt(&self.mlp_in, &h), route);
        (&h + norm_opt(&self.mlp_out, &m), routed)
    }
}

/// The decoder and its LM head. Owns the variables (a `VarStore` whose names
/// are the HF keys).
pub struct Llama {
    pub vs: nn::VarStore,
    pub cfg: ModelConfig,
    /// The `config.json` as read, written back on save.
    pub raw_config: serde_json::Value,
    pub(super) embed_tokens: Tensor,
    pub(super) layers: Vec<DecoderLayer>,
    pub(super) norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    pub(super) lm_head: Option<Tensor>,
    /// RoPE tables (one, or Gemma 3's global and sliding).
    pub(super) ropes: Vec<Rope>,
    pub arch: Arch,
    pub attention: PackedAttention,
    /// `[lora]`: the adapters `super::lora::attach` put on (every other
    /// variable frozen).
    pub adapters: Option<super::adapter::Adapters>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Llama {
    /// Builds the model, its parameters set by `init` (HF's random init from
    /// a seed, drawn in float32 then cast to `kind`; or empty for loading,
    /// made in `kind`).
    pub fn new(
        cfg: ModelConfig,
        raw_config: serde_json::Value,
        kind: Kind,
        device: Device,
        init: Init,
    ) -> anyhow::Result<Llama> {
        cfg.validate()?;
        let arch = cfg.arch()?;
        let mut vs = nn::VarStore::new(device);
        if matches!(init, Init::Empty) {
            // Nothing is drawn: the variables are made in `kind` at once,
            // never as a transient float32 copy of the whole model.
            vs.set_kind(kind);
        }
        let root = vs.root();
        let model = &root / "model";
        let embed_tokens = (&model / "embed_tokens").var(
            "weight",
            &[cfg.vocab_size as i64, cfg.hidden_size as i64],
            nn::Init::Const(0.0),
        );
        let layers = arch
            .layers
            .iter()
            .enumerate()
            .map(|(i, spec)| DecoderLayer::new(&model / "layers" / i, &cfg, &arch, spec))
            .collect();
        let norm = RmsNorm::with(
            &model / "norm",
            cfg.hidden_size,
            cfg.rms_norm_eps,
            arch.norm_plus_one,
        );
        let lm_head = (!cfg.tie_word_embeddings).then(|| {
            (&root / "lm_head").var(
                "weight",
                &[cfg.vocab_size as i64, cfg.hidden_size as i64],
                nn::Init::Const(0.0),
            )
        });
        if let Init::Seeded(seed) = init {
            let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
            fill_weights(&vars, seed, cfg.initializer_range);
            if let Some(pad) = cfg
                .pad_token_id
                .filter(|&p| p >= 0 && (p as usize) < cfg.vocab_size)
            {
                // HF zeroes the padding row of the embedding at init.
                tch::no_grad(|| {
                    let _ = embed_tokens.get(pad).zero_();
                });
            }
        }
        let ropes = arch
            .ropes
            .iter()
            .map(|r| Rope::new(cfg.head_dim(), r.theta, &r.scaling))
            .collect();
        if kind != Kind::Float {
            vs.set_kind(kind);
        }
        Ok(Llama {
            vs,
            cfg,
            raw_config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            ropes,
            arch,
            attention: PackedAttention::default(),
            adapters: None,
        })
    }

    /// The parameter dtype.
    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    /// The LM head weight `[V, H]` (the embedding when tied).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The `(cos, sin)` tables of every RoPE the layers use, for these
    /// per-token positions (a layer takes `tables[layer.rope]`).
    pub fn rope_tables(&self, positions: &[i64]) -> Vec<(Tensor, Tensor)> {
        rope_tables(&self.ropes, positions, self.kind(), self.vs.device())
    }

    /// The embeddings of `ids` (Gemma's scaled by √hidden).
    pub fn embed(&self, ids: &Tensor) -> Tensor {
        embed(&self.embed_tokens, ids, self.arch.embed_scale)
    }

    /// Final hidden states `[T, H]` of a packed row. Positions restart at 0
    /// in every document; attention never crosses `cu_seq_lens` boundaries.
    pub fn hidden(&self, input_ids: &[i64], cu_seq_lens: &[i64]) -> Tensor {
        self.hidden_routed(input_ids, cu_seq_lens, &Routes::default())
            .hidden
    }

    /// [`Self::hidden`] with the sparse layers routed by `routes`.
    pub fn hidden_routed(
        &self,
        input_ids: &[i64],
        cu_seq_lens: &[i64],
        routes: &Routes,
    ) -> RoutedForward {
        let device = self.vs.device();
        let tables = self.rope_tables(&positions(cu_seq_lens));
        let ids = Tensor::from_slice(input_ids).to_device(device);
        let mut x = self.embed(&ids);
        let mut out = RoutedForward::default();
        for layer in &self.layers {
            let (cos, sin) = &tables[layer.rope];
            let route = routes.layer(layer.sparse);
            let (y, routed) =
                layer.forward_routed(&x, cos, sin, cu_seq_lens, self.attention, route);
            out.absorb(routed);
            x = y;
        }
        out.hidden = self.norm.forward(&x);
        out
    }

    /// Full logits `[T, V]` in float32 (evaluation and tests only: the
    /// trainer never materialises them, see `loss`).
    pub fn logits(&self, input_ids: &[i64], cu_seq_lens: &[i64]) -> Tensor {
        let h = self.hidden(input_ids, cu_seq_lens);
        let z = h.matmul(&self.lm_head_weight().tr()).to_kind(Kind::Float);
        super::loss::cap_logits(z, self.arch.final_softcap)
    }
}

/// A forward's hidden states with what its sparse layers routed.
#[derive(Debug)]
pub struct RoutedForward {
    /// After the final norm, `[T, H]`.
    pub hidden: Tensor,
    /// The load-balancing loss's part (`Route::aux`) summed over the
    /// sparse layers, in the graph.
    pub aux: Option<Tensor>,
    /// Per sparse layer, the experts each token used `[T, top_k]`.
    pub chosen: Vec<Tensor>,
}

impl Default for RoutedForward {
    fn default() -> Self {
        RoutedForward {
            hidden: Tensor::new(),
            aux: None,
            chosen: Vec::new(),
        }
    }
}

impl RoutedForward {
    /// Adds one layer's routing.
    pub fn absorb(&mut self, routed: Routed) {
        self.chosen.extend(routed.chosen);
        if let Some(a) = routed.aux {
            self.aux = Some(match self.aux.take() {
                Some(sum) => sum + a,
                None => a,
            });
        }
    }

    /// Adds how often each expert was chosen, over the sparse layers, to
    /// `counts` (one entry per expert). Counted only when asked: the
    /// load-balancing loss's pre-pass needs it, a training forward not.
    pub fn add_counts(&self, counts: &mut [i64]) -> anyhow::Result<()> {
        for chosen in &self.chosen {
            let c = expert_counts(chosen, counts.len());
            for (t, v) in counts.iter_mut().zip(Vec::<i64>::try_from(&c)?) {
                *t += v;
            }
        }
        Ok(())
    }
}

/// The `(cos, sin)` tables of `ropes` at `positions`.
pub fn rope_tables(
    ropes: &[Rope],
    positions: &[i64],
    kind: Kind,
    device: Device,
) -> Vec<(Tensor, Tensor)> {
    ropes
        .iter()
        .map(|r| r.cos_sin(positions, kind, device))
        .collect()
}

/// Rows `ids` of the embedding `weight`, times `scale` rounded to the
/// weight's dtype first (HF `Gemma3TextScaledWordEmbedding`).
pub fn embed(weight: &Tensor, ids: &Tensor, scale: Option<f64>) -> Tensor {
    let x = Tensor::embedding(weight, ids, -1, false, false);
    match scale {
        Some(s) => {
            x * Tensor::from(s as f32)
                .to_kind(weight.kind())
                .to_device(weight.device())
        }
        None => x,
    }
}

/// The embedding's gradient from the gradient of its output `grad` (what
/// autograd's embedding backward computes, with the scale).
pub fn embed_backward(grad: &Tensor, ids: &Tensor, vocab: i64, scale: Option<f64>) -> Tensor {
    let grad = match scale {
        Some(s) => {
            grad * Tensor::from(s as f32)
                .to_kind(grad.kind())
                .to_device(grad.device())
        }
        None => grad.shallow_clone(),
    };
    Tensor::embedding_dense_backward(&grad, ids, vocab, -1, false)
}

/// Per-token positions, restarting at 0 at every document boundary.
pub fn positions(cu_seq_lens: &[i64]) -> Vec<i64> {
    cu_seq_lens
        .windows(2)
        .flat_map(|w| 0..(w[1] - w[0]))
        .collect()
}
