//! The Llama-family decoder (Llama 2/3, Qwen2) over one packed row, built
//! from a HF `config.json` with parameter paths equal to the HF checkpoint
//! keys (`model.layers.{i}.self_attn.q_proj.weight`, …). Follows
//! transformers' `modeling_llama.py` and tch-rs `examples/llama`.
//!
//! Random init matches HF `_init_weights` (see [`super::init`]): drawn from
//! a private generator per parameter, never libtorch's global one.

use tch::{nn, Device, Kind, Tensor};

use super::attention::{Attention, PackedAttention};
use super::config::LlamaConfig;
use super::init::{fill_weights, Init};
use super::mlp::Mlp;
use super::norm::RmsNorm;
use super::rope::Rope;

/// One transformer block: pre-norm attention and pre-norm MLP, residuals.
#[derive(Debug)]
pub struct DecoderLayer {
    pub(super) input_layernorm: RmsNorm,
    pub(super) self_attn: Attention,
    pub(super) post_attention_layernorm: RmsNorm,
    pub(super) mlp: Mlp,
}

impl DecoderLayer {
    pub fn new(p: nn::Path, cfg: &LlamaConfig) -> DecoderLayer {
        DecoderLayer {
            input_layernorm: RmsNorm::new(
                &p / "input_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            ),
            self_attn: Attention::new(&p / "self_attn", cfg),
            post_attention_layernorm: RmsNorm::new(
                &p / "post_attention_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            ),
            mlp: Mlp::new(&p / "mlp", cfg),
        }
    }

    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seq_lens: &[i64],
        mode: PackedAttention,
    ) -> Tensor {
        let h = x + self.self_attn.forward(
            &self.input_layernorm.forward(x),
            cos,
            sin,
            cu_seq_lens,
            mode,
        );
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h))
    }
}

/// The decoder and its LM head. Owns the variables (a `VarStore` whose names
/// are the HF keys).
pub struct Llama {
    pub vs: nn::VarStore,
    pub cfg: LlamaConfig,
    /// The `config.json` as read, written back on save.
    pub raw_config: serde_json::Value,
    pub(super) embed_tokens: Tensor,
    pub(super) layers: Vec<DecoderLayer>,
    pub(super) norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    pub(super) lm_head: Option<Tensor>,
    pub(super) rope: Rope,
    pub attention: PackedAttention,
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
        cfg: LlamaConfig,
        raw_config: serde_json::Value,
        kind: Kind,
        device: Device,
        init: Init,
    ) -> anyhow::Result<Llama> {
        cfg.validate()?;
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
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(&model / "layers" / i, &cfg))
            .collect();
        let norm = RmsNorm::new(&model / "norm", cfg.hidden_size, cfg.rms_norm_eps);
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
        let (theta, scaling) = cfg.rope()?;
        let rope = Rope::new(cfg.head_dim(), theta, &scaling);
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
            rope,
            attention: PackedAttention::default(),
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

    /// Final hidden states `[T, H]` of a packed row. Positions restart at 0
    /// in every document; attention never crosses `cu_seq_lens` boundaries.
    pub fn hidden(&self, input_ids: &[i64], cu_seq_lens: &[i64]) -> Tensor {
        let device = self.vs.device();
        let positions = positions(cu_seq_lens);
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind(), device);
        let ids = Tensor::from_slice(input_ids).to_device(device);
        let mut x = Tensor::embedding(&self.embed_tokens, &ids, -1, false, false);
        for layer in &self.layers {
            x = layer.forward(&x, &cos, &sin, cu_seq_lens, self.attention);
        }
        self.norm.forward(&x)
    }

    /// Full logits `[T, V]` in float32 (evaluation and tests only: the
    /// trainer never materialises them, see `loss`).
    pub fn logits(&self, input_ids: &[i64], cu_seq_lens: &[i64]) -> Tensor {
        let h = self.hidden(input_ids, cu_seq_lens);
        h.matmul(&self.lm_head_weight().tr()).to_kind(Kind::Float)
    }
}

/// Per-token positions, restarting at 0 at every document boundary.
pub fn positions(cu_seq_lens: &[i64]) -> Vec<i64> {
    cu_seq_lens
        .windows(2)
        .flat_map(|w| 0..(w[1] - w[0]))
        .collect()
}
