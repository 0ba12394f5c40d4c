//! One row of a dataset file as a reader found it: where it starts and
//! its parsed value (or why it could not be parsed).

use std::path::Path;

use serde_json::Value;

use super::error::Location;

/// One row of a file with where it starts.
#[derive(Debug)]
pub struct RawRow {
    /// 1-based text line where the row starts.
    pub line: u64,
    /// 1-based element index for JSON-array files.
    pub element: Option<u64>,
    /// The parsed row, or the JSON error message.
    pub value: std::result::Result<Value, String>,
}

impl RawRow {
    /// The document line of `DocId`: the element for JSON arrays, else the
    /// text line.
    pub fn doc_line(&self) -> u64 {
        self.element.unwrap_or(self.line)
    }

    pub fn location(&self, path: &Path) -> Location {
        Location {
            path: path.to_path_buf(),
            line: self.line,
            element: self.element,
        }
    }
}
