//! Writing a token store: into a temporary directory beside its final
//! name, every file synced, then renamed into place. The builder holds an
//! exclusive lock on its temporary directory while it writes, so another
//! process (in any PID namespace on the host) removes a leftover directory
//! only when nobody holds it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::layout::{
    BadRow, Meta, Result, RolloutExtra, TokenStoreError, DOC_BYTES, LAYOUT_VERSION, ROW_BYTES,
};
use crate::stream::doc::{DocBody, Row, Sequence, IGNORE_INDEX};

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
    /// The temporary directory opened and locked (`flock`) for the build's
    /// lifetime; released when the writer is dropped.
    _lock: File,
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
        sweep_abandoned_builds(parent, &name);
        let io = |what| {
            let dir = tmp.clone();
            move |source| TokenStoreError::Io { dir, what, source }
        };
        std::fs::create_dir_all(&tmp).map_err(io("cannot create it"))?;
        let lock = File::open(&tmp).map_err(io("cannot open it"))?;
        lock.lock().map_err(io("cannot lock it"))?;
        // A sweeper may have taken the lock between the mkdir and ours and
        // removed the directory: then it is gone and this build fails
        // cleanly rather than writing into an unlinked directory.
        if !tmp.is_dir() {
            return Err(io("removed while it was being created")(
                std::io::ErrorKind::NotFound.into(),
            ));
        }
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
            _lock: lock,
        })
    }

    fn io(&self, what: &'static str) -> impl Fn(std::io::Error) -> TokenStoreError + '_ {
        move |source| TokenStoreError::Io {
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
            _lock,
        } = self;
        let io = |what| {
            let dir = tmp.clone();
            move |source| TokenStoreError::Io { dir, what, source }
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
/// builder holds its directory's lock until it finishes or abandons it, so
/// a directory whose lock can be taken has no builder. The lock is kept
/// while removing, so a builder that races its own creation sees its
/// directory gone (see [`Writer::create`]).
fn sweep_abandoned_builds(parent: &Path, name: &str) {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name();
        if !file.to_str().is_some_and(|f| f.starts_with(&prefix)) {
            continue;
        }
        let Ok(dir) = File::open(e.path()) else {
            continue;
        };
        if dir.try_lock().is_ok() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
