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

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::stream::doc::{DocBody, Rollout, Row, Sequence, TokenRows, IGNORE_INDEX};

const ROW_BYTES: usize = 24;
const DOC_BYTES: usize = 24;
/// Bumped when the layout or what a row holds changes: old stores are
/// then simply not found.
pub const LAYOUT_VERSION: u32 = 1;

#[cfg(not(target_endian = "little"))]
compile_error!("the token store maps little-endian ids in place");

/// Why a store could not be written or opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("token store {}: {what}: {source}", dir.display())]
    Io {
        dir: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("token store {}: incomplete or damaged ({why})", dir.display())]
    Damaged { dir: PathBuf, why: String },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A row that did not become a document, as the store remembers it: the
/// job's `on_bad_line` decides later whether it is an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadRow {
    pub line: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub element: Option<u64>,
    /// True when the row was not valid JSON (else: not a usable document).
    #[serde(default)]
    pub json: bool,
    pub reason: String,
}

/// A rollout's fields besides its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RolloutExtra {
    reward: f64,
    group: String,
    policy_version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    old_logprobs: Option<Vec<f32>>,
}

/// What a store holds, written last (its presence marks it complete).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub version: u32,
    /// The file it was built from (for people; the key is the identity).
    pub source: String,
    /// Non-blank rows read.
    pub rows_read: u64,
    pub docs: u64,
    pub rows: u64,
    pub tokens: u64,
    pub loss_tokens: u64,
    pub bad: u64,
    pub explicit_labels: u64,
    pub rollouts: bool,
}

/// One document as the store indexes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocEntry {
    pub line: u64,
    pub element: Option<u64>,
    pub first_row: u32,
    pub rows: u32,
}

/// Writes a store into a temporary directory; [`Writer::finish`] makes it
/// visible under its final name.
pub struct Writer {
    tmp: PathBuf,
    ids: BufWriter<File>,
    mask: BufWriter<File>,
    explicit: BufWriter<File>,
    rows: BufWriter<File>,
    docs: BufWriter<File>,
    extra: BufWriter<File>,
    bad: BufWriter<File>,
    meta: Meta,
}

impl Writer {
    /// Starts a store meant for `dest` (created beside it, unique to this
    /// process and moment, so concurrent builders never share files).
    pub fn create(dest: &Path, source: &Path) -> Result<Writer> {
        let parent = dest.parent().unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy().into_owned());
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = parent.join(format!(".{name}.tmp-{}-{nonce}", std::process::id()));
        sweep_dead_builds(parent, &name);
        let io = |what| {
            let dir = tmp.clone();
            move |source| StoreError::Io { dir, what, source }
        };
        std::fs::create_dir_all(&tmp).map_err(io("cannot create it"))?;
        let file = |n: &str| -> Result<BufWriter<File>> {
            let f = File::create(tmp.join(n)).map_err(io("cannot create a file"))?;
            Ok(BufWriter::with_capacity(1 << 20, f))
        };
        Ok(Writer {
            ids: file("ids.bin")?,
            mask: file("mask.bin")?,
            explicit: file("explicit.bin")?,
            rows: file("rows.bin")?,
            docs: file("docs.bin")?,
            extra: file("extra.jsonl")?,
            bad: file("bad.jsonl")?,
            meta: Meta {
                version: LAYOUT_VERSION,
                source: source.display().to_string(),
                rows_read: 0,
                docs: 0,
                rows: 0,
                tokens: 0,
                loss_tokens: 0,
                bad: 0,
                explicit_labels: 0,
                rollouts: false,
            },
            tmp,
        })
    }

    fn io(&self, what: &'static str) -> impl Fn(std::io::Error) -> StoreError + '_ {
        move |source| StoreError::Io {
            dir: self.tmp.clone(),
            what,
            source,
        }
    }

    /// Appends one document read at `line` (`element` for JSON arrays).
    pub fn push(&mut self, line: u64, element: Option<u64>, body: &DocBody) -> Result<()> {
        self.meta.rows_read += 1;
        let first_row = self.meta.rows as u32;
        let seqs: Vec<&Sequence> = match body {
            DocBody::Sft(s) => vec![s],
            DocBody::Pair { chosen, rejected } => vec![chosen, rejected],
            DocBody::Rollout(r) => vec![&r.seq],
        };
        for s in &seqs {
            self.push_row(s)?;
        }
        let mut rec = [0u8; DOC_BYTES];
        rec[0..8].copy_from_slice(&line.to_le_bytes());
        rec[8..16].copy_from_slice(&element.unwrap_or(0).to_le_bytes());
        rec[16..20].copy_from_slice(&first_row.to_le_bytes());
        rec[20..24].copy_from_slice(&(seqs.len() as u32).to_le_bytes());
        self.docs
            .write_all(&rec)
            .map_err(self.io("cannot write docs.bin"))?;
        if let DocBody::Rollout(r) = body {
            self.meta.rollouts = true;
            let extra = RolloutExtra {
                reward: r.reward,
                group: r.group.clone(),
                policy_version: r.policy_version,
                old_logprobs: r.old_logprobs.clone(),
            };
            let mut line = serde_json::to_vec(&extra).expect("rollout fields serialise");
            line.push(b'\n');
            self.extra
                .write_all(&line)
                .map_err(self.io("cannot write extra.jsonl"))?;
        }
        self.meta.docs += 1;
        Ok(())
    }

    fn push_row(&mut self, s: &Sequence) -> Result<()> {
        let ids = s.input_ids();
        let labels = s.labels();
        let masked = ids
            .iter()
            .zip(labels.iter())
            .all(|(&id, &l)| l == IGNORE_INDEX || l == id as i32);
        let start = self.meta.tokens;
        let mut buf = Vec::with_capacity(ids.len() * 4);
        for id in ids {
            buf.extend_from_slice(&id.to_le_bytes());
        }
        self.ids
            .write_all(&buf)
            .map_err(self.io("cannot write ids.bin"))?;
        let mask: Vec<u8> = labels
            .iter()
            .map(|&l| u8::from(l != IGNORE_INDEX))
            .collect();
        self.mask
            .write_all(&mask)
            .map_err(self.io("cannot write mask.bin"))?;
        let explicit = if masked {
            Row::NO_EXPLICIT
        } else {
            let at = self.meta.explicit_labels;
            let mut buf = Vec::with_capacity(labels.len() * 4);
            for l in labels.iter() {
                buf.extend_from_slice(&l.to_le_bytes());
            }
            self.explicit
                .write_all(&buf)
                .map_err(self.io("cannot write explicit.bin"))?;
            self.meta.explicit_labels += labels.len() as u64;
            at
        };
        let loss_tokens = s.loss_tokens();
        let mut rec = [0u8; ROW_BYTES];
        rec[0..8].copy_from_slice(&start.to_le_bytes());
        rec[8..12].copy_from_slice(&(ids.len() as u32).to_le_bytes());
        rec[12..16].copy_from_slice(&(loss_tokens as u32).to_le_bytes());
        rec[16..24].copy_from_slice(&explicit.to_le_bytes());
        self.rows
            .write_all(&rec)
            .map_err(self.io("cannot write rows.bin"))?;
        self.meta.rows += 1;
        self.meta.tokens += ids.len() as u64;
        self.meta.loss_tokens += loss_tokens;
        Ok(())
    }

    /// Records a row that is not a document.
    pub fn push_bad(&mut self, bad: &BadRow) -> Result<()> {
        self.meta.rows_read += 1;
        self.meta.bad += 1;
        let mut line = serde_json::to_vec(bad).expect("a bad row serialises");
        line.push(b'\n');
        self.bad
            .write_all(&line)
            .map_err(self.io("cannot write bad.jsonl"))
    }

    /// Syncs every file, writes `meta.json` last and renames the directory
    /// to `dest`. When another builder got there first, its store is kept
    /// and this one removed (both hold the same content).
    pub fn finish(self, dest: &Path) -> Result<Meta> {
        let Writer {
            tmp,
            ids,
            mask,
            explicit,
            rows,
            docs,
            extra,
            bad,
            meta,
        } = self;
        let io = |what| {
            let dir = tmp.clone();
            move |source| StoreError::Io { dir, what, source }
        };
        for w in [ids, mask, explicit, rows, docs, extra, bad] {
            let f = w
                .into_inner()
                .map_err(|e| io("cannot flush a file")(e.into_error()))?;
            f.sync_all().map_err(io("cannot sync a file"))?;
        }
        let body = serde_json::to_vec_pretty(&meta).expect("meta serialises");
        let mut f = File::create(tmp.join("meta.json")).map_err(io("cannot write meta.json"))?;
        f.write_all(&body).map_err(io("cannot write meta.json"))?;
        f.sync_all().map_err(io("cannot sync meta.json"))?;
        drop(f);
        if let Err(e) = std::fs::rename(&tmp, dest) {
            if dest.join("meta.json").is_file() {
                let _ = std::fs::remove_dir_all(&tmp);
                return Ok(meta);
            }
            return Err(io("cannot move it into place")(e));
        }
        if let Some(parent) = dest.parent() {
            if let Ok(d) = File::open(parent) {
                let _ = d.sync_all();
            }
        }
        Ok(meta)
    }

    /// Removes the unfinished directory (a failed build).
    pub fn abandon(self) {
        let _ = std::fs::remove_dir_all(&self.tmp);
    }
}

/// Removes the unfinished directories of `name` left by builders that are
/// gone (a prepare killed mid-build): never used, but they hold disk. A
/// builder is gone when `/proc/PID` is; without `/proc` nothing is removed.
fn sweep_dead_builds(parent: &Path, name: &str) {
    let proc = Path::new("/proc/self");
    if !proc.exists() {
        return;
    }
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

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
pub struct Store {
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

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("meta", &self.meta)
            .finish()
    }
}

impl Store {
    /// Opens a complete store; anything incomplete or inconsistent is an
    /// error (the caller rebuilds it).
    pub fn open(dir: &Path) -> Result<Store> {
        let damaged = |why: String| StoreError::Damaged {
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
        let store = Store {
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

impl TokenRows for Store {
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
