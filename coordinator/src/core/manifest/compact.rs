//! A step's documents and layout (`ranks[rank][microbatch] → sequences`)
//! as the store keeps them: LEB128 varints (prost's), no field names, no
//! `file:line` text. At 16k documents a step the JSON form was most of the
//! commit's cost: formatting every id, then compressing the text (issue 19).
//!
//! Documents: `count, per document: file, line`. Layout: `ranks, per
//! rank: microbatches, per microbatch: tokens, sequences, per sequence:
//! file, line, role, tokens`.

use prost::encoding::{decode_varint, encode_varint};

use super::{MicrobatchEntry, SeqEntry};
use crate::stream::doc::DocId;

pub fn encode_docs(docs: &[DocId], out: &mut Vec<u8>) {
    encode_varint(docs.len() as u64, out);
    for doc in docs {
        encode_varint(u64::from(doc.file), out);
        encode_varint(doc.line, out);
    }
}

/// The documents [`encode_docs`] wrote at the start of `*buf`, which is
/// moved past them.
pub fn decode_docs(buf: &mut &[u8]) -> Result<Vec<DocId>, String> {
    let n = count(buf, "documents")?;
    let mut docs = Vec::with_capacity(n);
    for i in 0..n {
        let at = || format!("document {i}");
        let file = narrow(varint(buf, &at)?, &at)?;
        let line = varint(buf, &at)?;
        docs.push(DocId { file, line });
    }
    Ok(docs)
}

pub fn encode(ranks: &[Vec<MicrobatchEntry>], out: &mut Vec<u8>) {
    encode_varint(ranks.len() as u64, out);
    for rank in ranks {
        encode_varint(rank.len() as u64, out);
        for mb in rank {
            encode_varint(u64::from(mb.tokens), out);
            encode_varint(mb.seqs.len() as u64, out);
            for &SeqEntry(doc, role, tokens) in &mb.seqs {
                encode_varint(u64::from(doc.file), out);
                encode_varint(doc.line, out);
                encode_varint(u64::from(role), out);
                encode_varint(u64::from(tokens), out);
            }
        }
    }
}

/// The layout [`encode`] wrote, all of `bytes`; an error says what was cut
/// short or out of range.
pub fn decode(mut bytes: &[u8]) -> Result<Vec<Vec<MicrobatchEntry>>, String> {
    let buf = &mut bytes;
    let ranks = count(buf, "ranks")?;
    let mut out = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let mbs = count(buf, "microbatches")?;
        let mut rank = Vec::with_capacity(mbs);
        for m in 0..mbs {
            let at = || format!("rank {r} microbatch {m}");
            let tokens = narrow(varint(buf, &at)?, &at)?;
            let seqs = count(buf, "sequences")?;
            let mut entries = Vec::with_capacity(seqs);
            for _ in 0..seqs {
                let file = narrow(varint(buf, &at)?, &at)?;
                let line = varint(buf, &at)?;
                let role = narrow(varint(buf, &at)?, &at)?;
                let tokens = narrow(varint(buf, &at)?, &at)?;
                entries.push(SeqEntry(DocId { file, line }, role, tokens));
            }
            rank.push(MicrobatchEntry {
                tokens,
                seqs: entries,
            });
        }
        out.push(rank);
    }
    if !buf.is_empty() {
        return Err(format!("{} bytes after the layout", buf.len()));
    }
    Ok(out)
}

fn varint(buf: &mut &[u8], at: &dyn Fn() -> String) -> Result<u64, String> {
    decode_varint(buf).map_err(|e| format!("{}: {e}", at()))
}

/// A count, no larger than the bytes left could hold (each item takes at
/// least one): a corrupt count is an error, not a huge allocation.
fn count(buf: &mut &[u8], what: &str) -> Result<usize, String> {
    let n = decode_varint(buf).map_err(|e| format!("{what}: {e}"))?;
    if n > buf.len() as u64 {
        return Err(format!(
            "{n} {what} in the {} bytes left: cut short",
            buf.len()
        ));
    }
    Ok(n as usize)
}

fn narrow(v: u64, at: &dyn Fn() -> String) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{}: {v} is out of range", at()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Vec<Vec<MicrobatchEntry>> {
        let seq = |file, line, role, tokens| SeqEntry(DocId { file, line }, role, tokens);
        vec![
            vec![
                MicrobatchEntry {
                    tokens: 700,
                    seqs: vec![seq(0, 1, 0, 300), seq(3, u64::MAX, 1, 400)],
                },
                MicrobatchEntry::default(),
            ],
            vec![
                MicrobatchEntry {
                    tokens: 5,
                    seqs: vec![seq(u32::MAX, 1 << 40, 0, 5)],
                },
                MicrobatchEntry {
                    tokens: 9,
                    seqs: vec![seq(1, 2, 0, 4), seq(1, 3, 0, 5)],
                },
            ],
        ]
    }

    #[test]
    fn a_layout_round_trips_extremes_and_empty_microbatches_included() {
        let mut bytes = Vec::new();
        encode(&layout(), &mut bytes);
        assert_eq!(decode(&bytes).unwrap(), layout());
        let mut none = Vec::new();
        encode(&[], &mut none);
        assert_eq!(decode(&none).unwrap(), Vec::<Vec<MicrobatchEntry>>::new());
    }

    #[test]
    fn a_cut_or_padded_layout_is_an_error_not_a_shorter_layout() {
        let mut bytes = Vec::new();
        encode(&layout(), &mut bytes);
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        bytes.push(0);
        let err = decode(&bytes).unwrap_err();
        assert!(err.contains("1 bytes after"), "{err}");
    }

    #[test]
    fn documents_round_trip_and_a_cut_list_is_an_error() {
        let docs = [
            DocId { file: 0, line: 1 },
            DocId {
                file: u32::MAX,
                line: u64::MAX,
            },
        ];
        let mut bytes = Vec::new();
        encode_docs(&docs, &mut bytes);
        bytes.push(7);
        let mut rest = bytes.as_slice();
        assert_eq!(decode_docs(&mut rest).unwrap(), docs);
        assert_eq!(rest, [7]);
        for cut in 0..bytes.len() - 1 {
            assert!(decode_docs(&mut &bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn a_count_beyond_the_bytes_left_is_refused_before_allocating() {
        let mut bytes = Vec::new();
        encode_varint(u64::MAX, &mut bytes);
        let err = decode(&bytes).unwrap_err();
        assert!(err.contains("ranks") && err.contains("cut short"), "{err}");
    }
}
