//! A job's output directory on the coordinator's side (issue 14): the
//! ownership marker a job writes there at submit, the metrics lines it
//! appends, and removing checkpoints that left its index. Every failure
//! is returned, never swallowed: the caller fails the job or the submit.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::core::StepMetrics;

/// The marker's file name inside `job.output_dir`.
pub const MARKER: &str = ".accrue-job.json";

/// Who owns an output directory: written at submit, read to name the
/// owner when another job asks for the same directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub job: String,
    pub name: String,
    pub submitted_unix_ms: i64,
}

/// Why an output directory cannot be used or written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("job.output_dir {dir}: {what}: {source}")]
    Io {
        dir: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("job.output_dir {dir} exists and is not a directory")]
    NotADirectory { dir: PathBuf },
}

/// The owner recorded in `dir`, if a readable marker is there.
pub fn owner(dir: &Path) -> Option<Owner> {
    let bytes = std::fs::read(dir.join(MARKER)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Claims `dir` for `owner`: creates it and writes the marker (through a
/// temporary file and a rename, so a reader never sees half of it). An
/// unwritable directory is refused here, before the job exists.
pub fn claim(dir: &Path, owner: &Owner) -> Result<(), OutputError> {
    let io = |what| {
        move |source| OutputError::Io {
            dir: dir.to_path_buf(),
            what,
            source,
        }
    };
    if dir.exists() && !dir.is_dir() {
        return Err(OutputError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    std::fs::create_dir_all(dir).map_err(io("cannot create it"))?;
    let tmp = dir.join(format!("{MARKER}.tmp"));
    let body = serde_json::to_vec_pretty(owner).expect("the marker serialises");
    std::fs::write(&tmp, body).map_err(io("cannot write its ownership marker"))?;
    std::fs::rename(&tmp, dir.join(MARKER)).map_err(io("cannot write its ownership marker"))
}

/// One metrics.jsonl line: the step's metrics with the job's id, so lines
/// from different jobs can never be confused.
#[derive(Serialize)]
struct Line<'a> {
    job: &'a str,
    #[serde(flatten)]
    metrics: &'a StepMetrics,
}

/// Appends `metrics` of `job` to the metrics file at `path`.
pub fn append_metrics(path: &Path, job: &str, metrics: &StepMetrics) -> std::io::Result<()> {
    append_line(path, &Line { job, metrics })
}

/// Appends `line` as one JSON line to `path` (its directory created).
fn append_line(path: &Path, line: &impl Serialize) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut bytes = serde_json::to_vec(line).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    f.write_all(&bytes)
}

/// One eval line of metrics.jsonl: `{"job": …, "eval": {…}}`.
#[derive(Serialize)]
struct EvalLine<'a> {
    job: &'a str,
    eval: &'a crate::core::EvalMetrics,
}

/// Appends an evaluation of `job` to the metrics file at `path`.
pub fn append_eval(path: &Path, job: &str, eval: &crate::core::EvalMetrics) -> std::io::Result<()> {
    append_line(path, &EvalLine { job, eval })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner_of(job: &str) -> Owner {
        Owner {
            job: job.into(),
            name: "n".into(),
            submitted_unix_ms: 1,
        }
    }

    #[test]
    fn a_claim_writes_a_marker_naming_the_job() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out/run");
        claim(&out, &owner_of("a")).unwrap();
        assert_eq!(owner(&out), Some(owner_of("a")));
        claim(&out, &owner_of("b")).unwrap();
        assert_eq!(owner(&out).unwrap().job, "b");
    }

    #[test]
    fn an_output_dir_that_is_a_file_or_unwritable_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let e = claim(&file, &owner_of("a")).unwrap_err();
        assert!(e.to_string().contains("is not a directory"), "{e}");
        let e = claim(&file.join("sub"), &owner_of("a")).unwrap_err();
        assert!(e.to_string().contains("cannot create it"), "{e}");
    }

    #[test]
    fn metrics_lines_carry_the_job_id_and_survive_a_nan() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m/metrics.jsonl");
        let m = StepMetrics {
            step: 3,
            loss: f64::NAN,
            ..Default::default()
        };
        append_metrics(&path, "job-1", &m).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["job"], "job-1");
        assert_eq!(v["step"], 3);
        assert!(v["loss"].is_null());
        let back: StepMetrics = serde_json::from_str(text.trim()).unwrap();
        assert!(back.loss.is_nan());
    }
}
