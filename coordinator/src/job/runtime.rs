//! `[runtime]` and `[precision]`: how the workers execute a step. The
//! runtime knobs change speed and memory, never the math; precision picks
//! the dtypes of mixed-precision training.

use serde::{Deserialize, Serialize};

use crate::job::limits;
use crate::job::model::Dtype;
use crate::job::section::bound;

/// Worker-side execution knobs: they change speed and memory, never the
/// math (the loss and gradients are the same for any value).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSection {
    /// Tokens per chunk of the LM head + cross-entropy: at most
    /// `loss_chunk_tokens × vocab` logits exist at once.
    #[serde(default = "default_loss_chunk_tokens")]
    pub loss_chunk_tokens: u64,
    /// Keep only each decoder layer's input from the forward and recompute
    /// the layer during the backward (less activation memory, one more
    /// forward). fsdp always does.
    #[serde(default, skip_serializing_if = "is_false")]
    pub activation_checkpointing: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn default_loss_chunk_tokens() -> u64 {
    1024
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self {
            loss_chunk_tokens: default_loss_chunk_tokens(),
            activation_checkpointing: false,
        }
    }
}

impl RuntimeSection {
    /// The checks of `[runtime]`: a loss chunk of 1 token to a microbatch's
    /// most (a chunk never spans more than one microbatch).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.loss_chunk_tokens == 0 {
            bad("runtime.loss_chunk_tokens", "must be at least 1".into());
        }
        bound(
            bad,
            "runtime.loss_chunk_tokens",
            self.loss_chunk_tokens,
            u64::from(limits::MAX_MICROBATCH_TOKENS),
            "tokens per chunk",
        );
    }
}

/// `[precision]`: mixed precision as FSDP's `MixedPrecision` and DeepSpeed's
/// bf16 mode define it. The parameters and AdamW state stay in
/// `model.dtype` (float32 for mixed precision); forward and backward run in
/// `compute`; gradients are reduced across ranks in `reduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PrecisionSection {
    /// Forward/backward dtype; unset: `model.dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<Dtype>,
    /// Gradient reduction dtype (default float32).
    #[serde(default)]
    pub reduce: Dtype,
}

impl PrecisionSection {
    /// The forward/backward dtype for parameters in `params`
    /// (`compute`, else the parameters' own).
    pub fn compute_dtype(&self, params: Dtype) -> Dtype {
        self.compute.unwrap_or(params)
    }
}
