//! What a verifier scores and what it gives back.

use std::collections::BTreeMap;

use serde::Serialize;

/// One thing to score.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub reference: &'a str,
}

/// A completion's score.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Score {
    pub reward: f64,
    /// Named parts of the reward (what went into it).
    pub components: BTreeMap<String, f64>,
    /// Whether the answer was right, where the verifier can tell.
    pub correct: Option<bool>,
}

/// Why a batch could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("rl.verifier: {0}")]
    Config(String),
    #[error("verifier command {program:?}: {error}")]
    Command {
        program: String,
        error: super::command_error::CommandError,
    },
}

impl VerifyError {
    /// The sample (index in the batch) the error is about, if one.
    pub fn sample(&self) -> Option<usize> {
        match self {
            VerifyError::Command { error, .. } => error.sample(),
            VerifyError::Config(_) => None,
        }
    }
}
