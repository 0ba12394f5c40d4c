//! The `accrue.v1` wire protocol: the only contract between the coordinator,
//! its workers and the `accrue` CLI. Generated from `proto/accrue/v1/*.proto`.
//!
//! Token ids travel as packed little-endian bytes (`u32` ids, `i32` labels):
//! see [`pack_u32`] and friends; labels that are ids or ignored travel as a
//! bit mask ([`LossMask`], [`microbatch_labels`]).

/// The revision of this contract a worker sends at registration
/// (`RegisterRequest.protocol`); the coordinator registers workers of its
/// own revision only. Raise it with any change an older peer would
/// misread rather than refuse.
///
/// 1: plans may carry labels as a loss mask (`Microbatch.loss_mask`),
/// which workers from before (they send 0) read as "0 labels for N tokens".
/// 2: a plan's sequences name their document by number
/// (`PackedSequence.doc_file`, `doc_line`), `doc_id` left empty, which
/// workers of revision 1 read as every sequence of the same document.
/// 3: a rank's preference pairs travel in `MetricSums.pairs` (and
/// `SourceSums.pairs`), no longer as `extra["pairs"]`, which a coordinator
/// of revision 3 would average like any other extra.
/// 4: worker-to-worker links authenticate (`Configure.link_key`, relay
/// hellos MAC'd with the group key), which older workers would not do.
/// 5: a worker error may blame a rank of the weight ring
/// (`WorkerError.weight_ring`), relay link failures have their own kind
/// (`ERROR_KIND_RELAY_LINK`), and published-policy acknowledgements name
/// their generation (`PolicyPublished.generation`): an older coordinator
/// would blame the training rank of the same number, read a relay failure
/// as an internal error, or count an older generation's acknowledgement.
pub const PROTOCOL: u32 = 5;

/// A packed sequence's document id as text (`file:line`): its `doc_id`
/// when one is set, else its `doc_file` and `doc_line`.
pub fn doc_label(s: &v1::PackedSequence) -> String {
    if s.doc_id.is_empty() {
        format!("{}:{}", s.doc_file, s.doc_line)
    } else {
        s.doc_id.clone()
    }
}

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("accrue.v1");
}

/// Packs token ids as little-endian `u32` bytes (4 bytes per token).
pub fn pack_u32(values: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    extend_u32(&mut out, values);
    out
}

/// Packs labels as little-endian `i32` bytes (4 bytes per token).
pub fn pack_i32(values: &[i32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    extend_i32(&mut out, values);
    out
}

/// Appends token ids to `out` as [`pack_u32`] packs them (a payload built
/// from many rows is written in place, not packed row by row).
pub fn extend_u32(out: &mut Vec<u8>, values: &[u32]) {
    let at = out.len();
    out.resize(at + values.len() * 4, 0);
    for (b, v) in out[at..].chunks_exact_mut(4).zip(values) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Appends labels to `out` as [`pack_i32`] packs them.
pub fn extend_i32(out: &mut Vec<u8>, values: &[i32]) {
    let at = out.len();
    out.resize(at + values.len() * 4, 0);
    for (b, v) in out[at..].chunks_exact_mut(4).zip(values) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Packs per-token floats as little-endian `f32` bytes.
pub fn pack_f32(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Error for a packed field whose length is not a multiple of its
/// element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLenError {
    pub len: usize,
    /// Bytes per element (4, or 2 for [`unpack_u16`]).
    pub size: usize,
}

impl std::fmt::Display for PackedLenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "packed field has {} bytes, not a multiple of {}",
            self.len, self.size
        )
    }
}

/// Packs small ids (routing's expert ids) as little-endian `u16` bytes.
pub fn pack_u16(values: &[u16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 2);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Inverse of [`pack_u16`].
pub fn unpack_u16(bytes: &[u8]) -> Result<Vec<u16>, PackedLenError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(PackedLenError {
            len: bytes.len(),
            size: 2,
        });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// A routing entry that leaves its token to the router (routing replay).
pub const NO_EXPERT: u16 = u16::MAX;

impl std::error::Error for PackedLenError {}

fn chunks4(bytes: &[u8]) -> Result<impl Iterator<Item = [u8; 4]> + '_, PackedLenError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PackedLenError {
            len: bytes.len(),
            size: 4,
        });
    }
    Ok(bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]))
}

/// Inverse of [`pack_u32`].
pub fn unpack_u32(bytes: &[u8]) -> Result<Vec<u32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(u32::from_le_bytes).collect())
}

/// Inverse of [`pack_i32`].
pub fn unpack_i32(bytes: &[u8]) -> Result<Vec<i32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(i32::from_le_bytes).collect())
}

/// Inverse of [`pack_f32`].
pub fn unpack_f32(bytes: &[u8]) -> Result<Vec<f32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(f32::from_le_bytes).collect())
}

/// A microbatch's labels as its `loss_mask` carries them: one bit a token,
/// least significant first, set when the label is the token's id (the
/// packed labels of such a row would be 4 bytes a token of copies).
#[derive(Debug, Default)]
pub struct LossMask {
    bytes: Vec<u8>,
    tokens: usize,
}

impl LossMask {
    pub fn with_capacity(tokens: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(tokens.div_ceil(8)),
            tokens: 0,
        }
    }

    /// Token `tokens()`'s label: its id (`true`) or ignored.
    pub fn push(&mut self, on: bool) {
        if self.tokens.is_multiple_of(8) {
            self.bytes.push(0);
        }
        if on {
            *self.bytes.last_mut().expect("pushed above") |= 1 << (self.tokens % 8);
        }
        self.tokens += 1;
    }

    /// Appends a token per byte of `flags`: its label is its id when the
    /// byte is 1. Eight at a time where the bytes are all 0 or 1: a plan
    /// packs every token of a step through here.
    pub fn extend_flags(&mut self, flags: &[u8]) {
        let mut chunks = flags.chunks_exact(8);
        for chunk in &mut chunks {
            let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            if x & !0x0101_0101_0101_0101 != 0 {
                chunk.iter().for_each(|&f| self.push(f == 1));
                continue;
            }
            // Byte i (0 or 1) lands on bit 56 + i; no two partial products
            // share a bit, so nothing carries.
            let bits = (x.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8;
            let off = self.tokens % 8;
            if off == 0 {
                self.bytes.push(bits);
            } else {
                *self.bytes.last_mut().expect("a partial byte") |= bits << off;
                self.bytes.push(bits >> (8 - off));
            }
            self.tokens += 8;
        }
        chunks.remainder().iter().for_each(|&f| self.push(f == 1));
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

/// Error for a microbatch whose labels cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelsError {
    /// `labels` whose length is not a multiple of 4.
    Packed(PackedLenError),
    /// `labels` and `loss_mask` both set: which one holds the labels?
    Both,
    /// `labels` for a different number of tokens.
    Labels { labels: usize, tokens: usize },
    /// A `loss_mask` of the wrong length for the tokens.
    MaskLen { bytes: usize, tokens: usize },
    /// Bits set past the last token.
    MaskPadding,
}

impl std::fmt::Display for LabelsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Packed(e) => write!(f, "labels: {e}"),
            Self::Both => write!(f, "labels and loss_mask are both set"),
            Self::Labels { labels, tokens } => {
                write!(f, "labels: {labels} labels for {tokens} tokens")
            }
            Self::MaskLen { bytes, tokens } => write!(
                f,
                "loss_mask: {bytes} bytes for {tokens} tokens (expected {})",
                tokens.div_ceil(8)
            ),
            Self::MaskPadding => write!(f, "loss_mask: bits set past the last token"),
        }
    }
}

impl std::error::Error for LabelsError {}

/// The labels of a microbatch of `ids`, from `labels` or, when that is
/// empty, from `loss_mask` (an id where its bit is set, -100 elsewhere).
pub fn microbatch_labels(
    ids: &[u32],
    labels: &[u8],
    loss_mask: &[u8],
) -> Result<Vec<i32>, LabelsError> {
    if !labels.is_empty() {
        if !loss_mask.is_empty() {
            return Err(LabelsError::Both);
        }
        let labels = unpack_i32(labels).map_err(LabelsError::Packed)?;
        if labels.len() != ids.len() {
            return Err(LabelsError::Labels {
                labels: labels.len(),
                tokens: ids.len(),
            });
        }
        return Ok(labels);
    }
    if loss_mask.len() != ids.len().div_ceil(8) {
        return Err(LabelsError::MaskLen {
            bytes: loss_mask.len(),
            tokens: ids.len(),
        });
    }
    let used = ids.len() % 8;
    if used != 0 && loss_mask[loss_mask.len() - 1] >> used != 0 {
        return Err(LabelsError::MaskPadding);
    }
    // Same bits as the packed form (a u32 id read as i32), which the
    // coordinator copies for a row with labels.
    Ok(ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            if loss_mask[i / 8] >> (i % 8) & 1 == 1 {
                id as i32
            } else {
                -100
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_extend_a_mask_as_pushing_them_one_by_one_does() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for start in 0..9 {
            for n in [0usize, 1, 7, 8, 9, 16, 23, 64, 101] {
                let flags: Vec<u8> = (0..n)
                    .map(|i| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Mostly 0/1; now and then another value (off).
                        if i % 29 == 5 {
                            2
                        } else {
                            (x & 1) as u8
                        }
                    })
                    .collect();
                let (mut bulk, mut one) = (LossMask::with_capacity(0), LossMask::with_capacity(0));
                for i in 0..start {
                    bulk.push(i % 3 == 0);
                    one.push(i % 3 == 0);
                }
                bulk.extend_flags(&flags);
                flags.iter().for_each(|&f| one.push(f == 1));
                assert_eq!(bulk.tokens(), one.tokens(), "start {start} n {n}");
                assert_eq!(bulk.into_bytes(), one.into_bytes(), "start {start} n {n}");
            }
        }
    }

    #[test]
    fn a_sequence_names_its_document_by_number_unless_it_carries_text() {
        let numbered = v1::PackedSequence {
            doc_file: 3,
            doc_line: 1 << 40,
            ..Default::default()
        };
        assert_eq!(doc_label(&numbered), "3:1099511627776");
        let text = v1::PackedSequence {
            doc_id: "d:7".into(),
            ..numbered
        };
        assert_eq!(doc_label(&text), "d:7");
    }

    #[test]
    fn a_loss_mask_gives_the_labels_packed_labels_give() {
        for n in [0usize, 1, 7, 8, 9, 16, 17, 1003] {
            let ids: Vec<u32> = (0..n as u64)
                .map(|i| (i * 2_654_435_761 % 50_000) as u32)
                .collect();
            let on = |i: usize| !(i * 7 + n).is_multiple_of(3);
            let mut mask = LossMask::with_capacity(n);
            let mut labels = Vec::new();
            for (i, &id) in ids.iter().enumerate() {
                mask.push(on(i));
                labels.push(if on(i) { id as i32 } else { -100 });
            }
            assert_eq!(mask.tokens(), n);
            let mask = mask.into_bytes();
            assert_eq!(mask.len(), n.div_ceil(8));
            assert_eq!(microbatch_labels(&ids, &[], &mask).unwrap(), labels);
            assert_eq!(
                microbatch_labels(&ids, &pack_i32(&labels), &[]).unwrap(),
                labels
            );
        }
    }

    #[test]
    fn labels_that_cannot_be_read_are_named() {
        let ids = [5u32, 6, 7];
        let e = |labels: &[u8], mask: &[u8]| {
            microbatch_labels(&ids, labels, mask)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(e(&[], &[]), "loss_mask: 0 bytes for 3 tokens (expected 1)");
        assert_eq!(
            e(&[], &[1, 0]),
            "loss_mask: 2 bytes for 3 tokens (expected 1)"
        );
        assert_eq!(e(&[], &[0b1000]), "loss_mask: bits set past the last token");
        assert_eq!(
            e(&pack_i32(&[1, 2, 3]), &[1]),
            "labels and loss_mask are both set"
        );
        assert_eq!(e(&pack_i32(&[1, 2]), &[]), "labels: 2 labels for 3 tokens");
        assert_eq!(
            e(&[1, 2, 3], &[]),
            "labels: packed field has 3 bytes, not a multiple of 4"
        );
        assert_eq!(microbatch_labels(&[], &[], &[]).unwrap(), Vec::<i32>::new());
    }

    #[test]
    fn packed_round_trip() {
        let ids = [0u32, 1, 65_535, u32::MAX];
        assert_eq!(unpack_u32(&pack_u32(&ids)).unwrap(), ids);
        let labels = [-100i32, 0, 7, i32::MAX];
        assert_eq!(unpack_i32(&pack_i32(&labels)).unwrap(), labels);
        let f = [0.5f32, -1.25];
        assert_eq!(unpack_f32(&pack_f32(&f)).unwrap(), f);
    }

    #[test]
    fn packed_rejects_ragged_bytes() {
        assert_eq!(
            unpack_u32(&[1, 2, 3]).unwrap_err(),
            PackedLenError { len: 3, size: 4 }
        );
    }
}
