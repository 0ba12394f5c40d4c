//! Documents: the unit the data stream serves, the planner packs and a step
//! counts. A document is one SFT example, one preference pair or one rollout.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Label value that excludes a token from the loss (Hugging Face semantics).
pub const IGNORE_INDEX: i32 = -100;

/// Stable identity of a document: the index of its file in the job's
/// `data.train` list and its 1-based line (JSONL) or 1-based element (JSON
/// array). Stable across restarts and permutations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DocId {
    pub file: u32,
    pub line: u64,
}

impl fmt::Display for DocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

impl std::str::FromStr for DocId {
    type Err = String;

    /// Parses the `file:line` form [`fmt::Display`] writes.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (file, line) = s
            .split_once(':')
            .ok_or_else(|| format!("expected file:line, got {s:?}"))?;
        Ok(DocId {
            file: file
                .parse()
                .map_err(|_| format!("bad file index in {s:?}"))?,
            line: line.parse().map_err(|_| format!("bad line in {s:?}"))?,
        })
    }
}

/// One token row with labels aligned to `input_ids` (the shift to next-token
/// targets happens in the loss, as in `transformers`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Sequence {
    pub input_ids: Vec<u32>,
    pub labels: Vec<i32>,
}

impl Sequence {
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Tokens that contribute to the loss after the shift: position `t`
    /// predicts `labels[t + 1]`, so `labels[0]` never counts.
    pub fn loss_tokens(&self) -> u64 {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count() as u64
    }
}

/// A policy-gradient rollout: prompt + completion in one sequence whose
/// labels cover the completion only.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Rollout {
    pub seq: Sequence,
    pub reward: f64,
    /// Rollouts of one group (same prompt) are never split across steps.
    pub group: String,
    /// Policy version (step) that generated the rollout.
    pub policy_version: u64,
    /// Per-token log-probs under the generating policy, aligned with
    /// `seq.input_ids`, when the generator reported them.
    pub old_logprobs: Option<Vec<f32>>,
}

/// What a document holds, by objective family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DocBody {
    Sft(Sequence),
    Pair {
        chosen: Sequence,
        rejected: Sequence,
    },
    Rollout(Rollout),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Document {
    pub id: DocId,
    pub body: DocBody,
}

impl Document {
    /// The sequences the packer places, in order; a pair's two sequences
    /// always travel together in one microbatch.
    pub fn sequences(&self) -> Vec<&Sequence> {
        match &self.body {
            DocBody::Sft(s) => vec![s],
            DocBody::Pair { chosen, rejected } => vec![chosen, rejected],
            DocBody::Rollout(r) => vec![&r.seq],
        }
    }

    /// Total tokens the document occupies in a microbatch.
    pub fn tokens(&self) -> u64 {
        self.sequences().iter().map(|s| s.len() as u64).sum()
    }

    /// Loss tokens over all its sequences.
    pub fn loss_tokens(&self) -> u64 {
        self.sequences().iter().map(|s| s.loss_tokens()).sum()
    }

    /// Lengths of its sequences, in packing order.
    pub fn seq_lens(&self) -> Vec<u32> {
        self.sequences().iter().map(|s| s.len() as u32).collect()
    }

    pub fn is_pair(&self) -> bool {
        matches!(self.body, DocBody::Pair { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_tokens_skip_first_label_and_ignored() {
        let s = Sequence {
            input_ids: vec![1, 2, 3, 4],
            labels: vec![1, IGNORE_INDEX, 3, 4],
        };
        assert_eq!(s.loss_tokens(), 2);
    }

    #[test]
    fn pair_counts_both_sequences() {
        let seq = |n: usize| Sequence {
            input_ids: vec![5; n],
            labels: vec![5; n],
        };
        let d = Document {
            id: DocId { file: 0, line: 3 },
            body: DocBody::Pair {
                chosen: seq(3),
                rejected: seq(5),
            },
        };
        assert_eq!(d.tokens(), 8);
        assert_eq!(d.loss_tokens(), 6);
        assert_eq!(d.seq_lens(), vec![3, 5]);
        assert_eq!(d.id.to_string(), "0:3");
    }
}
