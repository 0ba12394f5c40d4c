//! Generation in the worker (issue 17): completions of prompts from the
//! replica's own weights, with a KV cache ([`crate::model::decode`]),
//! continuous batching ([`schedule`]) and a seeded sampler per request
//! ([`sampler`]). Each completion token comes with its log-prob under the
//! sampling policy's full distribution, which the trainer takes as
//! `old_logprobs`.

pub mod sampler;
pub mod schedule;
pub mod stop;
mod types;

pub use schedule::generate;
pub use types::{Completion, Finish, Request, SamplingParams, DEFAULT_MAX_BATCH};
