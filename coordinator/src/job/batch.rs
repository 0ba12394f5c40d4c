//! `[batch]`: how big a step is, as documents, tokens or microbatches per
//! rank (exactly one), and [`StepSize`], the mode it selects. A running
//! job's size may change (`accrue set`): `crate::job::settings` owns it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BatchSection {
    /// Exactly this many documents per step (dynamic accumulation).
    #[serde(default)]
    pub docs_per_step: Option<u64>,
    /// About this many tokens per step.
    #[serde(default)]
    pub tokens_per_step: Option<u64>,
    /// Static: fill this many microbatches per rank, carry the rest over.
    #[serde(default)]
    pub microbatches_per_rank: Option<u32>,
}

impl BatchSection {
    /// The mode these fields select (valid only on a validated section).
    pub fn step_size(&self) -> StepSize {
        StepSize::of(
            self.docs_per_step,
            self.tokens_per_step,
            self.microbatches_per_rank,
        )
    }

    /// The checks of `[batch]`: one mode, each at least 1. Their upper
    /// bounds depend on `data.max_tokens` and the world too:
    /// [`crate::job::limits::check_step`].
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        let set = [
            self.docs_per_step.is_some(),
            self.tokens_per_step.is_some(),
            self.microbatches_per_rank.is_some(),
        ]
        .iter()
        .filter(|&&x| x)
        .count();
        if set != 1 {
            bad(
                "batch",
                format!("give exactly one of docs_per_step, tokens_per_step, microbatches_per_rank ({set} given)"),
            );
        }
        if self.docs_per_step == Some(0) {
            bad("batch.docs_per_step", "must be at least 1".into());
        }
        if self.tokens_per_step == Some(0) {
            bad("batch.tokens_per_step", "must be at least 1".into());
        }
        if self.microbatches_per_rank == Some(0) {
            bad("batch.microbatches_per_rank", "must be at least 1".into());
        }
    }
}

/// How a step's size is defined (exactly one per job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSize {
    Docs(u64),
    Tokens(u64),
    MicrobatchesPerRank(u32),
}

impl StepSize {
    /// The mode the `[batch]` fields select (the first one set; a
    /// validated spec sets exactly one).
    pub fn of(docs: Option<u64>, tokens: Option<u64>, microbatches: Option<u32>) -> StepSize {
        match (docs, tokens, microbatches) {
            (Some(n), _, _) => StepSize::Docs(n),
            (_, Some(t), _) => StepSize::Tokens(t),
            (_, _, Some(k)) => StepSize::MicrobatchesPerRank(k),
            _ => StepSize::Docs(1),
        }
    }

    /// `[batch]`'s three fields for this size (one set).
    pub fn fields(self) -> (Option<u64>, Option<u64>, Option<u32>) {
        match self {
            StepSize::Docs(n) => (Some(n), None, None),
            StepSize::Tokens(t) => (None, Some(t), None),
            StepSize::MicrobatchesPerRank(k) => (None, None, Some(k)),
        }
    }

    /// The documents a step takes, when counted in documents.
    pub fn docs(self) -> Option<u64> {
        match self {
            StepSize::Docs(n) => Some(n),
            _ => None,
        }
    }

    /// The rollouts a streamed or generated step takes: its documents
    /// rounded up to whole groups of `group_size` (such a job's steps are
    /// counted in documents: validation refuses any other mode).
    pub fn rollouts_needed(self, group_size: u32) -> u64 {
        crate::job::rl::step_rollouts(self.docs().unwrap_or(1), group_size)
    }
}

impl Default for StepSize {
    fn default() -> Self {
        StepSize::Docs(1)
    }
}
