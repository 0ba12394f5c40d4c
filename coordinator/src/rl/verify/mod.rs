//! Verifiers: the rewards of the RL loop (issue 17). A verifier scores a
//! batch of (prompt, completion, reference) triples; each score is a reward
//! and its named components (step metrics `reward/<component>`), plus
//! whether the completion was right where the verifier can tell (accuracy).
//!
//! Built in: `exact` (the completion equals the reference, trimmed: the
//! synthetic arithmetic task), `gsm8k` (the last number of the completion
//! equals the number after `####` in the reference, normalised as
//! open-instruct / lm-eval do), `regex` (a format reward: 1 when the
//! completion matches a pattern). Any kind may add a format component
//! (`format_pattern`, weighted by `format_weight`). `command` runs a user
//! program (see [`command`]).
//!
//! Pure apart from `command`, which the shell runs off the state lock (in
//! a process group of its own, `process`, with a cleared environment and
//! bounded output: see [`command`]).

mod builtin;
pub mod command;
mod command_error;
pub(crate) mod process;
mod sample;
mod verifier;

pub use builtin::{gsm8k_reference, last_number, normalize_number};
pub use sample::{Sample, Score, VerifyError};
pub use verifier::{truncate_at_stop, Verifier};

#[cfg(test)]
mod tests;
