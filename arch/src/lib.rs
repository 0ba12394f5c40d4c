//! The model architectures Accrue trains, as a Hugging Face `config.json`
//! describes them: read with serde, checked, and turned into the few layer
//! variants that tell the families apart ([`Arch`]). The coordinator reads
//! it at admission (`accrue validate`/`submit` refuse a config Accrue
//! cannot train exactly, naming the field); the workers build the model
//! from it. One decoder serves every family: a family is this config plus
//! its variants, not a copy of the model.
//!
//! | family (`model_type`) | variants |
//! |---|---|
//! | `llama`, `mistral`, `qwen2` | pre-norm; q/k/v biases for Qwen2; Mistral's `sliding_window` on every layer, Qwen2's from `max_window_layers` when `use_sliding_window` |
//! | `qwen3` | + per-head q/k RMSNorm before RoPE, `head_dim` apart from `hidden_size` |
//! | `qwen3_moe` | Qwen3's attention; a sparse MLP (softmax top-k router, `norm_topk_prob`, experts) on the layers `decoder_sparse_step`/`mlp_only_layers` pick ([`MoeSpec`]) |
//! | `olmo2` | post-norm blocks (norm of the attention and MLP outputs), q/k RMSNorm over the whole projection |
//! | `gemma3_text` | norms before and after attention and MLP, `(1 + w)` RMSNorm in float32, per-head q/k norm, embeddings × √hidden, GELU-tanh, `query_pre_attn_scalar`, sliding and global layers (`layer_types`) with their own RoPE bases, `final_logit_softcapping` where set |
//!
//! Unknown fields are ignored on purpose (configs carry many generation
//! and tokenizer fields); the raw JSON is kept so a checkpoint writes back
//! what it read. Rope settings come in two spellings: transformers < 5
//! writes `rope_theta` + `rope_scaling` (Gemma 3: + `rope_local_base_freq`),
//! transformers >= 5 `rope_parameters` (Gemma 3: one per layer type).

pub mod lora;

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;
use serde_json::Value;

/// The fields of a HF `config.json` the model uses.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Gemma 3 (transformers < 5): the sliding layers' RoPE base.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama: bias on q/k/v/o. Qwen2 always has q/k/v biases (no field).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma's name for `hidden_act`.
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// `full_attention` / `sliding_attention` per layer (transformers 5).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, alias = "_sliding_window_pattern")]
    pub sliding_window_pattern: Option<usize>,
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub use_bidirectional_attention: Option<bool>,
    /// Qwen3-MoE: experts per sparse layer (transformers 5 writes
    /// `num_local_experts`, earlier versions `num_experts`).
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    pub router_aux_loss_coef: Option<f64>,
    /// transformers adds the auxiliary loss only when this is true.
    #[serde(default)]
    pub output_router_logits: Option<bool>,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_init_range() -> f64 {
    0.02
}

/// The model families Accrue trains (`model_type`).
pub const FAMILIES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "olmo2",
    "gemma3_text",
];

/// A model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Olmo2,
    Gemma3,
}

/// How RoPE frequencies are scaled (HF `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// A RoPE table's base and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// What attention projections carry a bias.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnBias {
    pub qkv: bool,
    pub o: bool,
}

/// RMSNorm of the queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head (`head_dim` weights): Qwen3, Gemma 3.
    PerHead,
    /// Over the whole projection (`heads × head_dim` weights): OLMo 2.
    Full,
}

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Silu,
    /// `gelu_pytorch_tanh`.
    GeluTanh,
}

/// Where a block's norms sit, by their HF names (`None`: no such norm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockNorms {
    /// Of the block's input, before attention.
    pub attn_in: Option<&'static str>,
    /// Of the attention's output, before the residual add.
    pub attn_out: Option<&'static str>,
    /// Of the MLP's input.
    pub mlp_in: Option<&'static str>,
    /// Of the MLP's output, before the residual add.
    pub mlp_out: Option<&'static str>,
}

/// One decoder layer's variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Keys a query may see: the `window` latest positions (itself
    /// included), or all before it.
    pub window: Option<usize>,
    /// Index into [`Arch::ropes`].
    pub rope: usize,
    /// The layer's MLP is the sparse one ([`Arch::moe`]): its index among
    /// the sparse layers (what a routing row is ordered by).
    pub sparse: Option<usize>,
}

/// A mixture-of-experts MLP (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub intermediate: usize,
    /// The chosen experts' probabilities renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// The load-balancing loss's weight: `router_aux_loss_coef` when
    /// `output_router_logits` is set (transformers adds it only then),
    /// else 0.
    pub aux_loss_coef: f64,
}

/// Everything that tells a family's decoder from Llama's.
#[derive(Debug, Clone, PartialEq)]
pub struct Arch {
    pub family: Family,
    pub bias: AttnBias,
    pub qk_norm: QkNorm,
    pub act: Act,
    pub norms: BlockNorms,
    /// RMSNorm weights are offsets from 1 (`x̂ · (1 + w)`, in float32).
    pub norm_plus_one: bool,
    /// Embeddings are multiplied by this (in the parameter dtype).
    pub embed_scale: Option<f64>,
    /// The attention's softmax scale, when not `1/√head_dim`.
    pub attn_scale: Option<f64>,
    pub layers: Vec<LayerSpec>,
    pub ropes: Vec<RopeSpec>,
    /// The sparse layers' MLP (Qwen3-MoE).
    pub moe: Option<MoeSpec>,
    /// Gemma's `final_logit_softcapping`: logits become `c·tanh(z/c)`.
    pub final_softcap: Option<f64>,
}

impl Arch {
    /// Expert ids a token's routing holds (sparse layers × `top_k`):
    /// `None` for a dense model.
    pub fn routing_width(&self) -> Option<usize> {
        let sparse = self.layers.iter().filter(|l| l.sparse.is_some()).count();
        self.moe.filter(|_| sparse > 0).map(|m| sparse * m.top_k)
    }
}

const PRE_NORM: BlockNorms = BlockNorms {
    attn_in: Some("input_layernorm"),
    attn_out: None,
    mlp_in: Some("post_attention_layernorm"),
    mlp_out: None,
};

impl ModelConfig {
    /// Reads and checks `config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<(ModelConfig, Value)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        let raw: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing model config {}", path.display()))?;
        let cfg =
            Self::from_json(&raw).with_context(|| format!("model config {}", path.display()))?;
        Ok((cfg, raw))
    }

    /// Reads and checks a parsed `config.json`.
    pub fn from_json(raw: &Value) -> anyhow::Result<ModelConfig> {
        let cfg: ModelConfig = serde_json::from_value(raw.clone())?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn family(&self) -> anyhow::Result<Family> {
        Ok(match self.model_type.as_str() {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "qwen3_moe" => Family::Qwen3Moe,
            "olmo2" => Family::Olmo2,
            "gemma3_text" => Family::Gemma3,
            "gemma3" => bail!(
                "model_type: gemma3 is the multimodal model; Accrue trains its text model (model_type gemma3_text, the config's text_config)"
            ),
            other => bail!(
                "model_type: {other} is not a family Accrue trains (it trains {})",
                FAMILIES.join(", ")
            ),
        })
    }

    /// Every problem with the config, in one error, each naming its field.
    pub fn validate(&self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        let family = match self.family() {
            Ok(f) => Some(f),
            Err(e) => {
                problems.push(format!("{e:#}"));
                None
            }
        };
        let act = self.hidden_activation.as_ref().or(self.hidden_act.as_ref());
        if let Some(a) = act {
            let ok = match family {
                Some(Family::Gemma3) => a == "gelu_pytorch_tanh",
                _ => a == "silu",
            };
            if !ok {
                let field = if self.hidden_activation.is_some() {
                    "hidden_activation"
                } else {
                    "hidden_act"
                };
                problems.push(format!(
                    "{field}: {a} is not supported for {}",
                    self.model_type
                ));
            }
        }
        if self.num_attention_heads == 0
            || !self.num_attention_heads.is_multiple_of(self.kv_heads())
        {
            problems.push(format!(
                "num_key_value_heads: {} does not divide num_attention_heads {}",
                self.kv_heads(),
                self.num_attention_heads
            ));
        }
        if self.head_dim.is_none()
            && !self
                .hidden_size
                .is_multiple_of(self.num_attention_heads.max(1))
        {
            problems.push("hidden_size: not divisible by num_attention_heads".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            problems.push(format!("head_dim: must be even, got {}", self.head_dim()));
        }
        for (field, v) in [
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            match v {
                Some(v) if !(v.is_finite() && v > 0.0) => {
                    problems.push(format!("{field}: {v} must be a positive number (or null)"))
                }
                Some(_) if family.is_some_and(|f| f != Family::Gemma3) => problems.push(format!(
                    "{field}: soft-capping is Gemma's; {} does not take it",
                    self.model_type
                )),
                // transformers' Gemma 3 attention takes no soft-cap: the
                // field would change nothing there, so a model trained
                // with it here would not be the model transformers runs.
                Some(v) if field == "attn_logit_softcapping" => problems.push(format!(
                    "{field}: {v} is ignored by transformers' Gemma 3 (its attention has no soft-cap; Gemma 3 uses q/k norms instead): set it to null"
                )),
                _ => {}
            }
        }
        if self.use_bidirectional_attention == Some(true) {
            problems.push("use_bidirectional_attention: only causal attention is trained".into());
        }
        if let Some(t) = &self.layer_types {
            if t.len() != self.num_hidden_layers {
                problems.push(format!(
                    "layer_types: {} entries for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = t
                .iter()
                .find(|s| !matches!(s.as_str(), "full_attention" | "sliding_attention"))
            {
                problems.push(format!(
                    "layer_types: {bad} is not full_attention or sliding_attention"
                ));
            }
        }
        if family == Some(Family::Qwen3Moe) {
            if let Err(e) = self.moe_spec() {
                problems.push(format!("{e:#}"));
            }
        }
        if family.is_some() {
            if let Err(e) = self.layer_windows() {
                problems.push(format!("{e:#}"));
            }
            if let Err(e) = self.rope_specs() {
                problems.push(format!("{e:#}"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            bail!("{}", problems.join("; "))
        }
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The decoder's variants (the config must have passed
    /// [`Self::validate`]).
    pub fn arch(&self) -> anyhow::Result<Arch> {
        let family = self.family()?;
        let bias = match family {
            Family::Qwen2 => AttnBias {
                qkv: true,
                o: false,
            },
            _ => AttnBias {
                qkv: self.attention_bias,
                o: self.attention_bias,
            },
        };
        let (qk_norm, norms) = match family {
            Family::Llama | Family::Mistral | Family::Qwen2 => (QkNorm::None, PRE_NORM),
            Family::Qwen3 | Family::Qwen3Moe => (QkNorm::PerHead, PRE_NORM),
            Family::Olmo2 => (
                QkNorm::Full,
                BlockNorms {
                    attn_in: None,
                    attn_out: Some("post_attention_layernorm"),
                    mlp_in: None,
                    mlp_out: Some("post_feedforward_layernorm"),
                },
            ),
            Family::Gemma3 => (
                QkNorm::PerHead,
                BlockNorms {
                    attn_in: Some("input_layernorm"),
                    attn_out: Some("post_attention_layernorm"),
                    mlp_in: Some("pre_feedforward_layernorm"),
                    mlp_out: Some("post_feedforward_layernorm"),
                },
            ),
        };
        let gemma = family == Family::Gemma3;
        let (ropes, rope_of) = self.rope_specs()?;
        let moe = match family {
            Family::Qwen3Moe => self.moe_spec()?,
            _ => None,
        };
        let mut sparse_seen = 0;
        let layers = self
            .layer_windows()?
            .into_iter()
            .zip(rope_of)
            .enumerate()
            .map(|(i, (window, rope))| {
                let sparse = (moe.is_some() && self.is_sparse(i)).then(|| {
                    sparse_seen += 1;
                    sparse_seen - 1
                });
                LayerSpec {
                    window,
                    rope,
                    sparse,
                }
            })
            .collect();
        Ok(Arch {
            family,
            bias,
            qk_norm,
            act: if gemma { Act::GeluTanh } else { Act::Silu },
            norms,
            norm_plus_one: gemma,
            embed_scale: gemma.then(|| (self.hidden_size as f64).sqrt()),
            attn_scale: if gemma {
                Some(
                    self.query_pre_attn_scalar
                        .unwrap_or(self.head_dim() as f64)
                        .powf(-0.5),
                )
            } else {
                None
            },
            layers,
            ropes,
            moe,
            final_softcap: self.final_logit_softcapping.filter(|_| gemma),
        })
    }

    /// Whether layer `i` has the sparse MLP, as transformers decides:
    /// not listed in `mlp_only_layers`, and `(i + 1)` a multiple of
    /// `decoder_sparse_step`.
    fn is_sparse(&self, i: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        !self
            .mlp_only_layers
            .as_ref()
            .is_some_and(|l| l.contains(&i))
            && (i + 1).is_multiple_of(step)
    }

    /// Qwen3-MoE's sparse MLP (transformers' defaults for absent fields);
    /// `None` with no experts (every layer dense).
    fn moe_spec(&self) -> anyhow::Result<Option<MoeSpec>> {
        let experts = self.num_experts.unwrap_or(128);
        if experts == 0 {
            return Ok(None);
        }
        if experts >= usize::from(u16::MAX) {
            bail!("num_experts: {experts} is more than Accrue routes (at most 65534)");
        }
        let top_k = self.num_experts_per_tok.unwrap_or(8);
        if top_k == 0 || top_k > experts {
            bail!("num_experts_per_tok: {top_k} must be between 1 and num_experts ({experts})");
        }
        let intermediate = self.moe_intermediate_size.unwrap_or(768);
        if intermediate == 0 {
            bail!("moe_intermediate_size: must be at least 1");
        }
        if self.decoder_sparse_step == Some(0) {
            bail!("decoder_sparse_step: must be at least 1");
        }
        let coef = self.router_aux_loss_coef.unwrap_or(0.001);
        if !coef.is_finite() || coef < 0.0 {
            bail!("router_aux_loss_coef: {coef} must be a finite number >= 0");
        }
        Ok(Some(MoeSpec {
            experts,
            top_k,
            intermediate,
            norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
            aux_loss_coef: if self.output_router_logits == Some(true) {
                coef
            } else {
                0.0
            },
        }))
    }

    /// Whether layer `i` is a sliding-window layer, as transformers decides.
    fn is_sliding(&self, i: usize, family: Family) -> bool {
        if let Some(t) = &self.layer_types {
            return t.get(i).is_some_and(|s| s == "sliding_attention");
        }
        match family {
            Family::Mistral => true,
            Family::Qwen2 | Family::Qwen3 => {
                self.use_sliding_window == Some(true)
                    && i >= self.max_window_layers.unwrap_or(self.num_hidden_layers)
            }
            // Every layer slides when the config has a window (its
            // attention takes `config.sliding_window` as it is).
            Family::Qwen3Moe => self.use_sliding_window == Some(true),
            Family::Gemma3 => {
                let pattern = self.sliding_window_pattern.unwrap_or(6).max(1);
                !(i + 1).is_multiple_of(pattern)
            }
            Family::Llama | Family::Olmo2 => false,
        }
    }

    /// Each layer's attention window.
    fn layer_windows(&self) -> anyhow::Result<Vec<Option<usize>>> {
        let family = self.family()?;
        (0..self.num_hidden_layers)
            .map(|i| {
                if !self.is_sliding(i, family) {
                    return Ok(None);
                }
                match self.sliding_window {
                    Some(0) => bail!("sliding_window: must be at least 1"),
                    Some(w) => Ok(Some(w)),
                    // Mistral without a window attends to everything.
                    None if family == Family::Mistral => Ok(None),
                    None => bail!(
                        "sliding_window: layer {i} is a sliding layer but no sliding_window is set"
                    ),
                }
            })
            .collect()
    }

    /// The RoPE tables and each layer's table: one for most families;
    /// Gemma 3's sliding and global layers each have their own.
    fn rope_specs(&self) -> anyhow::Result<(Vec<RopeSpec>, Vec<usize>)> {
        let family = self.family()?;
        let n = self.num_hidden_layers;
        if family != Family::Gemma3 {
            let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
            let spec = rope_spec(params, self.rope_theta, "rope_parameters")?;
            return Ok((vec![spec], vec![0; n]));
        }
        // Gemma 3: per layer type in transformers 5, else global
        // rope_theta + rope_scaling and local rope_local_base_freq.
        let per_type = self
            .rope_parameters
            .as_ref()
            .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
        let (full, sliding) = match per_type {
            Some(p) => (
                rope_spec(
                    p.get("full_attention"),
                    None,
                    "rope_parameters.full_attention",
                )?,
                rope_spec(
                    p.get("sliding_attention"),
                    None,
                    "rope_parameters.sliding_attention",
                )?,
            ),
            None => (
                rope_spec(
                    self.rope_parameters.as_ref().or(self.rope_scaling.as_ref()),
                    self.rope_theta.or(Some(1_000_000.0)),
                    "rope_scaling",
                )?,
                RopeSpec {
                    theta: self.rope_local_base_freq.unwrap_or(10_000.0),
                    scaling: RopeScaling::None,
                },
            ),
        };
        let of = (0..n)
            .map(|i| usize::from(self.is_sliding(i, family)))
            .collect();
        Ok((vec![full, sliding], of))
    }
}

/// A RoPE spec from a `rope_parameters`/`rope_scaling` object (`theta`:
/// the top-level `rope_theta` when the object has none).
fn rope_spec(params: Option<&Value>, theta: Option<f64>, field: &str) -> anyhow::Result<RopeSpec> {
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or(theta)
        .unwrap_or(10000.0);
    let Some(p) = params.filter(|p| !p.is_null()) else {
        return Ok(RopeSpec {
            theta,
            scaling: RopeScaling::None,
        });
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> anyhow::Result<f64> {
        p.get(key)
            .and_then(Value::as_f64)
            .with_context(|| format!("{field}: rope_type {kind} needs a number {key}"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => {
            bail!("{field}: rope_type {other} is not supported (default, linear and llama3 are)")
        }
    };
    Ok(RopeSpec { theta, scaling })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(extra: Value) -> anyhow::Result<ModelConfig> {
        let mut v = json!({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&v)
    }

    /// A config Accrue cannot train exactly is refused naming the field.
    #[test]
    fn unsupported_configs_name_the_field() {
        let e = |v| format!("{:#}", cfg(v).unwrap_err());
        assert!(e(json!({"model_type": "phi3"})).contains("model_type: phi3"));
        assert!(e(json!({"model_type": "gemma3"})).contains("gemma3_text"));
        assert!(
            e(json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
                .contains("rope_type yarn")
        );
        assert!(
            e(json!({"model_type": "llama", "final_logit_softcapping": 30.0}))
                .contains("final_logit_softcapping: soft-capping is Gemma's")
        );
        assert!(
            e(json!({"model_type": "gemma3_text", "attn_logit_softcapping": -1.0}))
                .contains("attn_logit_softcapping: -1 must be a positive number")
        );
        assert!(
            e(json!({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}))
                .contains("ignored by transformers' Gemma 3")
        );
        let g = cfg(
            json!({"model_type": "gemma3_text", "final_logit_softcapping": 30.0,
            "sliding_window": 4}),
        )
        .unwrap()
        .arch()
        .unwrap();
        assert_eq!(g.final_softcap, Some(30.0));
        assert!(e(json!({"hidden_act": "gelu"})).contains("hidden_act: gelu"));
        assert!(e(
            json!({"model_type": "qwen2", "use_sliding_window": true, "max_window_layers": 2})
        )
        .contains("sliding_window"));
        assert!(e(json!({"layer_types": ["full_attention"]})).contains("layer_types: 1 entries"));
        assert!(
            e(json!({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5}))
                .contains("num_experts_per_tok: 5")
        );
    }

    /// Sparse layers and the load-balancing loss as transformers decides
    /// them; both spellings of the expert count.
    #[test]
    fn qwen3_moe_sparse_layers_and_aux_loss() {
        let m = cfg(json!({"model_type": "qwen3_moe", "num_local_experts": 16,
            "num_experts_per_tok": 4, "moe_intermediate_size": 8, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "router_aux_loss_coef": 0.5, "output_router_logits": true}))
        .unwrap()
        .arch()
        .unwrap();
        let sparse: Vec<Option<usize>> = m.layers.iter().map(|l| l.sparse).collect();
        assert_eq!(sparse, [None, Some(0), None, None]);
        assert_eq!(m.routing_width(), Some(4));
        let spec = m.moe.unwrap();
        assert_eq!((spec.experts, spec.top_k, spec.intermediate), (16, 4, 8));
        assert_eq!(spec.aux_loss_coef, 0.5);
        assert_eq!(m.qk_norm, QkNorm::PerHead);
        // Without output_router_logits transformers adds no aux loss.
        let q = cfg(json!({"model_type": "qwen3_moe", "num_experts": 8}))
            .unwrap()
            .arch()
            .unwrap();
        assert_eq!(q.moe.unwrap().aux_loss_coef, 0.0);
        assert!(q.layers.iter().all(|l| l.sparse.is_some()));
        let dense = cfg(json!({"model_type": "qwen3"})).unwrap().arch().unwrap();
        assert!(dense.moe.is_none() && dense.layers.iter().all(|l| l.sparse.is_none()));
        assert_eq!(dense.routing_width(), None);
    }

    #[test]
    fn families_get_their_variants() {
        let g = cfg(
            json!({"model_type": "gemma3_text", "sliding_window": 4, "head_dim": 4,
            "query_pre_attn_scalar": 16, "sliding_window_pattern": 2, "rope_theta": 1e6,
            "rope_local_base_freq": 1e4}),
        )
        .unwrap()
        .arch()
        .unwrap();
        assert_eq!(g.qk_norm, QkNorm::PerHead);
        assert!(g.norm_plus_one);
        assert_eq!(g.attn_scale, Some(0.25));
        assert_eq!(g.embed_scale, Some(8f64.sqrt()));
        let w: Vec<_> = g.layers.iter().map(|l| (l.window, l.rope)).collect();
        assert_eq!(w, [(Some(4), 1), (None, 0), (Some(4), 1), (None, 0)]);
        assert_eq!(g.ropes[0].theta, 1e6);
        assert_eq!(g.ropes[1].theta, 1e4);
        let o = cfg(json!({"model_type": "olmo2"})).unwrap().arch().unwrap();
        assert_eq!(o.qk_norm, QkNorm::Full);
        assert_eq!(o.norms.attn_in, None);
        let m = cfg(json!({"model_type": "mistral", "sliding_window": 3}))
            .unwrap()
            .arch()
            .unwrap();
        assert!(m.layers.iter().all(|l| l.window == Some(3)));
        let q = cfg(json!({"model_type": "qwen2", "use_sliding_window": true,
            "max_window_layers": 2, "sliding_window": 5}))
        .unwrap()
        .arch()
        .unwrap();
        let w: Vec<_> = q.layers.iter().map(|l| l.window).collect();
        assert_eq!(w, [None, None, Some(5), Some(5)]);
        assert!(q.bias.qkv && !q.bias.o);
    }
}
