//! Errors of the data stream. Every error names the file it comes from and,
//! where a row is at fault, the 1-based line of that row (for JSON-array
//! files also the 1-based element), so a user can open the file and look.

use std::fmt;
use std::path::PathBuf;

/// Where a row sits: its file, the 1-based text line where it starts, and
/// for JSON-array files its 1-based element index (the `DocId::line` of
/// such files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub path: PathBuf,
    pub line: u64,
    pub element: Option<u64>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.line)?;
        if let Some(e) = self.element {
            write!(f, " (element {e})")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong while loading a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A named file is missing, not a regular file or too large.
    #[error(transparent)]
    Input(#[from] crate::job::input::InputError),
    /// A file could not be read or decompressed.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line (JSONL) or the whole file (JSON array) is not valid JSON.
    #[error("{at}: invalid json: {message}")]
    Json { at: Location, message: String },
    /// A dataset file was written to while it was hashed or tokenized (the
    /// token cache files a store under its bytes' hash).
    #[error("{} changed while it was being read: tokenize it again once nothing writes to it", path.display())]
    Changed { path: PathBuf },
    /// A row parsed as JSON but is not a usable document.
    #[error("{at}: {reason}")]
    Row { at: Location, reason: String },
    /// A document longer than a microbatch's row (`data.max_tokens`, times
    /// `parallel.context`): never truncated.
    #[error("{at}: document has {tokens} tokens, more than {limit} (documents are never truncated; set data.on_overlong = \"skip\" to skip it, or raise data.max_tokens)")]
    Overlong {
        at: Location,
        tokens: u64,
        limit: crate::job::parallel::RowBudget,
    },
    /// The tokenizer file could not be loaded or is unusable.
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    /// A chat row met a Hugging Face tokenizer without a chat template (the
    /// built-in one is only the byte tokenizer's).
    #[error("tokenizer {}: chat rows need the model's chat template and it has none ({looked}): set data.chat_template to the template file", tokenizer.display())]
    NoChatTemplate { tokenizer: PathBuf, looked: String },
    /// The chat template could not be found, read or compiled.
    #[error("chat template {}: {message}", path.display())]
    Template { path: PathBuf, message: String },
    /// `data.format` is not the document kind the objective trains on.
    #[error("objective.kind = {} trains on data.format = {}, but data.format is {}", objective, super::format_for(*objective), format)]
    FormatMismatch {
        objective: crate::job::objective::ObjectiveKind,
        format: crate::job::data::DataFormat,
    },
    /// Every row was skipped or the files were empty.
    #[error("no documents in data.train ({rows} rows read, {bad} bad lines skipped, {overlong} overlong skipped)")]
    NoDocuments { rows: u64, bad: u64, overlong: u64 },
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;
