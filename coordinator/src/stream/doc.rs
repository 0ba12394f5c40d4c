//! Documents: the unit the data stream serves, the planner packs and a step
//! counts. A document is one SFT example, one preference pair or one rollout.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

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

impl DocId {
    /// The `file:line` form [`fmt::Display`] writes, without the formatter
    /// (every sequence of a manifest printed as JSON carries one).
    pub fn label(&self) -> String {
        let (mut file, mut line) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (file, line) = (file.format(self.file), line.format(self.line));
        let mut s = String::with_capacity(file.len() + 1 + line.len());
        s.push_str(file);
        s.push(':');
        s.push_str(line);
        s
    }
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

/// A list of document ids held compactly: each id as two LEB128 varints
/// (file, line), ~4 bytes instead of 16 for a dataset of millions of
/// lines. What the coordinator keeps per committed step for replay (issue
/// 19, bounded state: 16k documents a step took 256 KiB as a `Vec`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DocIds {
    bytes: Arc<[u8]>,
    len: usize,
}

impl DocIds {
    pub fn new(ids: &[DocId]) -> Self {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for id in ids {
            put_varint(&mut bytes, u64::from(id.file));
            put_varint(&mut bytes, id.line);
        }
        Self {
            bytes: bytes.into(),
            len: ids.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held (for measurements).
    pub fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    /// The ids, in order.
    pub fn iter(&self) -> impl Iterator<Item = DocId> + '_ {
        let mut at = 0;
        (0..self.len).map(move |_| {
            let file = take_varint(&self.bytes, &mut at);
            let line = take_varint(&self.bytes, &mut at);
            // Written by `new` from u32 files: never wider.
            DocId {
                file: file as u32,
                line,
            }
        })
    }

    pub fn to_vec(&self) -> Vec<DocId> {
        self.iter().collect()
    }
}

impl From<&[DocId]> for DocIds {
    fn from(ids: &[DocId]) -> Self {
        Self::new(ids)
    }
}

impl From<Vec<DocId>> for DocIds {
    fn from(ids: Vec<DocId>) -> Self {
        Self::new(&ids)
    }
}

impl fmt::Debug for DocIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads the varint at `*at` (bytes `put_varint` wrote) and moves past it.
fn take_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let b = bytes[*at];
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

/// One token row with labels aligned to `input_ids` (the shift to next-token
/// targets happens in the loss, as in `transformers`). Its tokens are owned,
/// or a row of a mapped token store (`crate::stream::data::token_store`), of which only
/// the place and the counts the planner needs are resident.
#[derive(Clone)]
pub struct Sequence {
    tokens: Tokens,
}

#[derive(Clone)]
enum Tokens {
    Owned {
        input_ids: Vec<u32>,
        labels: Vec<i32>,
    },
    Mapped {
        rows: Arc<dyn TokenRows>,
        row: Row,
    },
}

/// One row of a [`TokenRows`] as its row table describes it. A mapped
/// [`Sequence`] keeps all of it, read once when its document is loaded:
/// building a plan then reads the row's tokens alone (the table would be
/// one more cache miss per document of every plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub len: u32,
    pub loss_tokens: u32,
    /// Where its owner keeps its tokens (a store: the offset of its first
    /// token in the token array).
    pub start: u64,
    /// Offset of its explicit labels, or [`Row::NO_EXPLICIT`]: its labels
    /// are then its ids, some ignored (a `u64` rather than an `Option`
    /// keeps a mapped sequence no larger than an owned one).
    pub explicit: u64,
}

impl Row {
    pub const NO_EXPLICIT: u64 = u64::MAX;

    /// Where its explicit labels start, if it has any.
    pub fn explicit_labels(&self) -> Option<u64> {
        (self.explicit != Self::NO_EXPLICIT).then_some(self.explicit)
    }
}

/// Rows of tokens kept outside the coordinator's heap (a memory-mapped
/// token store): what a mapped [`Sequence`] reads when a plan is built.
/// Each method is given the [`Row`] its table described at load.
pub trait TokenRows: Send + Sync {
    fn ids(&self, row: &Row) -> &[u32];
    fn labels(&self, row: &Row) -> Cow<'_, [i32]>;

    /// Appends row `row`'s ids and labels to `ids` and `labels` as the wire
    /// packs them (little-endian, 4 bytes a token). A store overrides this
    /// to write its labels without building the label row first: it runs
    /// for every token of every plan.
    fn write_le(&self, row: &Row, ids: &mut Vec<u8>, labels: &mut Vec<u8>) {
        accrue_proto::extend_u32(ids, self.ids(row));
        accrue_proto::extend_i32(labels, &self.labels(row));
    }

    /// When every label of row `row` is its token's id or ignored, appends
    /// its ids as [`TokenRows::write_le`] does and its labels to `mask` (the
    /// wire's loss mask, [`accrue_proto::LossMask`]) and says so; otherwise
    /// writes nothing. One pass: the row is read once.
    fn write_masked(
        &self,
        row: &Row,
        ids: &mut Vec<u8>,
        mask: &mut accrue_proto::LossMask,
    ) -> bool {
        write_masked(self.ids(row), &self.labels(row), ids, mask)
    }

    /// Starts loading row `row`'s first bytes into the cache without
    /// waiting for them. A plan's rows are scattered over the store, each
    /// a cache miss: touched together before they are copied, the misses
    /// overlap instead of following one another.
    fn prefetch(&self, _row: &Row) {}
}

/// [`TokenRows::write_masked`] of a row held as `ids` and `labels`.
fn write_masked(
    ids: &[u32],
    labels: &[i32],
    out: &mut Vec<u8>,
    mask: &mut accrue_proto::LossMask,
) -> bool {
    let maskable = ids.len() == labels.len()
        && ids
            .iter()
            .zip(labels)
            .all(|(&id, &l)| l == IGNORE_INDEX || l == id as i32);
    if maskable {
        accrue_proto::extend_u32(out, ids);
        for &l in labels {
            mask.push(l != IGNORE_INDEX);
        }
    }
    maskable
}

impl Sequence {
    pub fn new(input_ids: Vec<u32>, labels: Vec<i32>) -> Self {
        Self {
            tokens: Tokens::Owned { input_ids, labels },
        }
    }

    /// Row `row` of `rows`, as their row table describes it.
    pub fn mapped(rows: Arc<dyn TokenRows>, row: Row) -> Self {
        Self {
            tokens: Tokens::Mapped { rows, row },
        }
    }

    pub fn input_ids(&self) -> &[u32] {
        match &self.tokens {
            Tokens::Owned { input_ids, .. } => input_ids,
            Tokens::Mapped { rows, row } => rows.ids(row),
        }
    }

    pub fn labels(&self) -> Cow<'_, [i32]> {
        match &self.tokens {
            Tokens::Owned { labels, .. } => Cow::Borrowed(labels),
            Tokens::Mapped { rows, row } => rows.labels(row),
        }
    }

    /// Appends its ids and labels as the wire packs them (see
    /// [`TokenRows::write_le`]).
    pub fn write_le(&self, ids: &mut Vec<u8>, labels: &mut Vec<u8>) {
        match &self.tokens {
            Tokens::Owned {
                input_ids,
                labels: l,
            } => {
                accrue_proto::extend_u32(ids, input_ids);
                accrue_proto::extend_i32(labels, l);
            }
            Tokens::Mapped { rows, row } => rows.write_le(row, ids, labels),
        }
    }

    /// See [`TokenRows::prefetch`]; nothing for owned tokens.
    pub fn prefetch(&self) {
        if let Tokens::Mapped { rows, row } = &self.tokens {
            rows.prefetch(row);
        }
    }

    /// See [`TokenRows::write_masked`].
    pub fn write_masked(&self, ids: &mut Vec<u8>, mask: &mut accrue_proto::LossMask) -> bool {
        match &self.tokens {
            Tokens::Owned { input_ids, labels } => write_masked(input_ids, labels, ids, mask),
            Tokens::Mapped { rows, row } => rows.write_masked(row, ids, mask),
        }
    }

    pub fn len(&self) -> usize {
        match &self.tokens {
            Tokens::Owned { input_ids, .. } => input_ids.len(),
            Tokens::Mapped { row, .. } => row.len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the tokens live in a mapped store rather than on the heap.
    pub fn is_mapped(&self) -> bool {
        matches!(self.tokens, Tokens::Mapped { .. })
    }

    /// Tokens that contribute to the loss after the shift: position `t`
    /// predicts `labels[t + 1]`, so `labels[0]` never counts.
    pub fn loss_tokens(&self) -> u64 {
        match &self.tokens {
            Tokens::Owned { labels, .. } => count_loss_tokens(labels),
            Tokens::Mapped { row, .. } => u64::from(row.loss_tokens),
        }
    }
}

/// Loss tokens of a label row (see [`Sequence::loss_tokens`]).
pub fn count_loss_tokens(labels: &[i32]) -> u64 {
    labels
        .iter()
        .skip(1)
        .filter(|&&l| l != IGNORE_INDEX)
        .count() as u64
}

impl Default for Sequence {
    fn default() -> Self {
        Self::new(Vec::new(), Vec::new())
    }
}

impl PartialEq for Sequence {
    /// Equal tokens and labels, wherever they are kept.
    fn eq(&self, other: &Self) -> bool {
        self.input_ids() == other.input_ids() && self.labels() == other.labels()
    }
}

impl Eq for Sequence {}

impl fmt::Debug for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sequence")
            .field("input_ids", &self.input_ids())
            .field("labels", &self.labels())
            .finish()
    }
}

/// The serialised form: the tokens themselves (a mapped row is read).
#[derive(Serialize, Deserialize)]
struct SequenceRepr<'a> {
    input_ids: Cow<'a, [u32]>,
    labels: Cow<'a, [i32]>,
}

impl Serialize for Sequence {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        SequenceRepr {
            input_ids: Cow::Borrowed(self.input_ids()),
            labels: self.labels(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Sequence {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = SequenceRepr::deserialize(d)?;
        Ok(Sequence::new(
            r.input_ids.into_owned(),
            r.labels.into_owned(),
        ))
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
    /// Routing replay: the experts the generator routed each token
    /// through, a fixed number per token aligned with `seq.input_ids`
    /// (`accrue_proto::NO_EXPERT` for the last token, never run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Vec<u16>>,
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
    /// No allocation: the planner calls this for every document of every
    /// step, under the coordinator's state lock.
    pub fn sequences(&self) -> impl Iterator<Item = &Sequence> + Clone {
        let (first, second) = match &self.body {
            DocBody::Sft(s) => (s, None),
            DocBody::Pair { chosen, rejected } => (chosen, Some(rejected)),
            DocBody::Rollout(r) => (&r.seq, None),
        };
        std::iter::once(first).chain(second)
    }

    /// Total tokens the document occupies in a microbatch.
    pub fn tokens(&self) -> u64 {
        self.sequences().map(|s| s.len() as u64).sum()
    }

    /// Loss tokens over all its sequences.
    pub fn loss_tokens(&self) -> u64 {
        self.sequences().map(|s| s.loss_tokens()).sum()
    }

    /// Lengths of its sequences, in packing order.
    pub fn seq_lens(&self) -> SeqLens {
        let mut lens = self.sequences().map(|s| s.len() as u32);
        let first = lens.next().expect("a document has a first sequence");
        match lens.next() {
            Some(second) => SeqLens::pair(first, second),
            None => SeqLens::one(first),
        }
    }

    pub fn is_pair(&self) -> bool {
        matches!(self.body, DocBody::Pair { .. })
    }
}

/// A document's sequence lengths: one, or a pair's two. Held inline: an
/// item is built for every document of every step, under the state lock.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SeqLens {
    lens: [u32; 2],
    pair: bool,
}

impl SeqLens {
    pub fn one(len: u32) -> Self {
        Self {
            lens: [len, 0],
            pair: false,
        }
    }

    /// A pair's two sequences, in the order they are placed.
    pub fn pair(first: u32, second: u32) -> Self {
        Self {
            lens: [first, second],
            pair: true,
        }
    }

    /// One or two lengths; `None` for any other count.
    pub fn from_slice(lens: &[u32]) -> Option<Self> {
        match *lens {
            [len] => Some(Self::one(len)),
            [first, second] => Some(Self::pair(first, second)),
            _ => None,
        }
    }
}

impl std::ops::Deref for SeqLens {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.lens[..1 + usize::from(self.pair)]
    }
}

impl std::fmt::Debug for SeqLens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_sequence_is_no_larger_than_an_owned_one() {
        // Every document of a dataset is resident: a mapped row carries
        // its table entry (see `Row`) within the size an owned row needs.
        let owned = std::mem::size_of::<(Vec<u32>, Vec<i32>)>();
        assert_eq!(std::mem::size_of::<Sequence>(), owned);
    }

    #[test]
    fn loss_tokens_skip_first_label_and_ignored() {
        let s = Sequence::new(vec![1, 2, 3, 4], vec![1, IGNORE_INDEX, 3, 4]);
        assert_eq!(s.loss_tokens(), 2);
    }

    #[test]
    fn pair_counts_both_sequences() {
        let seq = |n: usize| Sequence::new(vec![5; n], vec![5; n]);
        let d = Document {
            id: DocId { file: 0, line: 3 },
            body: DocBody::Pair {
                chosen: seq(3),
                rejected: seq(5),
            },
        };
        assert_eq!(d.tokens(), 8);
        assert_eq!(d.loss_tokens(), 6);
        assert_eq!(d.seq_lens()[..], [3, 5]);
        assert_eq!(d.id.to_string(), "0:3");
    }

    #[test]
    fn a_label_is_the_display_form_and_parses_back() {
        for (file, line) in [
            (0, 0),
            (0, 3),
            (9, 10),
            (12, 2_000_001),
            (u32::MAX, u64::MAX),
        ] {
            let id = DocId { file, line };
            assert_eq!(id.label(), id.to_string());
            assert_eq!(id.label().parse::<DocId>(), Ok(id));
        }
    }
}

#[cfg(test)]
mod doc_ids_tests {
    use super::*;

    #[test]
    fn doc_ids_round_trip_compactly_in_order() {
        let ids: Vec<DocId> = [
            (0, 1),
            (3, 127),
            (3, 128),
            (0, 2_000_000),
            (u32::MAX, u64::MAX),
            (7, 0),
        ]
        .into_iter()
        .map(|(file, line)| DocId { file, line })
        .collect();
        let c = DocIds::new(&ids);
        assert_eq!(c.len(), ids.len());
        assert_eq!(c.to_vec(), ids);
        assert_eq!(DocIds::new(&[]).to_vec(), Vec::<DocId>::new());
        // 16k ids of a 2M-line file: ~4 bytes each, not 16.
        let many: Vec<DocId> = (0..16_384u64)
            .map(|i| DocId {
                file: 0,
                line: (i * 7919) % 2_000_000 + 1,
            })
            .collect();
        let c = DocIds::new(&many);
        assert_eq!(c.to_vec(), many);
        assert!(c.encoded_len() <= 4 * many.len(), "{}", c.encoded_len());
    }
}
