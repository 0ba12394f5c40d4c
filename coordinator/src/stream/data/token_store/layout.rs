//! The token store's layout on disk: its record sizes and version, the
//! metadata and bad-row records, the index entries, and its error.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub(super) const ROW_BYTES: usize = 24;
pub(super) const DOC_BYTES: usize = 24;
/// Bumped when the layout or what a row holds changes: old stores are
/// then simply not found.
pub const LAYOUT_VERSION: u32 = 1;

#[cfg(not(target_endian = "little"))]
compile_error!("the token store maps little-endian ids in place");

/// Why a store could not be written or opened.
#[derive(Debug, thiserror::Error)]
pub enum TokenStoreError {
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

pub type Result<T, E = TokenStoreError> = std::result::Result<T, E>;

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
pub(super) struct RolloutExtra {
    pub(super) reward: f64,
    pub(super) group: String,
    pub(super) policy_version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) old_logprobs: Option<Vec<f32>>,
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
