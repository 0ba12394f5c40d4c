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

use std::path::{Path, PathBuf};

/// The environment variable naming the cache directory.
pub const CACHE_DIR_ENV: &str = "ACCRUE_CACHE_DIR";

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
        let mut all = Vec::new();
        walk(entry, &mut all);
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

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        if p.is_dir() {
            walk(&p, out);
        } else if SUFFIXES.iter().any(|s| name.ends_with(s)) {
            out.push(p);
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
