//! Reading a checkpoint's JSON files, bounded, and what can be wrong with
//! a checkpoint's files.

use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest manifest or marker read (a marker lists a few hundred
/// files at most).
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// Why a checkpoint directory cannot be restored from.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("{}: missing, the checkpoint is incomplete", .0.display())]
    Missing(PathBuf),
    #[error("{}: invalid json: {message}", path.display())]
    Json { path: PathBuf, message: String },
    #[error("{}: {what}", path.display())]
    Bad { path: PathBuf, what: String },
}

impl VerifyError {
    pub(crate) fn bad(path: &Path, what: impl Into<String>) -> VerifyError {
        VerifyError::Bad {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }

    pub(crate) fn io(path: &Path, e: std::io::Error) -> VerifyError {
        if e.kind() == std::io::ErrorKind::NotFound {
            VerifyError::Missing(path.to_path_buf())
        } else {
            VerifyError::bad(path, e.to_string())
        }
    }
}

/// A JSON file of the checkpoint, read only if it is a regular file of at
/// most [`MAX_JSON_BYTES`].
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, VerifyError> {
    let meta = std::fs::metadata(path).map_err(|e| VerifyError::io(path, e))?;
    if !meta.is_file() {
        return Err(VerifyError::bad(path, "not a regular file"));
    }
    if meta.len() > MAX_JSON_BYTES {
        return Err(VerifyError::bad(
            path,
            format!("{} bytes, at most {MAX_JSON_BYTES} expected", meta.len()),
        ));
    }
    let mut text = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_JSON_BYTES + 1).read_to_end(&mut text))
        .map_err(|e| VerifyError::io(path, e))?;
    serde_json::from_slice(&text).map_err(|e| VerifyError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
