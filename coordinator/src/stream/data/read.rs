//! File readers: JSON Lines, a top-level JSON array, and gzip of either
//! (detected by a `.gz` suffix or the gzip magic bytes). [`for_each_batch`]
//! streams a file in batches of rows (JSON Lines, gzipped or not, and
//! parquet never need the whole file in memory; a top-level JSON array is
//! parsed whole), which is how the token cache reads; [`read_rows`] reads a
//! whole file at once.
//!
//! Rows come back as parsed JSON values with their position; a JSONL line
//! that is not valid JSON comes back as an `Err` row so the caller can apply
//! `data.on_bad_line`. A JSON array that does not parse cannot be resumed
//! past the error, so that is a file-level error.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::Value;

use super::error::{DataError, Location, Result};

use super::row::RawRow;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads a whole file (gunzipping when needed) as UTF-8 text.
pub fn read_text(path: &Path) -> Result<String> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    // Not a bare `fs::read`: a FIFO would block it and /dev/zero never end.
    crate::job::input::check(path)?;
    let bytes = std::fs::read(path).map_err(io)?;
    let gz = path.extension().is_some_and(|e| e == "gz") || bytes.starts_with(&GZIP_MAGIC);
    let bytes = if gz {
        let mut out = Vec::with_capacity(bytes.len() * 4);
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(io)?;
        out
    } else {
        bytes
    };
    let mut text = String::from_utf8(bytes).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not utf-8 text: {e}"),
        ))
    })?;
    if text.starts_with('\u{feff}') {
        text.drain(..3);
    }
    Ok(text)
}

/// Reads every row of a dataset file.
pub fn read_rows(path: &Path) -> Result<Vec<RawRow>> {
    let text = read_text(path)?;
    if text.trim_start().starts_with('[') {
        json_array_rows(path, &text)
    } else {
        Ok(jsonl_rows(&text))
    }
}

/// Streams the rows of a dataset file to `f` in batches of at most
/// `batch`, in file order; returns the rows read. Parquet files (by
/// suffix or magic) go through [`super::parquet`].
pub fn for_each_batch(
    path: &Path,
    batch: usize,
    mut f: impl FnMut(Vec<RawRow>) -> Result<()>,
) -> Result<u64> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    crate::job::input::check(path)?;
    if super::parquet::is_parquet(path).map_err(io)? {
        return super::parquet::for_each_batch(path, batch, f);
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let mut raw = BufReader::with_capacity(1 << 20, file);
    let gz = path.extension().is_some_and(|e| e == "gz")
        || raw.fill_buf().map_err(io)?.starts_with(&GZIP_MAGIC);
    let reader: Box<dyn BufRead> = if gz {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(raw),
        ))
    } else {
        Box::new(raw)
    };
    let mut lines = LineReader { inner: reader };
    let mut rows = Vec::with_capacity(batch);
    let mut total = 0u64;
    let mut line_no = 0u64;
    let mut buf = String::new();
    while lines.next(&mut buf).map_err(io)? {
        line_no += 1;
        if line_no == 1 && buf.starts_with('\u{feff}') {
            buf.drain(..3);
        }
        let text = buf.trim();
        if text.is_empty() {
            continue;
        }
        if total == 0 && rows.is_empty() && text.starts_with('[') {
            // A top-level JSON array: parsed whole, line numbers kept by
            // putting back the blank lines before it.
            let mut whole = "\n".repeat(line_no as usize - 1);
            whole.push_str(&buf);
            lines.inner.read_to_string(&mut whole).map_err(io)?;
            let all = json_array_rows(path, &whole)?;
            let n = all.len() as u64;
            let mut it = all.into_iter().peekable();
            while it.peek().is_some() {
                f(it.by_ref().take(batch.max(1)).collect())?;
            }
            return Ok(n);
        }
        rows.push(RawRow {
            line: line_no,
            element: None,
            value: serde_json::from_str(text).map_err(|e| e.to_string()),
        });
        total += 1;
        if rows.len() >= batch.max(1) {
            f(std::mem::replace(&mut rows, Vec::with_capacity(batch)))?;
        }
    }
    if !rows.is_empty() {
        f(rows)?;
    }
    Ok(total)
}

/// Lines of UTF-8 text, one at a time (a line that is not UTF-8 is an
/// error naming the file, as for a whole file).
struct LineReader {
    inner: Box<dyn BufRead>,
}

impl LineReader {
    fn next(&mut self, buf: &mut String) -> std::io::Result<bool> {
        buf.clear();
        match self.inner.read_line(buf) {
            Ok(0) => Ok(false),
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not utf-8 text: {e}"),
            )),
            Err(e) => Err(e),
        }
    }
}

/// JSON Lines: one value per non-blank line; blank lines are skipped.
pub fn jsonl_rows(text: &str) -> Vec<RawRow> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| RawRow {
            line: i as u64 + 1,
            element: None,
            value: serde_json::from_str(l).map_err(|e| e.to_string()),
        })
        .collect()
}

/// A top-level JSON array, element by element, keeping each element's
/// start line (serde_json's stream deserializer stops at `,` and `]`).
pub fn json_array_rows(path: &Path, text: &str) -> Result<Vec<RawRow>> {
    let bytes = text.as_bytes();
    let mut pos = text.find('[').expect("caller checked for '[' ") + 1;
    // Line of `pos`, advanced incrementally so the scan stays linear.
    let (mut line, mut line_at) = (1u64, 0usize);
    let mut line_of = |to: usize| {
        line += bytes[line_at..to].iter().filter(|&&b| b == b'\n').count() as u64;
        line_at = to;
        line
    };
    let err = |line: u64, message: String| DataError::Json {
        at: Location {
            path: path.to_path_buf(),
            line,
            element: None,
        },
        message,
    };
    let skip_ws = |mut p: usize| {
        while p < bytes.len() && bytes[p].is_ascii_whitespace() {
            p += 1;
        }
        p
    };
    let mut rows = Vec::new();
    pos = skip_ws(pos);
    if bytes.get(pos) == Some(&b']') {
        return check_trailing(path, text, pos + 1, line_of(pos)).map(|_| rows);
    }
    loop {
        let start_line = line_of(pos);
        let mut stream = serde_json::Deserializer::from_str(&text[pos..]).into_iter::<Value>();
        let value = match stream.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                let msg = format!("{} (in the top-level array)", strip_position(&e));
                return Err(err(start_line + e.line() as u64 - 1, msg));
            }
            None => return Err(err(start_line, "unterminated top-level array".into())),
        };
        pos = skip_ws(pos + stream.byte_offset());
        rows.push(RawRow {
            line: start_line,
            element: Some(rows.len() as u64 + 1),
            value: Ok(value),
        });
        match bytes.get(pos) {
            Some(b',') => pos = skip_ws(pos + 1),
            Some(b']') => return check_trailing(path, text, pos + 1, line_of(pos)).map(|_| rows),
            _ => {
                let at = line_of(pos.min(bytes.len()));
                return Err(err(
                    at,
                    "expected ',' or ']' after an element of the top-level array".into(),
                ));
            }
        }
    }
}

fn check_trailing(path: &Path, text: &str, pos: usize, line: u64) -> Result<()> {
    if text[pos..].trim().is_empty() {
        Ok(())
    } else {
        Err(DataError::Json {
            at: Location {
                path: path.to_path_buf(),
                line,
                element: None,
            },
            message: "trailing characters after the top-level array".into(),
        })
    }
}

/// serde_json appends " at line L column C" relative to the slice it saw;
/// the caller reports the absolute line instead.
fn strip_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn jsonl_skips_blank_lines_and_keeps_line_numbers() {
        let rows = jsonl_rows("{\"a\":1}\n\n  \n{bad\n{\"a\":2}\n");
        let lines: Vec<u64> = rows.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![1, 4, 5]);
        assert!(rows[0].value.is_ok());
        assert!(rows[1].value.is_err());
        assert_eq!(rows[2].value.as_ref().unwrap()["a"], 2);
    }

    #[test]
    fn json_array_elements_know_their_lines() {
        let text = "[\n  {\"a\": 1},\n  {\"a\":\n 2}\n,{\"a\":3}]\n";
        let rows = json_array_rows(Path::new("x.json"), text).unwrap();
        let pos: Vec<(u64, Option<u64>)> = rows.iter().map(|r| (r.line, r.element)).collect();
        assert_eq!(pos, vec![(2, Some(1)), (3, Some(2)), (5, Some(3))]);
        assert_eq!(rows[1].value.as_ref().unwrap()["a"], 2);
        assert!(json_array_rows(Path::new("x.json"), "[]")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn broken_json_array_names_the_line() {
        let text = "[\n{\"a\": 1},\n{\"a\": }\n]";
        let e = json_array_rows(Path::new("x.json"), text).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("x.json:3: invalid json"), "{msg}");
        let e = json_array_rows(Path::new("x.json"), "[{\"a\":1} {\"a\":2}]").unwrap_err();
        assert!(e.to_string().contains("expected ',' or ']'"), "{e}");
        let e = json_array_rows(Path::new("x.json"), "[{\"a\":1}] x").unwrap_err();
        assert!(e.to_string().contains("trailing"), "{e}");
    }

    #[test]
    fn gzip_is_detected_by_suffix_and_by_magic() {
        let dir = tempfile::tempdir().unwrap();
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"{\"a\":1}\n{\"a\":2}\n").unwrap();
        let gz = enc.finish().unwrap();
        for name in ["d.jsonl.gz", "d.jsonl"] {
            let p = dir.path().join(name);
            std::fs::write(&p, &gz).unwrap();
            let rows = read_rows(&p).unwrap();
            assert_eq!(rows.len(), 2, "{name}");
        }
    }
}
