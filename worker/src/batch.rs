//! What the worker trains on, shared by every layer above it (the model's
//! objectives, the engines, the runner): a packed microbatch and what the
//! plan says about its sequences, the step's normalisers, and what a
//! microbatch or a reference pass reports. Decoded from the wire by
//! [`crate::convert`]; imports nothing of the worker but its error type.

use std::collections::BTreeMap;

use crate::error::StepError;

fn invalid(msg: String) -> StepError {
    StepError::InvalidPlan(msg)
}

/// One packed microbatch: a flat token row with document boundaries.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PackedBatch {
    pub input_ids: Vec<i64>,
    /// Aligned with `input_ids`, `-100` ignored; the shift happens in the
    /// loss, per document.
    pub labels: Vec<i64>,
    /// `0, l0, l0+l1, …, total`.
    pub cu_seq_lens: Vec<i64>,
    /// Routing replay (Qwen3-MoE): per token, the experts its generation
    /// used, `sparse layers × top_k` ids, flat; `-1` rows leave a token
    /// to the router. Empty: the router decides everywhere.
    pub routing: Vec<i64>,
}

impl PackedBatch {
    /// Checks that labels align with tokens and that `cu_seq_lens` starts at
    /// 0, strictly increases and ends at the row length.
    pub fn validate(&self) -> Result<(), StepError> {
        let n = self.input_ids.len() as i64;
        if self.labels.len() != self.input_ids.len() {
            return Err(invalid(format!(
                "microbatch labels: {} labels for {} tokens",
                self.labels.len(),
                self.input_ids.len()
            )));
        }
        if n == 0 && self.cu_seq_lens.len() <= 1 {
            if self.cu_seq_lens.first().is_some_and(|&c| c != 0) {
                return Err(invalid(
                    "microbatch cu_seq_lens: empty row must have cu_seq_lens [0] or []".into(),
                ));
            }
            return Ok(());
        }
        if self.cu_seq_lens.first() != Some(&0) {
            return Err(invalid(format!(
                "microbatch cu_seq_lens: must start at 0, got {:?}",
                self.cu_seq_lens.first()
            )));
        }
        if let Some(i) = self.cu_seq_lens.windows(2).position(|w| w[1] <= w[0]) {
            return Err(invalid(format!(
                "microbatch cu_seq_lens: not strictly increasing at index {} ({} then {})",
                i + 1,
                self.cu_seq_lens[i],
                self.cu_seq_lens[i + 1]
            )));
        }
        if self.cu_seq_lens.last() != Some(&n) {
            return Err(invalid(format!(
                "microbatch cu_seq_lens: ends at {:?}, the row has {n} tokens",
                self.cu_seq_lens.last()
            )));
        }
        if let Some(&bad) = self.labels.iter().find(|&&l| l < 0 && l != -100) {
            return Err(invalid(format!(
                "microbatch labels: negative label {bad} (only -100 is ignored)"
            )));
        }
        if let Some(&bad) = self.input_ids.iter().find(|&&t| t < 0) {
            return Err(invalid(format!(
                "microbatch token_ids: negative token {bad}"
            )));
        }
        Ok(())
    }

    /// A padding microbatch (zero tokens).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    pub fn tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Number of documents (sequences) in the row.
    pub fn documents(&self) -> usize {
        self.cu_seq_lens.len().saturating_sub(1)
    }

    /// Loss tokens: per document, `labels[1..] != -100` (the shift happens
    /// inside each document).
    pub fn loss_tokens(&self) -> u64 {
        self.cu_seq_lens
            .windows(2)
            .map(|w| {
                let (s, e) = (w[0] as usize, w[1] as usize);
                self.labels[(s + 1).min(e)..e]
                    .iter()
                    .filter(|&&l| l != -100)
                    .count() as u64
            })
            .sum()
    }

    /// Builds a row from documents `(tokens, labels)` (tests and benches).
    pub fn from_documents(docs: &[(Vec<i64>, Vec<i64>)]) -> PackedBatch {
        let mut b = PackedBatch {
            cu_seq_lens: vec![0],
            ..Default::default()
        };
        for (ids, labels) in docs {
            b.input_ids.extend(ids);
            b.labels.extend(labels);
            b.cu_seq_lens.push(b.input_ids.len() as i64);
        }
        b
    }
}

/// What the plan says about one sequence of a microbatch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SeqMeta {
    pub doc_id: String,
    /// 0 = SFT / rollout / DPO chosen, 1 = DPO rejected.
    pub role: u32,
    /// Policy gradient: the rollout's advantage.
    pub advantage: Option<f64>,
    /// DPO with a cached reference: the sequence's reference log-prob.
    pub ref_logp: Option<f64>,
}

/// Per-sequence metadata and per-token old log-probs of a microbatch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchMeta {
    pub seqs: Vec<SeqMeta>,
    /// Aligned with the token row (log-prob of token i given its prefix,
    /// under the generating policy); empty when the rollouts carry none,
    /// NaN on the tokens of a rollout without them.
    pub old_logprobs: Vec<f32>,
    /// Cached reference log-probs, aligned like `old_logprobs` (policy
    /// gradient with a KL penalty and `reference = "cached"`); NaN on a
    /// sequence the reference pass did not cover.
    pub ref_logprobs: Vec<f32>,
}

/// The step's global normalisers from the plan, identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepNorms {
    pub loss_tokens: u64,
    pub pairs: u64,
    pub sequences: u64,
}

/// What one microbatch's forward/backward reports (sums, not means).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchOutcome {
    /// Σ per-token loss over the microbatch's loss tokens (SFT, PG), or Σ
    /// per-pair loss (DPO), unscaled.
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// Real tokens in the row.
    pub tokens: u64,
    /// Preference pairs trained (DPO): the step's per-pair denominator.
    pub pairs: u64,
    /// Objective-specific sums (`rewards/chosen`, …), each a mean over the
    /// step's denominator once summed.
    pub extra: BTreeMap<String, f64>,
}

/// One sequence's log-probs from a reference plan.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceLogp {
    /// Summed over the loss tokens.
    pub logp: f64,
    pub loss_tokens: u64,
    /// Per token (see `objective::head::token_aligned`), for
    /// policy-gradient jobs; empty otherwise.
    pub tokens: Vec<f32>,
}

#[cfg(test)]
mod tests {
    fn wire(ids: &[u32], labels: &[i32], cu: &[u32]) -> accrue_proto::v1::Microbatch {
        accrue_proto::v1::Microbatch {
            token_ids: accrue_proto::pack_u32(ids),
            labels: accrue_proto::pack_i32(labels),
            cu_seq_lens: cu.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn loss_tokens_shift_inside_each_document() {
        let (b, _) =
            crate::convert::microbatch(&wire(&[1, 2, 3, 4, 5], &[-100, 7, 8, 9, -100], &[0, 2, 5]))
                .unwrap();
        // doc 0: labels[1..2] = [7] → 1; doc 1: [9, -100] → 1 (label 8 is a document start).
        assert_eq!(b.loss_tokens(), 2);
        assert_eq!(b.tokens(), 5);
        assert_eq!(b.documents(), 2);
    }

    #[test]
    fn rejects_bad_boundaries() {
        assert!(crate::convert::microbatch(&wire(&[1, 2], &[1, 2], &[0, 1])).is_err());
        assert!(crate::convert::microbatch(&wire(&[1, 2], &[1, 2], &[1, 2])).is_err());
        assert!(crate::convert::microbatch(&wire(&[1, 2], &[1, 2], &[0, 1, 1, 2])).is_err());
        assert!(crate::convert::microbatch(&wire(&[1, 2], &[1], &[0, 2])).is_err());
        let empty = crate::convert::microbatch(&wire(&[], &[], &[0])).unwrap().0;
        assert!(empty.is_empty());
        assert_eq!(empty.loss_tokens(), 0);
    }

    /// Labels sent as a loss mask make the batch packed labels make.
    #[test]
    fn a_loss_mask_makes_the_batch_packed_labels_make() {
        let ids = [11, 12, 13, 14, 15, 16, 17, 18, 19];
        let labels = [-100, 12, 13, -100, -100, 16, 17, 18, 19];
        let mut mask = accrue_proto::LossMask::default();
        for l in labels {
            mask.push(l != -100);
        }
        let masked = accrue_proto::v1::Microbatch {
            labels: Vec::new(),
            loss_mask: mask.into_bytes(),
            ..wire(&ids, &labels, &[0, 4, 9])
        };
        let (a, _) = crate::convert::microbatch(&masked).unwrap();
        let (b, _) = crate::convert::microbatch(&wire(&ids, &labels, &[0, 4, 9])).unwrap();
        assert_eq!(a.labels, b.labels);
        assert_eq!(a.input_ids, b.input_ids);
        assert_eq!(a.loss_tokens(), 6);
        // One bit short of the row's nine tokens: refused, naming the field.
        let short = accrue_proto::v1::Microbatch {
            loss_mask: vec![0xff],
            ..masked
        };
        let e = crate::convert::microbatch(&short).unwrap_err().to_string();
        assert!(e.contains("loss_mask: 1 bytes for 9 tokens"), "{e}");
    }
}
