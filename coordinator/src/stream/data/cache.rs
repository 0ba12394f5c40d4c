//! The token cache: every dataset file is tokenized once into a token store
//! ([`super::token_store`]) under a key that hashes everything its documents
//! depend on — the file's bytes, the tokenizer (`tokenizer.json` and the
//! `tokenizer_config.json` beside it), the chat template, the document
//! kind, the model's vocabulary bound for pre-tokenized ids and the store
//! layout. The same file under the same encoder is found again by any job
//! and after a coordinator restart; changing any input changes the key, so
//! a stale store is never used (it stays on disk until removed).
//!
//! What is *not* in the key is applied when a store is opened: the job's
//! `max_tokens` with `on_overlong`, and `on_bad_line` (the store remembers
//! its bad rows), so jobs with different budgets share one store.
//!
//! Building tokenizes batches of rows on every core (rayon), in file
//! order, while the file streams through ([`super::read::for_each_batch`]).

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use super::build::build_doc;
use super::error::{DataError, Result};
use super::format::Encoder;
use super::row::RawRow;
use super::token_store::{self, BadRow, TokenStore, TokenStoreError, Writer};
use crate::job::data::DataFormat;

/// Rows tokenized per parallel batch while building.
const BATCH_ROWS: usize = 8192;

/// What an encoder's output depends on, hashed once per job and source:
/// the files it was built from and the settings that shape documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderKey(u128);

impl EncoderKey {
    /// Hashes the tokenizer (with its `tokenizer_config.json` and
    /// `chat_template.jinja`), the chat template file, the document kind
    /// and the model's vocabulary bound.
    pub fn new(
        tokenizer: Option<&Path>,
        chat_template: Option<&Path>,
        template_name: Option<&str>,
        format: DataFormat,
        model_vocab: u32,
    ) -> Result<EncoderKey> {
        let mut h = Xxh3::new();
        h.update(b"accrue-token-cache");
        h.update(&token_store::LAYOUT_VERSION.to_le_bytes());
        // How a tokenizer.json is run (its class's pipeline) and how a
        // template is rendered: stores built before that changed are
        // other ids.
        h.update(b"pipeline=transformers-5");
        h.update(format!("{format:?}").as_bytes());
        h.update(&model_vocab.to_le_bytes());
        match tokenizer {
            None => h.update(b"tokenizer=bytes"),
            Some(p) => {
                h.update(b"tokenizer=");
                hash_file(&mut h, p)?;
                let cfg = p.with_file_name("tokenizer_config.json");
                if cfg.is_file() {
                    h.update(b"config=");
                    hash_file(&mut h, &cfg)?;
                }
                let jinja = p.with_file_name(super::template::CHAT_TEMPLATE_FILE);
                if jinja.is_file() {
                    h.update(b"chat_template.jinja=");
                    hash_file(&mut h, &jinja)?;
                }
                let folder = p.parent().unwrap_or(Path::new("."));
                let named = super::template::named_template_files(folder).map_err(|e| {
                    crate::job::input::InputError::io(
                        &p.with_file_name(super::template::CHAT_TEMPLATE_DIR),
                        e,
                    )
                })?;
                for f in named {
                    h.update(f.file_name().unwrap_or_default().as_encoded_bytes());
                    hash_file(&mut h, &f)?;
                }
            }
        }
        if let Some(t) = chat_template {
            h.update(b"template=");
            hash_file(&mut h, t)?;
        }
        if let Some(n) = template_name {
            h.update(b"template_name=");
            h.update(n.as_bytes());
        }
        Ok(EncoderKey(h.digest128()))
    }
}

/// The key of one file under one encoder, with what the file was when its
/// bytes were hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileKey {
    /// The store's directory name under the cache root.
    pub key: String,
    stamp: Stamp,
}

/// A file's identity and last change (device, inode, length, modification
/// and status-change times): a write to it changes one of them, so a build
/// that sees the same stamp before and after reading read the bytes the
/// key hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Vec<i128>);

impl Stamp {
    fn of(path: &Path) -> Result<Stamp> {
        let m = std::fs::metadata(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            Ok(Stamp(vec![
                m.dev().into(),
                m.ino().into(),
                m.size().into(),
                m.mtime().into(),
                m.mtime_nsec().into(),
                m.ctime().into(),
                m.ctime_nsec().into(),
            ]))
        }
        #[cfg(not(unix))]
        {
            let t = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos() as i128);
            Ok(Stamp(vec![m.len().into(), t]))
        }
    }

    /// Fails with [`DataError::Changed`] when `path` is no longer `self`.
    fn check(&self, path: &Path) -> Result<()> {
        if Stamp::of(path)? == *self {
            Ok(())
        } else {
            Err(DataError::Changed {
                path: path.to_path_buf(),
            })
        }
    }
}

/// The key of one file under one encoder. A file written to while it is
/// hashed is refused ([`DataError::Changed`]) rather than filed under a key
/// of bytes it no longer holds.
pub fn file_key(path: &Path, enc: EncoderKey) -> Result<FileKey> {
    // Checked first (a FIFO or directory named as such), then stamped.
    crate::job::input::check(path)?;
    let stamp = Stamp::of(path)?;
    let mut h = Xxh3::new();
    h.update(&enc.0.to_le_bytes());
    hash_file(&mut h, path)?;
    stamp.check(path)?;
    Ok(FileKey {
        key: format!("{:032x}", h.digest128()),
        stamp,
    })
}

fn hash_file(h: &mut Xxh3, path: &Path) -> Result<()> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    crate::job::input::check(path)?;
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

/// Progress of a build, reported after every batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    pub rows: u64,
    pub bad: u64,
}

/// How a store was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Opened as it was on disk.
    Hit,
    /// Built now (absent, or on disk but incomplete).
    Built,
}

impl Found {
    /// `hit` or `built` (what `accrue data prepare --json` reports).
    pub fn name(self) -> &'static str {
        match self {
            Found::Hit => "hit",
            Found::Built => "built",
        }
    }
}

/// Opens the store of `path` under `key` in `root`, building it when it is
/// absent or damaged.
pub fn open_or_build(
    root: &Path,
    key: &FileKey,
    path: &Path,
    enc: &Encoder,
    format: DataFormat,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<(Arc<TokenStore>, Found)> {
    let dir = root.join(&key.key);
    if dir.exists() {
        match TokenStore::open(&dir) {
            Ok(s) => return Ok((Arc::new(s), Found::Hit)),
            Err(e) => {
                // Stores appear only by a rename of a finished one, so this
                // is damage (a disk error, a hand edit): never used, rebuilt.
                tracing::warn!(error = %e, "rebuilding a damaged token store");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    build(&dir, key, path, enc, format, progress)?;
    let s = TokenStore::open(&dir).map_err(|e| store_error(path, e))?;
    Ok((Arc::new(s), Found::Built))
}

fn store_error(path: &Path, e: TokenStoreError) -> DataError {
    DataError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Tokenizes `path` into a new store at `dest` (atomically). The store is
/// made visible only when `path` is still what `key` hashed after every row
/// was read: a file rewritten in between is refused, never filed under the
/// old bytes' key.
pub fn build(
    dest: &Path,
    key: &FileKey,
    path: &Path,
    enc: &Encoder,
    format: DataFormat,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<token_store::Meta> {
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(|source| DataError::Io {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    let mut w = Writer::create(dest, path).map_err(|e| store_error(path, e))?;
    let mut seen = Progress::default();
    let result = super::read::for_each_batch(path, BATCH_ROWS, |rows: Vec<RawRow>| {
        let bodies: Vec<_> = rows
            .par_iter()
            .map(|r| match &r.value {
                Ok(v) => build_doc(enc, format, v).map_err(|e| (false, e)),
                Err(e) => Err((true, e.clone())),
            })
            .collect();
        // A chat row without the model's template fails the build (the
        // store is not kept), never a bad row.
        enc.template.check_needed()?;
        for (row, body) in rows.iter().zip(bodies) {
            let pushed = match body {
                Ok(b) => w.push(row.line, row.element, &b),
                Err((json, reason)) => {
                    seen.bad += 1;
                    w.push_bad(&BadRow {
                        line: row.line,
                        element: row.element,
                        json,
                        reason,
                    })
                }
            };
            pushed.map_err(|e| store_error(path, e))?;
        }
        seen.rows += rows.len() as u64;
        progress(seen);
        Ok(())
    });
    match result.and_then(|_| key.stamp.check(path)) {
        Ok(()) => w.finish(dest).map_err(|e| store_error(path, e)),
        Err(e) => {
            w.abandon();
            Err(e)
        }
    }
}
