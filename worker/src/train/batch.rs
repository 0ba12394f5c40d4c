//! One packed microbatch as the worker trains on it: a flat token row with
//! document boundaries, decoded and checked from the wire `Microbatch`.

use anyhow::{bail, Context};

/// One packed microbatch: a flat token row with document boundaries.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PackedBatch {
    pub input_ids: Vec<i64>,
    /// Aligned with `input_ids`, `-100` ignored; the shift happens in the
    /// loss, per document.
    pub labels: Vec<i64>,
    /// `0, l0, l0+l1, …, total`.
    pub cu_seq_lens: Vec<i64>,
}

impl PackedBatch {
    /// Decodes the packed little-endian bytes and checks the boundaries.
    pub fn from_wire(mb: &accrue_proto::v1::Microbatch) -> anyhow::Result<PackedBatch> {
        let ids = accrue_proto::unpack_u32(&mb.token_ids).context("microbatch token_ids")?;
        let labels = accrue_proto::unpack_i32(&mb.labels).context("microbatch labels")?;
        let batch = PackedBatch {
            input_ids: ids.into_iter().map(i64::from).collect(),
            labels: labels.into_iter().map(i64::from).collect(),
            cu_seq_lens: mb.cu_seq_lens.iter().map(|&c| i64::from(c)).collect(),
        };
        batch.validate()?;
        Ok(batch)
    }

    /// Checks that labels align with tokens and that `cu_seq_lens` starts at
    /// 0, strictly increases and ends at the row length.
    pub fn validate(&self) -> anyhow::Result<()> {
        let n = self.input_ids.len() as i64;
        if self.labels.len() != self.input_ids.len() {
            bail!(
                "microbatch labels: {} labels for {} tokens",
                self.labels.len(),
                self.input_ids.len()
            );
        }
        if n == 0 && self.cu_seq_lens.len() <= 1 {
            if self.cu_seq_lens.first().is_some_and(|&c| c != 0) {
                bail!("microbatch cu_seq_lens: empty row must have cu_seq_lens [0] or []");
            }
            return Ok(());
        }
        if self.cu_seq_lens.first() != Some(&0) {
            bail!(
                "microbatch cu_seq_lens: must start at 0, got {:?}",
                self.cu_seq_lens.first()
            );
        }
        if let Some(i) = self.cu_seq_lens.windows(2).position(|w| w[1] <= w[0]) {
            bail!(
                "microbatch cu_seq_lens: not strictly increasing at index {} ({} then {})",
                i + 1,
                self.cu_seq_lens[i],
                self.cu_seq_lens[i + 1]
            );
        }
        if self.cu_seq_lens.last() != Some(&n) {
            bail!(
                "microbatch cu_seq_lens: ends at {:?}, the row has {n} tokens",
                self.cu_seq_lens.last()
            );
        }
        if let Some(&bad) = self.labels.iter().find(|&&l| l < 0 && l != -100) {
            bail!("microbatch labels: negative label {bad} (only -100 is ignored)");
        }
        if let Some(&bad) = self.input_ids.iter().find(|&&t| t < 0) {
            bail!("microbatch token_ids: negative token {bad}");
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let b = PackedBatch::from_wire(&wire(&[1, 2, 3, 4, 5], &[-100, 7, 8, 9, -100], &[0, 2, 5]))
            .unwrap();
        // doc 0: labels[1..2] = [7] → 1; doc 1: [9, -100] → 1 (label 8 is a document start).
        assert_eq!(b.loss_tokens(), 2);
        assert_eq!(b.tokens(), 5);
        assert_eq!(b.documents(), 2);
    }

    #[test]
    fn rejects_bad_boundaries() {
        assert!(PackedBatch::from_wire(&wire(&[1, 2], &[1, 2], &[0, 1])).is_err());
        assert!(PackedBatch::from_wire(&wire(&[1, 2], &[1, 2], &[1, 2])).is_err());
        assert!(PackedBatch::from_wire(&wire(&[1, 2], &[1, 2], &[0, 1, 1, 2])).is_err());
        assert!(PackedBatch::from_wire(&wire(&[1, 2], &[1], &[0, 2])).is_err());
        let empty = PackedBatch::from_wire(&wire(&[], &[], &[0])).unwrap();
        assert!(empty.is_empty());
        assert_eq!(empty.loss_tokens(), 0);
    }
}
