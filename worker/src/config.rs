//! The parts of the job spec a worker needs, read from the `spec_toml` the
//! coordinator sends in `Configure` (already validated, paths absolute).
//! Unknown fields are ignored here on purpose: the coordinator owns the
//! spec's schema; the worker reads only what it uses.

use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct JobConfig {
    pub job: Job,
    pub model: Model,
    #[serde(default)]
    pub optimizer: Optimizer,
    #[serde(default)]
    pub parallel: Parallel,
    #[serde(default)]
    pub runtime: Runtime,
    #[serde(default)]
    pub objective: ObjectiveConfig,
}

/// `[objective]`: absent fields take the coordinator spec's defaults
/// (`coordinator/src/objective.rs`; the coordinator validated them).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct ObjectiveConfig {
    /// "sft" (default), "dpo" or "pg".
    #[serde(default)]
    pub kind: Option<String>,
    pub beta: Option<f64>,
    pub loss: Option<String>,
    pub label_smoothing: Option<f64>,
    /// "cached" (default) or "live".
    pub reference: Option<String>,
    pub clip_ratio: Option<f64>,
    pub kl_coef: Option<f64>,
    /// "token" (default), "sequence" or "constant".
    pub loss_normalization: Option<String>,
    pub normalization_constant: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Job {
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    pub output_dir: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Model {
    /// "random" or a Hugging Face checkpoint directory.
    pub init: String,
    #[serde(default)]
    pub config: Option<PathBuf>,
    #[serde(default = "default_dtype")]
    pub dtype: String,
}

fn default_dtype() -> String {
    "float32".into()
}

#[derive(Debug, Clone, Deserialize)]
pub struct Optimizer {
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
    /// Global L2 norm; 0 disables.
    #[serde(default = "default_clip")]
    pub grad_clip: f64,
}

fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}
fn default_clip() -> f64 {
    1.0
}

impl Default for Optimizer {
    fn default() -> Self {
        Self {
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: 0.0,
            grad_clip: default_clip(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
pub struct Parallel {
    #[serde(default)]
    pub sharding: String,
}

/// Worker-side knobs (not part of the coordinator's spec yet; defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct Runtime {
    /// Tokens per chunk of the LM head + cross-entropy.
    #[serde(default = "default_loss_chunk")]
    pub loss_chunk_tokens: usize,
}

fn default_loss_chunk() -> usize {
    1024
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            loss_chunk_tokens: default_loss_chunk(),
        }
    }
}

impl JobConfig {
    pub fn from_toml(text: &str) -> Result<JobConfig, toml::de::Error> {
        toml::from_str(text)
    }
}
