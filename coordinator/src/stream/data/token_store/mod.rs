//! The token store: one dataset file tokenized once into flat files on
//! disk and memory-mapped, so the coordinator keeps an index of documents
//! (their place, lengths and loss tokens) and reads token bytes only when a
//! plan is built. Which store belongs to which file, tokenizer and template
//! is [`super::cache`]'s business; this module only writes and reads one.
//!
//! Layout of a store directory (all integers little-endian):
//! - `ids.bin`: u32 token ids of every row, concatenated;
//! - `mask.bin`: one byte per token, 1 when its label is its own id, 0 when
//!   it is ignored (-100): the loss mask;
//! - `explicit.bin`: i32 labels of the rows whose labels are not of that
//!   form (pre-tokenized rows with their own `labels`), concatenated;
//! - `rows.bin`: per row `start: u64, len: u32, loss_tokens: u32,
//!   explicit: u64` (`u64::MAX` = labels from the mask);
//! - `docs.bin`: per document `line: u64, element: u64 (0 = none),
//!   first_row: u32, rows: u32` (a DPO pair has two rows);
//! - `extra.jsonl`: rollouts only, their reward, group, policy version and
//!   old log-probs, one line per document;
//! - `bad.jsonl`: the rows that were not documents, with line and reason;
//! - `meta.json`, written last: counts and the sizes of the files above.
//!
//! Atomic: a store is written into a temporary directory beside its final
//! name, every file synced, then renamed into place; a directory without a
//! `meta.json` whose sizes match is never opened, so a crash mid-write
//! leaves nothing usable behind.

mod layout;
mod writer;

pub use layout::{BadRow, DocEntry, Meta, Result, TokenStoreError, LAYOUT_VERSION};
pub use writer::Writer;

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::stream::doc::{DocBody, Rollout, Row, Sequence, TokenRows, IGNORE_INDEX};

use layout::{RolloutExtra, DOC_BYTES, ROW_BYTES};

/// A mapped file (an empty file maps to nothing).
struct Map(Option<Mmap>);

impl Map {
    fn open(path: &Path) -> std::io::Result<Map> {
        let f = File::open(path)?;
        if f.metadata()?.len() == 0 {
            return Ok(Map(None));
        }
        // Safety: store files are written once, then renamed into place and
        // never modified (a rebuild writes a new directory).
        Ok(Map(Some(unsafe { Mmap::map(&f)? })))
    }

    fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

/// An open store: its files mapped, its rollouts' fields and bad rows read.
pub struct TokenStore {
    dir: PathBuf,
    pub meta: Meta,
    ids: Map,
    mask: Map,
    explicit: Map,
    rows: Map,
    docs: Map,
    rollouts: Vec<RolloutExtra>,
    pub bad: Vec<BadRow>,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore")
            .field("dir", &self.dir)
            .field("meta", &self.meta)
            .finish()
    }
}

impl TokenStore {
    /// Opens a complete store; anything incomplete or inconsistent is an
    /// error (the caller rebuilds it).
    pub fn open(dir: &Path) -> Result<TokenStore> {
        let damaged = |why: String| TokenStoreError::Damaged {
            dir: dir.to_path_buf(),
            why,
        };
        let meta: Meta = std::fs::read(dir.join("meta.json"))
            .map_err(|e| damaged(format!("meta.json: {e}")))
            .and_then(|b| {
                serde_json::from_slice(&b).map_err(|e| damaged(format!("meta.json: {e}")))
            })?;
        if meta.version != LAYOUT_VERSION {
            return Err(damaged(format!("layout version {}", meta.version)));
        }
        let map = |n: &str, want: u64| -> Result<Map> {
            let m = Map::open(&dir.join(n)).map_err(|e| damaged(format!("{n}: {e}")))?;
            let got = m.bytes().len() as u64;
            if got != want {
                return Err(damaged(format!(
                    "{n} holds {got} bytes, meta.json says {want}"
                )));
            }
            Ok(m)
        };
        let store = TokenStore {
            ids: map("ids.bin", meta.tokens * 4)?,
            mask: map("mask.bin", meta.tokens)?,
            explicit: map("explicit.bin", meta.explicit_labels * 4)?,
            rows: map("rows.bin", meta.rows * ROW_BYTES as u64)?,
            docs: map("docs.bin", meta.docs * DOC_BYTES as u64)?,
            rollouts: if meta.rollouts {
                read_lines(&dir.join("extra.jsonl")).map_err(damaged)?
            } else {
                Vec::new()
            },
            bad: read_lines(&dir.join("bad.jsonl")).map_err(damaged)?,
            dir: dir.to_path_buf(),
            meta,
        };
        if store.meta.rollouts && store.rollouts.len() as u64 != store.meta.docs {
            return Err(damaged("extra.jsonl does not hold every rollout".into()));
        }
        if store.bad.len() as u64 != store.meta.bad {
            return Err(damaged("bad.jsonl does not hold every bad row".into()));
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn docs(&self) -> usize {
        self.meta.docs as usize
    }

    /// Document `i` of the file, in file order.
    pub fn doc(&self, i: usize) -> DocEntry {
        let r = &self.docs.bytes()[i * DOC_BYTES..(i + 1) * DOC_BYTES];
        let element = u64_at(r, 8);
        DocEntry {
            line: u64_at(r, 0),
            element: (element != 0).then_some(element),
            first_row: u32_at(r, 16),
            rows: u32_at(r, 20),
        }
    }

    /// Row `index` as the row table describes it.
    pub fn row(&self, index: u32) -> Row {
        let i = index as usize;
        let r = &self.rows.bytes()[i * ROW_BYTES..(i + 1) * ROW_BYTES];
        Row {
            start: u64_at(r, 0),
            len: u32_at(r, 8),
            loss_tokens: u32_at(r, 12),
            explicit: u64_at(r, 16),
        }
    }

    /// Row `row`'s ids as stored: little-endian, 4 bytes each.
    fn id_bytes(&self, row: &Row) -> &[u8] {
        let (start, len) = (row.start as usize, row.len as usize);
        &self.ids.bytes()[start * 4..(start + len) * 4]
    }

    /// Row `row`'s loss mask: a byte per token, 1 when its label is its id.
    fn mask_bytes(&self, row: &Row) -> &[u8] {
        let (start, len) = (row.start as usize, row.len as usize);
        &self.mask.bytes()[start..start + len]
    }

    /// Tokens of document `i` (a pair counts both rows), without touching
    /// its token bytes.
    pub fn doc_tokens(&self, i: usize) -> u64 {
        let d = self.doc(i);
        (d.first_row..d.first_row + d.rows)
            .map(|r| u64::from(self.row(r).len))
            .sum()
    }

    /// Document `i` as the planner sees it: its rows mapped, not copied.
    pub fn body(self: &Arc<Self>, i: usize) -> DocBody {
        let d = self.doc(i);
        let seq = |r: u32| {
            let rows: Arc<dyn TokenRows> = self.clone();
            Sequence::mapped(rows, self.row(r))
        };
        if self.meta.rollouts {
            let x = &self.rollouts[i];
            return DocBody::Rollout(Rollout {
                seq: seq(d.first_row),
                reward: x.reward,
                group: x.group.clone(),
                policy_version: x.policy_version,
                old_logprobs: x.old_logprobs.clone(),
                routing: None,
            });
        }
        match d.rows {
            2 => DocBody::Pair {
                chosen: seq(d.first_row),
                rejected: seq(d.first_row + 1),
            },
            _ => DocBody::Sft(seq(d.first_row)),
        }
    }
}

impl TokenRows for TokenStore {
    fn ids(&self, row: &Row) -> &[u32] {
        // The map is page-aligned and every id is 4 bytes from its start.
        bytemuck::cast_slice(self.id_bytes(row))
    }

    fn labels(&self, row: &Row) -> Cow<'_, [i32]> {
        if let Some(at) = row.explicit_labels() {
            let at = at as usize * 4;
            let bytes = &self.explicit.bytes()[at..at + row.len as usize * 4];
            return Cow::Borrowed(bytemuck::cast_slice(bytes));
        }
        Cow::Owned(
            self.ids(row)
                .iter()
                .zip(self.mask_bytes(row))
                .map(|(&id, &m)| if m == 1 { id as i32 } else { IGNORE_INDEX })
                .collect(),
        )
    }

    fn write_le(&self, row: &Row, ids: &mut Vec<u8>, labels: &mut Vec<u8>) {
        // The files hold little-endian 4-byte values already (see `ids`).
        let id_bytes = self.id_bytes(row);
        ids.extend_from_slice(id_bytes);
        if let Some(at) = row.explicit_labels() {
            let at = at as usize * 4;
            labels.extend_from_slice(&self.explicit.bytes()[at..at + id_bytes.len()]);
            return;
        }
        let at = labels.len();
        labels.resize(at + id_bytes.len(), 0);
        let out = labels[at..].chunks_exact_mut(4);
        for ((b, id), &m) in out.zip(id_bytes.chunks_exact(4)).zip(self.mask_bytes(row)) {
            match m {
                1 => b.copy_from_slice(id),
                _ => b.copy_from_slice(&IGNORE_INDEX.to_le_bytes()),
            }
        }
    }

    fn prefetch(&self, row: &Row) {
        crate::stream::prefetch::first_line(self.id_bytes(row));
        crate::stream::prefetch::first_line(self.mask_bytes(row));
    }

    /// A row without explicit labels has its ids or ignored (see `write_le`).
    fn write_masked(
        &self,
        row: &Row,
        ids: &mut Vec<u8>,
        mask: &mut accrue_proto::LossMask,
    ) -> bool {
        if row.explicit_labels().is_some() {
            return false;
        }
        ids.extend_from_slice(self.id_bytes(row));
        mask.extend_flags(self.mask_bytes(row));
        true
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn read_lines<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>, String> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let f = File::open(path).map_err(|e| format!("{name}: {e}"))?;
    BufReader::new(f)
        .lines()
        .map(|l| {
            let l = l.map_err(|e| format!("{name}: {e}"))?;
            serde_json::from_str(&l).map_err(|e| format!("{name}: {e}"))
        })
        .collect()
}
