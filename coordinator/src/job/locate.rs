//! Where a job's files are: a data entry may be a file, a directory (every
//! dataset file under it, a local Hugging Face dataset snapshot included:
//! `data/*.parquet`, `*.jsonl`, files named by split) or a glob; a model
//! or tokenizer may be named by a Hugging Face model id, resolved offline
//! in the standard cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`: `models--ORG--NAME/refs/main` names the
//! snapshot under `snapshots/`). Nothing is downloaded.
//!
//! Entries are expanded once, at submit, and the job keeps the file list,
//! so a document's `file` index means the same file after a restart.

use std::collections::hash_map::{Entry, HashMap};
use std::path::{Path, PathBuf};

/// The environment variable naming the cache directory.
pub const CACHE_DIR_ENV: &str = "ACCRUE_CACHE_DIR";

/// The `--help` text of every command that tokenizes or looks into the
/// token cache.
pub const CACHE_ENV_HELP: &str = "Environment:\n  ACCRUE_CACHE_DIR  where token stores are kept when a spec sets no data.cache_dir \
     (else $XDG_CACHE_HOME/accrue/tokens, else ~/.cache/accrue/tokens)";

/// Where token stores live (the default of `data.cache_dir`): `$ACCRUE_CACHE_DIR`, else `$XDG_CACHE_HOME/accrue/tokens`,
/// else `~/.cache/accrue/tokens`, else the temporary directory.
pub fn default_cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os(CACHE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("accrue/tokens");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(h).join(".cache/accrue/tokens");
    }
    std::env::temp_dir().join("accrue-tokens")
}

/// Dataset file suffixes a directory entry picks up.
const SUFFIXES: &[&str] = &[".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet"];
/// Split names recognised in file and directory names.
const SPLITS: &[&str] = &["train", "test", "validation", "valid", "dev", "eval"];

/// Why an entry names no file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocateError {
    #[error("the glob {pattern:?} matches no dataset file")]
    NoMatch { pattern: String },
    #[error("bad glob {pattern:?}: {message}")]
    BadGlob { pattern: String, message: String },
    #[error("directory {} holds no dataset file (*.jsonl, *.json, *.gz, *.parquet){}", dir.display(), split.as_ref().map(|s| format!(" of split {s:?}")).unwrap_or_default())]
    EmptyDir { dir: PathBuf, split: Option<String> },
    #[error("{what} {id:?} is not a path, and no Hugging Face cache holds it: looked in {}", looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    NoModel {
        what: &'static str,
        id: String,
        looked: Vec<PathBuf>,
    },
}

/// The files an entry names: itself (a file, or a missing path, which
/// validation then names), a directory's dataset files of `split`, or a
/// glob's matches, sorted.
pub fn expand(entry: &Path, split: &str) -> Result<Vec<PathBuf>, LocateError> {
    let text = entry.to_string_lossy();
    if entry.is_dir() {
        let mut all = walk(entry);
        all.sort();
        let named: Vec<&PathBuf> = all
            .iter()
            .filter(|p| split_of(entry, p).is_some())
            .collect();
        let files: Vec<PathBuf> = if named.is_empty() {
            all
        } else {
            named
                .into_iter()
                .filter(|p| split_of(entry, p).as_deref() == Some(split))
                .cloned()
                .collect()
        };
        if files.is_empty() {
            return Err(LocateError::EmptyDir {
                dir: entry.to_path_buf(),
                split: Some(split.to_string()),
            });
        }
        return Ok(files);
    }
    if entry.exists() || !text.contains(['*', '?', '[']) {
        return Ok(vec![entry.to_path_buf()]);
    }
    let paths = glob::glob(&text).map_err(|e| LocateError::BadGlob {
        pattern: text.to_string(),
        message: e.to_string(),
    })?;
    let mut files: Vec<PathBuf> = paths
        .filter_map(Result::ok)
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LocateError::NoMatch {
            pattern: text.to_string(),
        });
    }
    Ok(files)
}

/// A file's identity, however it is reached: (device, inode).
type FileId = (u64, u64);

fn file_id(meta: &std::fs::Metadata) -> FileId {
    use std::os::unix::fs::MetadataExt as _;
    (meta.dev(), meta.ino())
}

/// Every dataset file under `root`, each once (issue 33, finding 9).
/// Links are followed, but every directory is read once, by identity: the
/// tree as it is first, then the directories links name (in order, each
/// one skipped when already read: a `latest -> v2` beside `v2`, a link to
/// a parent, which once read the same files again and again). A file
/// reached under two names counts once, under its name in the tree as it
/// is when it has one (a name that stays when a link is moved), else the
/// first in order. Every second name is logged: nothing is read twice,
/// and nothing silently left out.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut w = Walk::default();
    if let Ok(meta) = std::fs::metadata(root) {
        w.dirs.insert(file_id(&meta), root.to_path_buf());
    }
    w.read(root, false);
    let mut next = 0;
    while let Some(link) = w.links.get(next).cloned() {
        next += 1;
        let Ok(meta) = std::fs::metadata(&link) else {
            continue;
        };
        if let Some(first) = w.dirs.get(&file_id(&meta)) {
            tracing::warn!(link = %link.display(), dir = %first.display(), "data: a link names a directory already read; its files count once");
            continue;
        }
        w.dirs.insert(file_id(&meta), link.clone());
        w.read(&link, true);
    }
    // The tree's own names first, then by name; the first of an identity
    // is kept.
    w.found
        .sort_by(|a, b| (a.linked, &a.path).cmp(&(b.linked, &b.path)));
    let mut kept: HashMap<FileId, PathBuf> = HashMap::new();
    let mut out = Vec::new();
    for f in w.found {
        if let Some(first) = kept.get(&f.id) {
            tracing::warn!(file = %f.path.display(), same_as = %first.display(), "data: a file reached under a second name counts once");
            continue;
        }
        kept.insert(f.id, f.path.clone());
        out.push(f.path);
    }
    out
}

/// A dataset file a walk found.
struct Found {
    path: PathBuf,
    id: FileId,
    /// Reached through a link (to it, or to a directory above it).
    linked: bool,
}

/// A walk under way: the directories read (by identity, with the name
/// each was read under), the links to directories still to read, and the
/// files found.
#[derive(Default)]
struct Walk {
    dirs: HashMap<FileId, PathBuf>,
    links: Vec<PathBuf>,
    found: Vec<Found>,
}

impl Walk {
    /// Reads `dir` and the directories in it (not those behind links:
    /// they wait in `links`), in name order.
    fn read(&mut self, dir: &Path, linked: bool) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = entries.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let p = e.path();
            let is_link = e.file_type().is_ok_and(|t| t.is_symlink());
            // Follows a link; a dangling one is nothing.
            let Ok(meta) = std::fs::metadata(&p) else {
                continue;
            };
            if meta.is_dir() {
                if is_link {
                    self.links.push(p);
                } else if let Entry::Vacant(v) = self.dirs.entry(file_id(&meta)) {
                    v.insert(p.clone());
                    self.read(&p, linked);
                }
            } else if SUFFIXES.iter().any(|s| name.ends_with(s)) {
                self.found.push(Found {
                    path: p,
                    id: file_id(&meta),
                    linked: linked || is_link,
                });
            }
        }
    }
}

/// The split a file under `root` is named for: a path component or a file
/// name that is, or starts with, a split name (`train-00000-of-00002`).
fn split_of(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).unwrap_or(file);
    rel.components().rev().find_map(|c| {
        let c = c.as_os_str().to_string_lossy();
        let stem = c.split('.').next().unwrap_or(&c);
        SPLITS.iter().find_map(|s| {
            let hit = stem == *s
                || stem.starts_with(&format!("{s}-"))
                || stem.starts_with(&format!("{s}_"));
            hit.then(|| {
                if *s == "valid" || *s == "dev" {
                    "validation".to_string()
                } else {
                    s.to_string()
                }
            })
        })
    })
}

/// Whether `s` has the shape of a Hugging Face repo id (`org/name`).
pub fn looks_like_model_id(s: &str) -> bool {
    let mut parts = s.split('/');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
    };
    ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

/// The hub cache directories to look in, in order.
pub fn hub_dirs() -> Vec<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut dirs = Vec::new();
    if let Some(d) = env("HF_HUB_CACHE").or_else(|| env("HUGGINGFACE_HUB_CACHE")) {
        dirs.push(d);
    }
    if let Some(h) = env("HF_HOME") {
        dirs.push(h.join("hub"));
    }
    let home = env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache")));
    if let Some(c) = home {
        dirs.push(c.join("huggingface/hub"));
    }
    dirs.dedup();
    dirs
}

/// The snapshot directory of model `id` in the first hub cache that holds
/// one (`refs/main`, else the only snapshot).
pub fn model_snapshot(id: &str, what: &'static str) -> Result<PathBuf, LocateError> {
    let dirs = hub_dirs();
    let repo = format!("models--{}", id.replace('/', "--"));
    let mut looked = Vec::new();
    for d in &dirs {
        let root = d.join(&repo);
        looked.push(root.clone());
        let snaps = root.join("snapshots");
        if let Ok(rev) = std::fs::read_to_string(root.join("refs/main")) {
            // A revision names a snapshot of this repository, never a path
            // (issue 33: `../../models--other/snapshots/x` was joined as is).
            let rev = rev.trim();
            let one_name = std::path::Path::new(rev)
                .components()
                .eq([std::path::Component::Normal(rev.as_ref())]);
            let s = snaps.join(rev);
            if one_name && s.is_dir() {
                return Ok(s);
            }
        }
        if let Ok(entries) = std::fs::read_dir(&snaps) {
            let all: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            if all.len() == 1 {
                return Ok(all[0].clone());
            }
        }
    }
    Err(LocateError::NoModel {
        what,
        id: id.to_string(),
        looked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "{}\n").unwrap();
    }

    #[test]
    fn a_snapshot_directory_expands_to_its_split() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        for f in [
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/test-00000-of-00001.parquet",
            "README.md",
            ".cache/x.jsonl",
        ] {
            touch(&r.join(f));
        }
        let train = expand(r, "train").unwrap();
        assert_eq!(
            train,
            vec![
                r.join("data/train-00000-of-00002.parquet"),
                r.join("data/train-00001-of-00002.parquet")
            ]
        );
        assert_eq!(
            expand(r, "test").unwrap(),
            vec![r.join("data/test-00000-of-00001.parquet")]
        );
        assert!(matches!(
            expand(r, "validation"),
            Err(LocateError::EmptyDir { .. })
        ));
        // Without split names every dataset file counts.
        let plain = tempfile::tempdir().unwrap();
        touch(&plain.path().join("b.jsonl"));
        touch(&plain.path().join("a.json.gz"));
        assert_eq!(
            expand(plain.path(), "train").unwrap(),
            vec![plain.path().join("a.json.gz"), plain.path().join("b.jsonl")]
        );
        // A glob, sorted; one matching nothing is an error naming it.
        let g = expand(&r.join("data/*.parquet"), "train").unwrap();
        assert_eq!(g.len(), 3);
        let e = expand(&r.join("data/*.csv"), "train").unwrap_err();
        assert!(e.to_string().contains("matches no dataset file"), "{e}");
    }

    /// Issue 33 (9): a directory reached twice (`latest -> v2`), a link to
    /// its own parent and a file linked under a second name: the walk
    /// ends, and lists each file once, by its real path.
    #[test]
    fn a_linked_directory_or_file_is_listed_once_and_a_link_cycle_ends() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        touch(&r.join("v1/a.jsonl"));
        touch(&r.join("v2/b.jsonl"));
        std::os::unix::fs::symlink("v2", r.join("latest")).unwrap();
        std::os::unix::fs::symlink(".", r.join("loop")).unwrap();
        std::os::unix::fs::symlink("..", r.join("v1/up")).unwrap();
        std::os::unix::fs::symlink("v1/a.jsonl", r.join("alias.jsonl")).unwrap();
        assert_eq!(
            expand(r, "train").unwrap(),
            vec![r.join("v1/a.jsonl"), r.join("v2/b.jsonl")]
        );
        // A link to a directory outside the entry is read like one inside.
        let outside = tempfile::tempdir().unwrap();
        touch(&outside.path().join("c.jsonl"));
        std::os::unix::fs::symlink(outside.path(), r.join("more")).unwrap();
        assert_eq!(
            expand(r, "train").unwrap(),
            vec![
                r.join("more/c.jsonl"),
                r.join("v1/a.jsonl"),
                r.join("v2/b.jsonl")
            ]
        );
    }

    #[test]
    fn model_ids_resolve_in_the_hub_cache_offline() {
        assert!(looks_like_model_id("microsoft/Phi-3-mini-4k-instruct"));
        assert!(!looks_like_model_id("/abs/path"));
        assert!(!looks_like_model_id("a/b/c"));
        assert!(!looks_like_model_id("random"));
        let d = tempfile::tempdir().unwrap();
        let repo = d.path().join("hub/models--org--tiny");
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        // The env is process-wide: this test alone sets HF_HUB_CACHE.
        std::env::set_var("HF_HUB_CACHE", d.path().join("hub"));
        let got = model_snapshot("org/tiny", "model.init").unwrap();
        assert_eq!(got, repo.join("snapshots/abc123"));
        // A `refs/main` that is a path out of its repository is not
        // followed: the repository's only snapshot is taken instead.
        let evil = d.path().join("hub/models--org--evil");
        std::fs::create_dir_all(evil.join("snapshots/def456")).unwrap();
        std::fs::create_dir_all(evil.join("refs")).unwrap();
        std::fs::write(
            evil.join("refs/main"),
            "../../models--org--tiny/snapshots/abc123\n",
        )
        .unwrap();
        let got = model_snapshot("org/evil", "model.init").unwrap();
        assert_eq!(got, evil.join("snapshots/def456"));
        let e = model_snapshot("org/absent", "data.tokenizer").unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("data.tokenizer \"org/absent\" is not a path, and no Hugging Face cache holds it: looked in "), "{msg}");
        assert!(
            msg.contains(
                &d.path()
                    .join("hub/models--org--absent")
                    .display()
                    .to_string()
            ),
            "{msg}"
        );
        std::env::remove_var("HF_HUB_CACHE");
    }
}
