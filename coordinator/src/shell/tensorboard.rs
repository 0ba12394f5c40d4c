//! TensorBoard event files, written natively (`[tracking] tensorboard =
//! true` → `OUTPUT_DIR/tb/events.out.tfevents.<secs>.<host>`).
//!
//! The format is TFRecord: per record a little-endian u64 length, the
//! masked CRC-32C of those 8 bytes, the payload and its masked CRC-32C.
//! Each payload is a `tensorflow.Event` protobuf; the first carries
//! `file_version = "brain.Event:2"`, the others one `Summary` of scalar
//! values at a step. The two messages are declared here with prost (only
//! the fields written): TensorBoard's own protos would drag in the whole
//! TensorFlow tree, and no maintained crate writes event files.
//!
//! Scalars are every number of the step's metrics.jsonl line, under the
//! same names (`train/loss`, `train/sources/chat/loss`, `eval/loss`, ...),
//! so a dashboard and `accrue plot` name things alike.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use prost::Message;
use serde_json::Value;

/// `tensorflow.Event`, the fields TensorBoard reads for scalars.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with `simple_value` (a scalar).
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// TFRecord's CRC: CRC-32C, rotated and offset so a CRC of data holding
/// CRCs stays well distributed.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One framed record.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
    out
}

/// The numbers of a JSON object as `(prefix/key/..., value)`, nested
/// objects joined with `/`; strings, booleans and arrays are not scalars.
pub fn scalars(prefix: &str, v: &Value, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((prefix.to_string(), x));
            }
        }
        Value::Object(m) => {
            for (k, v) in m {
                scalars(&format!("{prefix}/{k}"), v, out);
            }
        }
        _ => {}
    }
}

/// An open event file.
pub struct Writer {
    path: PathBuf,
    file: File,
}

impl Writer {
    /// Creates `dir` and a new event file in it (one per coordinator
    /// process and job: TensorBoard reads every file of the directory).
    pub fn create(dir: &Path, wall_time: f64) -> std::io::Result<Writer> {
        std::fs::create_dir_all(dir)?;
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "accrue".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            wall_time as u64,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut w = Writer { path, file };
        w.write(&Event {
            wall_time,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, e: &Event) -> std::io::Result<()> {
        self.file.write_all(&record(&e.encode_to_vec()))?;
        self.file.flush()
    }

    /// Writes `values` at `step` as one event.
    pub fn scalars(
        &mut self,
        step: u64,
        wall_time: f64,
        values: &[(String, f64)],
    ) -> std::io::Result<()> {
        let summary = Summary {
            value: values
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(tag, v)| SummaryValue {
                    tag: tag.clone(),
                    simple_value: Some(*v as f32),
                })
                .collect(),
        };
        self.write(&Event {
            wall_time,
            step: step as i64,
            file_version: None,
            summary: Some(summary),
        })
    }
}

/// Reads back every event of a file, checking both CRCs of every record
/// (for tests and `accrue` tooling).
pub fn read(path: &Path) -> Result<Vec<Event>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let head = bytes
            .get(at..at + 12)
            .ok_or_else(|| format!("truncated record header at byte {at}"))?;
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes")) as usize;
        if u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) != masked_crc(&head[..8]) {
            return Err(format!("bad length CRC at byte {at}"));
        }
        let body = bytes
            .get(at + 12..at + 12 + len + 4)
            .ok_or_else(|| format!("truncated record at byte {at}"))?;
        let (payload, crc) = body.split_at(len);
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked_crc(payload) {
            return Err(format!("bad data CRC at byte {at}"));
        }
        out.push(Event::decode(payload).map_err(|e| format!("record at byte {at}: {e}"))?);
        at += 12 + len + 4;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_its_mask_match_tensorflow() {
        // The CRC-32C check value, and TFRecord's mask of it
        // (tensorflow/core/lib/hash/crc32c.h: rotate right 15, add
        // 0xa282ead8).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
        // Framing: 8-byte length, its CRC, the payload, its CRC.
        let r = record(&[]);
        assert_eq!(r.len(), 16);
        assert_eq!(&r[..8], &[0; 8]);
    }

    #[test]
    fn scalars_round_trip_through_an_event_file() {
        let d = tempfile::tempdir().unwrap();
        let mut w = Writer::create(d.path(), 1_700_000_000.5).unwrap();
        let line = serde_json::json!({
            "loss": 2.5, "tokens": 120, "cursor": {"epoch": 0}, "job": "j",
            "sources": {"chat": {"loss": 1.25}}, "ranks": [1, 2], "replayed": false,
        });
        let mut values = Vec::new();
        scalars("train", &line, &mut values);
        values.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            values.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(),
            [
                "train/cursor/epoch",
                "train/loss",
                "train/sources/chat/loss",
                "train/tokens"
            ]
        );
        w.scalars(3, 1_700_000_001.0, &values).unwrap();
        w.scalars(4, 1_700_000_002.0, &[("train/loss".into(), f64::NAN)])
            .unwrap();
        let events = read(w.path()).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(events[1].step, 3);
        let s = events[1].summary.as_ref().unwrap();
        let loss = s.value.iter().find(|v| v.tag == "train/loss").unwrap();
        assert_eq!(loss.simple_value, Some(2.5));
        assert!(
            events[2].summary.as_ref().unwrap().value.is_empty(),
            "NaN is not written"
        );
        // A flipped byte is caught.
        let mut bytes = std::fs::read(w.path()).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(w.path(), bytes).unwrap();
        assert!(read(w.path()).unwrap_err().contains("CRC"));
    }
}
