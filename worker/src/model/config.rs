//! The Hugging Face `config.json` of a Llama-family model (Llama 2/3, Qwen2),
//! read with serde. Unknown fields are ignored on purpose: HF configs carry
//! many generation/tokenizer fields the model does not use. The raw JSON is
//! kept so a checkpoint writes back exactly what it read.
//!
//! Rope settings come in two spellings: transformers < 5 writes `rope_theta`
//! + `rope_scaling`, transformers >= 5 writes `rope_parameters`; both are read.

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

/// The fields of a HF Llama/Qwen2 `config.json` the model uses.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
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
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
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
    #[serde(default)]
    pub pad_token_id: Option<i64>,
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

/// What attention projections carry a bias.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnBias {
    pub qkv: bool,
    pub o: bool,
}

impl LlamaConfig {
    /// Reads and checks `config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<(LlamaConfig, serde_json::Value)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        let raw: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing model config {}", path.display()))?;
        let cfg: LlamaConfig = serde_json::from_value(raw.clone())
            .with_context(|| format!("model config {}", path.display()))?;
        cfg.validate()
            .with_context(|| format!("model config {}", path.display()))?;
        Ok((cfg, raw))
    }

    /// Every problem with the config, in one error.
    pub fn validate(&self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        if !matches!(self.model_type.as_str(), "llama" | "qwen2" | "mistral") {
            problems.push(format!(
                "model_type: expected llama, qwen2 or mistral, got {}",
                self.model_type
            ));
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                problems.push(format!("hidden_act: expected silu, got {act}"));
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
        if let Err(e) = self.rope() {
            problems.push(format!("{e:#}"));
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

    pub fn attn_bias(&self) -> AttnBias {
        if self.model_type == "qwen2" {
            AttnBias {
                qkv: true,
                o: false,
            }
        } else {
            AttnBias {
                qkv: self.attention_bias,
                o: self.attention_bias,
            }
        }
    }

    /// Rope base and scaling, from either spelling.
    pub fn rope(&self) -> anyhow::Result<(f64, RopeScaling)> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let theta = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or(self.rope_theta)
            .unwrap_or(10000.0);
        let Some(p) = params.filter(|p| !p.is_null()) else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |key: &str| -> anyhow::Result<f64> {
            p.get(key)
                .and_then(|v| v.as_f64())
                .with_context(|| format!("rope scaling {kind}: missing number {key}"))
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
            other => bail!("rope scaling: unsupported rope_type {other}"),
        };
        Ok((theta, scaling))
    }
}
