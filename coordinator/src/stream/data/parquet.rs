//! Parquet dataset files, in the row shapes JSONL files have: each row
//! becomes the JSON object of its columns (nested lists and structs
//! included, as a Hugging Face `messages` column is), so the same row
//! readers ([`super::format`]) apply. A row's "line" is its 1-based row
//! number. Read one row group at a time through the `parquet` crate's row
//! API: a file larger than memory streams.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};

use super::error::{DataError, Result};
use super::row::RawRow;

const MAGIC: &[u8; 4] = b"PAR1";

/// A `.parquet` file, or one that starts with the parquet magic.
pub fn is_parquet(path: &Path) -> std::io::Result<bool> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return Ok(true);
    }
    let mut head = [0u8; 4];
    let mut f = File::open(path)?;
    let n = f.read(&mut head)?;
    Ok(n == 4 && &head == MAGIC)
}

/// Streams the rows of a parquet file to `f` in batches of at most `batch`.
pub fn for_each_batch(
    path: &Path,
    batch: usize,
    mut f: impl FnMut(Vec<RawRow>) -> Result<()>,
) -> Result<u64> {
    let bad = |e: parquet::errors::ParquetError| DataError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("parquet: {e}")),
    };
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    let mut rows = Vec::with_capacity(batch);
    let mut n = 0u64;
    for row in reader.get_row_iter(None).map_err(bad)? {
        let row = row.map_err(bad)?;
        n += 1;
        rows.push(RawRow {
            line: n,
            element: None,
            value: Ok(row.to_json_value()),
        });
        if rows.len() >= batch.max(1) {
            f(std::mem::replace(&mut rows, Vec::with_capacity(batch)))?;
        }
    }
    if !rows.is_empty() {
        f(rows)?;
    }
    Ok(n)
}
