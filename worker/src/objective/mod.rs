//! Objective math on per-sequence and per-token scalars (no tensors): the
//! DPO family over pairs and the policy-gradient loss over rollouts. Each
//! returns the loss and its derivative with respect to the log-probs, which
//! the trainer turns into per-token weights for the chunked LM head (the
//! gradient of `Σ_t w_t·nll_t` with respect to `logp_t` is `−w_t`), so the
//! `[tokens, vocab]` logits are never materialised for these objectives
//! either.

pub mod dpo;
pub mod head;
mod kind;
mod math;
pub mod microbatch;
pub mod pg;

pub use kind::{Normalization, Objective};
pub use math::{log_sigmoid, sigmoid};
