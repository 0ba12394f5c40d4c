//! The persisted part of a job: what survives a coordinator restart. The
//! store writes it before any reply or worker message that depends on it.

use serde::{Deserialize, Serialize};

use super::types::{CheckpointEntry, JobId, JobState, Quarantined, WorkerId};
use crate::job::settings::ConfigChange;
use crate::stream::cursor::Cursor;

/// Everything about a job that survives a coordinator restart. Persisted
/// before any reply or worker message that depends on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub name: String,
    /// The validated spec with paths resolved.
    pub spec_toml: String,
    pub state: JobState,
    /// Why the job is pending, paused or failed.
    pub reason: String,
    /// Last committed step (0 before the first).
    pub step: u64,
    pub cursor: Cursor,
    /// Last generation formed (monotonic per job).
    pub generation: u64,
    pub submitted_unix_ms: i64,
    pub last_loss: Option<f64>,
    /// Documents in the dataset.
    pub documents: u64,
    /// Total steps when known, else 0.
    pub total_steps: u64,
    /// Last step whose checkpoint every rank reported written.
    pub last_checkpoint: Option<u64>,
    /// The checkpoint directory the job resumed from (restored until the
    /// job writes a checkpoint of its own).
    #[serde(default)]
    pub resumed_from: Option<std::path::PathBuf>,
    /// Operator changes of the step settings (`accrue set`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<ConfigChange>,
    /// Good checkpoints, ascending by step (the newest `checkpoint.keep`;
    /// a resumed job's starting checkpoint is the first). Recovery restores
    /// from these.
    #[serde(default)]
    pub checkpoints: Vec<CheckpointEntry>,
    /// Checkpoints that failed to restore, never used again.
    #[serde(default)]
    pub bad_checkpoints: Vec<u64>,
    /// Committed steps after this one are kept for replay (their manifests
    /// are in the store): the job's start, or its oldest retained
    /// checkpoint once older ones were dropped.
    #[serde(default)]
    pub history_from: u64,
    /// Members of the last generation formed (after a restart they are
    /// waited for briefly: they may hold the state in memory).
    #[serde(default)]
    pub members: Vec<WorkerId>,
    /// Documents the job trains without (poison documents found by
    /// bisecting non-finite steps), in the order found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quarantine: Vec<Quarantined>,
}

impl JobRecord {
    /// Whether recovery may fall back to the model's own init: the job
    /// started at step 0 and every step since can be replayed.
    pub fn init_allowed(&self) -> bool {
        self.history_from == 0 && self.resumed_from.is_none()
    }

    /// Whether the job trains without `doc`.
    pub fn quarantined(&self, doc: &crate::stream::doc::DocId) -> bool {
        self.quarantine.iter().any(|q| &q.doc == doc)
    }
}
