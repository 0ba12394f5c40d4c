//! The job this worker trains, as the coordinator resolved it
//! (`Configure.job`, see `proto/accrue/v1/job.proto`): every value set, no
//! default of its own here. Built from the wire by [`crate::convert`].

use std::path::PathBuf;

use tch::{Device, Kind};

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

/// Which backend carries a generation's collectives (`parallel.collective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveChoice {
    /// NCCL when every member is a CUDA worker that can load it, else the
    /// TCP ring.
    Auto,
    /// Always the TCP ring.
    Ring,
}

/// `[precision]` (see `proto/accrue/v1/job.proto`): parameters and AdamW
/// state in `JobConfig::dtype`, forward/backward in `compute`, gradient
/// reduction in `reduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    pub compute: Kind,
    pub reduce: Kind,
}

impl Precision {
    /// Everything in `kind` (fp32 end to end, or pure bf16 computing in
    /// its parameters' dtype), reducing in float32.
    pub fn uniform(kind: Kind) -> Precision {
        Precision {
            compute: kind,
            reduce: Kind::Float,
        }
    }
}

/// `[lora]` (see `proto/accrue/v1/job.proto`): PEFT LoRA adapters over a
/// frozen base.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: accrue_arch::lora::Targets,
    pub use_rslora: bool,
    /// A PEFT adapter folder to start from, else PEFT's initialisation.
    pub init: Option<PathBuf>,
}

impl LoraConfig {
    /// The adapters' output scale (`alpha / r`, or `/ √r` with rsLoRA).
    pub fn scaling(&self) -> f64 {
        accrue_arch::lora::scaling(self.rank, self.alpha, self.use_rslora)
    }
}

/// The resolved job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobConfig {
    /// `job.name` (checkpoint manifests record it).
    pub name: String,
    /// Seeds a random init.
    pub seed: u64,
    pub model: ModelSource,
    /// Parameter (master) dtype, also the checkpoints' and the optimizer
    /// update's: `Float` or `BFloat16`.
    pub dtype: Kind,
    /// Forward/backward and reduction dtypes.
    pub precision: Precision,
    pub objective: Objective,
    pub optimizer: AdamWConfig,
    /// Substrings of HF parameter names that take no weight decay.
    pub no_decay: Vec<String>,
    /// Global L2 norm of the gradient clip; 0 disables.
    pub grad_clip: f64,
    pub sharding: Sharding,
    pub collective: CollectiveChoice,
    /// `parallel.context`: ranks per context-parallel group (consecutive
    /// ranks: rank r is place r % context of group r / context); 1: none.
    pub context: usize,
    /// Tokens per chunk of the LM head + cross-entropy.
    pub loss_chunk_tokens: usize,
    /// Recompute each decoder layer in the backward from its saved input.
    pub activation_checkpointing: bool,
    /// Where this worker runs the job. Not the coordinator's: the runner
    /// sets it from `--device` (see `crate::device`); the wire gives CPU.
    pub device: Device,
    /// `[lora]`: only adapters train; `None`: every parameter does.
    pub lora: Option<LoraConfig>,
}

impl JobConfig {
    /// Whether forward/backward run in a dtype other than the parameters'
    /// (mixed precision: a compute copy beside float32 masters). A LoRA
    /// job has no compute copy: its frozen base is held in the compute
    /// dtype and its adapters in float32.
    pub fn mixed(&self) -> bool {
        self.precision.compute != self.dtype && self.lora.is_none()
    }
}
