//! A committed step's record as the store keeps it: the record, its
//! compact encoding (zstd over varints and JSON; older forms still read),
//! and the cold files that hold a job's older records.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{decode, json, Result, StoreError};
use crate::core::StepMetrics;
use crate::stream::doc::DocId;

/// What the store keeps per committed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub metrics: StepMetrics,
    /// The step manifest: the documents it trained on (stored only when
    /// the full manifest does not already list them).
    #[serde(default)]
    pub docs: Vec<DocId>,
    /// The full manifest (settings, layout per rank and microbatch,
    /// attempts); absent on records written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<crate::core::manifest::StepManifest>,
}

/// Tags a step record compressed with zstd; a plain JSON one (written
/// before, or by hand) starts with `{`.
pub(super) const ZSTD: u8 = 1;

/// Tags a step record whose documents and layout are binary
/// ([`crate::core::manifest::compact`]): zstd over the length of the rest's JSON
/// (a varint), that JSON, the documents, then the layout if it has one.
pub(super) const ZSTD_BINARY: u8 = 2;

/// A step record as stored (issue 19, bounded state): the documents (none
/// when the layout lists the same, in the same order) and the layout in
/// binary, the rest as JSON, zstd-compressed. No id is formatted as text:
/// that, and compressing the text, was most of a 16k-document commit.
pub(super) fn compact(step: StepRecord) -> Vec<u8> {
    use crate::core::manifest::compact;
    let StepRecord {
        metrics,
        docs,
        mut manifest,
    } = step;
    let ranks = manifest.as_mut().map(|m| std::mem::take(&mut m.ranks));
    let listed = ranks
        .as_ref()
        .is_some_and(|ranks| crate::core::manifest::layout_docs(ranks).eq(docs.iter().copied()));
    let head = json(&StepRecord {
        metrics,
        docs: Vec::new(),
        manifest,
    });
    let mut body = Vec::new();
    prost::encoding::encode_varint(head.len() as u64, &mut body);
    body.extend_from_slice(&head);
    compact::encode_docs(if listed { &[] } else { &docs }, &mut body);
    if let Some(ranks) = &ranks {
        compact::encode(ranks, &mut body);
    }
    let mut out = vec![ZSTD_BINARY];
    // Level 1: the write is on the commit path; the ratio barely improves above.
    out.extend(zstd::bulk::compress(&body, 1).expect("compressing into memory cannot fail"));
    out
}

/// Reads a step record in any form written, its document list restored.
pub(super) fn step_record(key: &str, bytes: &[u8]) -> Result<StepRecord> {
    use crate::core::manifest::compact;
    let corrupt = |message: String| StoreError::Corrupt {
        what: key.to_string(),
        message,
    };
    let unzip = |bytes: &[u8]| {
        zstd::stream::decode_all(bytes).map_err(|e| corrupt(format!("decompressing: {e}")))
    };
    let mut rec: StepRecord = match bytes.first() {
        Some(&ZSTD) => decode(key, &unzip(&bytes[1..])?)?,
        Some(&ZSTD_BINARY) => {
            let body = unzip(&bytes[1..])?;
            let mut rest = body.as_slice();
            let len = prost::encoding::decode_varint(&mut rest)
                .map_err(|e| corrupt(format!("the head's length: {e}")))?;
            let Some(head) = usize::try_from(len).ok().and_then(|n| rest.get(..n)) else {
                return Err(corrupt(format!("a head of {len} bytes cut short")));
            };
            rest = &rest[head.len()..];
            let mut rec: StepRecord = decode(key, head)?;
            rec.docs = compact::decode_docs(&mut rest)
                .map_err(|e| corrupt(format!("the documents: {e}")))?;
            match &mut rec.manifest {
                Some(m) => {
                    m.ranks =
                        compact::decode(rest).map_err(|e| corrupt(format!("the layout: {e}")))?;
                }
                None if !rest.is_empty() => {
                    return Err(corrupt(format!(
                        "{} bytes after the documents and no layout",
                        rest.len()
                    )));
                }
                None => {}
            }
            rec
        }
        _ => decode(key, bytes)?,
    };
    if rec.docs.is_empty() {
        if let Some(m) = &rec.manifest {
            rec.docs = m.docs();
        }
    }
    Ok(rec)
}

/// The largest head (a record's JSON part) [`step_metrics`] reads; a
/// longer one is corrupt.
const MAX_HEAD: u64 = 64 << 20;

/// A record's metrics alone: of the compact form only the head is
/// decompressed and parsed (its documents and layout, most of a large
/// step's bytes, are neither), for readers that show curves (issue 33:
/// the status page decoded every step's documents).
pub(super) fn step_metrics(key: &str, bytes: &[u8]) -> Result<StepMetrics> {
    use std::io::Read;
    #[derive(serde::Deserialize)]
    struct Head {
        metrics: StepMetrics,
    }
    let corrupt = |message: String| StoreError::Corrupt {
        what: key.to_string(),
        message,
    };
    let head: Head = match bytes.first() {
        Some(&ZSTD_BINARY) => {
            let mut z = zstd::stream::read::Decoder::new(&bytes[1..])
                .map_err(|e| corrupt(format!("decompressing: {e}")))?;
            // The head's length: a varint, a byte at a time.
            let mut len = 0u64;
            for shift in (0..64).step_by(7) {
                let mut b = [0u8; 1];
                z.read_exact(&mut b)
                    .map_err(|e| corrupt(format!("the head's length: {e}")))?;
                len |= u64::from(b[0] & 0x7f) << shift;
                if b[0] < 0x80 {
                    break;
                }
            }
            if len > MAX_HEAD {
                return Err(corrupt(format!("a head of {len} bytes")));
            }
            let mut head = vec![0u8; len as usize];
            z.read_exact(&mut head)
                .map_err(|e| corrupt(format!("a head of {len} bytes cut short: {e}")))?;
            decode(key, &head)?
        }
        Some(&ZSTD) => {
            let body = zstd::stream::decode_all(&bytes[1..])
                .map_err(|e| corrupt(format!("decompressing: {e}")))?;
            decode(key, &body)?
        }
        _ => decode(key, bytes)?,
    };
    Ok(head.metrics)
}

/// Writes a cold file: per record its step (u64) and length (u32), little
/// endian, then its compact bytes; aside, synced, then renamed into place.
pub(super) fn write_cold(dir: &Path, path: &Path, rows: &[(u64, Vec<u8>)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    for (step, bytes) in rows {
        f.write_all(&step.to_le_bytes())?;
        f.write_all(&(bytes.len() as u32).to_le_bytes())?;
        f.write_all(bytes)?;
    }
    f.into_inner()?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// A cold file's records (see [`write_cold`]).
pub(super) fn read_cold(path: &Path) -> Result<Vec<(u64, Vec<u8>)>> {
    let corrupt = |message: String| StoreError::Corrupt {
        what: path.display().to_string(),
        message,
    };
    let data = std::fs::read(path).map_err(|e| corrupt(format!("reading: {e}")))?;
    let mut rows = Vec::new();
    let mut rest = data.as_slice();
    while !rest.is_empty() {
        let (Some(step), Some(len)) = (rest.get(..8), rest.get(8..12)) else {
            return Err(corrupt(format!(
                "a record header cut short after {} records",
                rows.len()
            )));
        };
        let step = u64::from_le_bytes(step.try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        let Some(bytes) = rest.get(12..12 + len) else {
            return Err(corrupt(format!("step {step}'s record cut short")));
        };
        rows.push((step, bytes.to_vec()));
        rest = &rest[12 + len..];
    }
    Ok(rows)
}
