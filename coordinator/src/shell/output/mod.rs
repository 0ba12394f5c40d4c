//! A job's output directory on the coordinator's side (issue 14): who
//! owns it (`marker`: the marker a job writes there at submit, and how two
//! coordinators on one volume keep apart), where it really is
//! (`real_path`: directories compare by identity, not spelling), and the
//! metrics lines a job appends. Every failure is returned, never
//! swallowed: the caller fails the job or the submit.

mod marker;
mod real_path;

use std::io::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::core::StepMetrics;

pub use marker::{
    claim, owner, refresh, release, Holder, OutputError, Owner, Refreshed, FRESH_MS, MARKER,
    REFRESH_MS,
};
pub use real_path::real_path;

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
