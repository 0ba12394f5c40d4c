//! `[job]`: the spec's header. What the job is called, its seed, how long
//! it trains (steps or epochs) and where its outputs go.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::job::limits;
use crate::job::section::bound;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    /// Train for this many steps ...
    #[serde(default)]
    pub steps: Option<u64>,
    /// ... or for this many passes over the data (exactly one of the two).
    #[serde(default)]
    pub epochs: Option<u64>,
    /// checkpoints/ and metrics.jsonl go under it.
    pub output_dir: PathBuf,
}

impl JobSection {
    /// The checks of `[job]` alone; whether a job may give neither steps
    /// nor epochs depends on its data source (`rules::length_given`).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        let name = &self.name;
        if name.is_empty() {
            bad("job.name", "must not be empty".into());
        } else if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bad(
                "job.name",
                format!("{name:?} may contain only ASCII letters, digits, '-', '_' and '.'"),
            );
        }
        match (self.steps, self.epochs) {
            (Some(_), Some(_)) => bad(
                "job.steps",
                "give exactly one of job.steps and job.epochs, not both".into(),
            ),
            (Some(0), _) => bad("job.steps", "must be at least 1".into()),
            (_, Some(0)) => bad("job.epochs", "must be at least 1".into()),
            (Some(s), _) => bound(bad, "job.steps", s, limits::MAX_STEPS, "steps"),
            (_, Some(e)) => bound(bad, "job.epochs", e, limits::MAX_EPOCHS, "epochs"),
            (None, None) => {}
        }
        if self.output_dir.as_os_str().is_empty() {
            bad("job.output_dir", "must not be empty".into());
        }
    }
}
