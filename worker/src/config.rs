//! The job this worker trains, as the coordinator resolved it
//! (`Configure.job`, see `proto/accrue/v1/job.proto`): every value set, no
//! default of its own here. Built from the wire by [`crate::convert`].

use std::path::PathBuf;

use tch::Kind;

use crate::objective::Objective;
use crate::train::optim::AdamWConfig;

/// Where the model's initial weights come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// HF's random init from the job's seed, for this `config.json`.
    Random { config: PathBuf },
    /// A Hugging Face model directory (config.json + safetensors).
    Checkpoint(PathBuf),
}

/// How the replicas share state (`parallel.sharding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Replicated parameters and optimizer state; gradients all-reduced.
    Ddp,
    /// Replicated parameters; gradients reduce-scattered, optimizer state
    /// sharded by flat element range.
    Zero2,
    /// Parameters, gradients and optimizer state sharded per unit
    /// (`train::fsdp`).
    Fsdp,
}

/// The resolved job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobConfig {
    /// `job.name` (checkpoint manifests record it).
    pub name: String,
    /// Seeds a random init.
    pub seed: u64,
    pub model: ModelSource,
    /// Parameter and compute dtype: `Float` or `BFloat16`.
    pub dtype: Kind,
    pub objective: Objective,
    pub optimizer: AdamWConfig,
    /// Global L2 norm of the gradient clip; 0 disables.
    pub grad_clip: f64,
    pub sharding: Sharding,
    /// Tokens per chunk of the LM head + cross-entropy.
    pub loss_chunk_tokens: usize,
}
