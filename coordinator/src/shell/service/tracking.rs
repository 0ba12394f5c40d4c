//! Metrics to TensorBoard for jobs with `[tracking] tensorboard = true`:
//! every step and eval line of metrics.jsonl, as scalars, into
//! `OUTPUT_DIR/tb/`. One event file per job and coordinator process.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use serde::Serialize;

use crate::core::JobId;
use crate::shell::tensorboard::{scalars, Writer};

#[derive(Default)]
pub(super) struct TensorBoard {
    writers: Mutex<HashMap<JobId, Writer>>,
}

impl TensorBoard {
    /// Writes `line` (a metrics.jsonl record) at `step` under `prefix`
    /// (`train` or `eval`) into `output_dir/tb/`.
    pub fn write(
        &self,
        job: &JobId,
        output_dir: &Path,
        prefix: &str,
        step: u64,
        unix_ms: i64,
        line: &impl Serialize,
    ) -> std::io::Result<()> {
        let value = serde_json::to_value(line).map_err(std::io::Error::other)?;
        let mut values = Vec::new();
        scalars(prefix, &value, &mut values);
        // Bookkeeping numbers that are not metrics.
        values.retain(|(tag, _)| !tag.ends_with("/unix_ms") && !tag.contains("/cursor/"));
        let wall = unix_ms as f64 / 1000.0;
        let mut writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let w = match writers.get_mut(job) {
            Some(w) => w,
            None => {
                let w = Writer::create(&output_dir.join("tb"), wall)?;
                writers.entry(job.clone()).or_insert(w)
            }
        };
        w.scalars(step, wall, &values)
    }
}
