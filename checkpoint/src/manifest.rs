//! `manifest.json`: which job, step and data position a checkpoint holds.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::read::{read_json, VerifyError};

/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// `manifest.json` beside a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The id of the job that wrote it.
    pub job: String,
    /// That job's `job.name` (for people and listings; the resume rule
    /// does not look at it).
    #[serde(default)]
    pub name: String,
    /// The last step the weights include.
    pub step: u64,
    /// Where the data stream continues.
    pub cursor: Cursor,
    /// Ranks that wrote a part (and a marker).
    pub world_size: u32,
    pub generation: u64,
}

impl Manifest {
    /// The resume rule (see the crate docs): the step and cursor a job
    /// whose `model.init` is this checkpoint starts from, or `None` when
    /// it takes only the weights (`model.resume = false`).
    pub fn resume_point(self, resume: bool) -> Option<(u64, Cursor)> {
        resume.then_some((self.step, self.cursor))
    }
}

/// Position of the job's data stream (the coordinator's data cursor, whose
/// meaning its `stream::cursor` module gives; persisted with the job and
/// recorded in every checkpoint).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    /// 0-based epoch of the next document (of the first source, in a
    /// mixture).
    pub epoch: u64,
    /// Index into the epoch's permutation of the next document.
    pub position: u64,
    /// Dataset indices taken out of order, served before the permutation
    /// continues.
    pub overflow: Vec<u64>,
    /// A mixture's other sources (source `i + 1` at index `i`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourcePos>,
    /// A mixture: documents each source served since its weights last
    /// changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mixed: Vec<u64>,
    /// Which weights `mixed` counts under.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mix_rev: u32,
}

impl Cursor {
    /// Where source `s` of a mixture stands (source 0 is the cursor's own
    /// epoch and position).
    pub fn source(&self, s: usize) -> SourcePos {
        match s {
            0 => SourcePos {
                epoch: self.epoch,
                position: self.position,
            },
            _ => self.sources.get(s - 1).copied().unwrap_or_default(),
        }
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Where one source of a mixture stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SourcePos {
    pub epoch: u64,
    pub position: u64,
}

/// The manifest of checkpoint directory `dir` (bounded read; a missing
/// file is [`VerifyError::Missing`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, VerifyError> {
    let path = dir.join(MANIFEST);
    let value = read_json(&path)?;
    serde_json::from_value(value).map_err(|e| VerifyError::bad(&path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_round_trips_and_says_where_a_resumed_job_starts() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manifest {
            job: "j-1".into(),
            name: "sft".into(),
            step: 7,
            cursor: Cursor {
                epoch: 1,
                position: 12,
                overflow: vec![3],
                sources: vec![SourcePos {
                    epoch: 0,
                    position: 5,
                }],
                mixed: vec![4, 2],
                mix_rev: 1,
            },
            world_size: 2,
            generation: 3,
        };
        let path = dir.path().join(MANIFEST);
        crate::write_durable(&path, &serde_json::to_vec(&m).unwrap()).unwrap();
        let back = read_manifest(dir.path()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.clone().resume_point(true), Some((7, m.cursor.clone())));
        assert_eq!(back.resume_point(false), None);
        // Written before `name` existed, and without a mixture.
        std::fs::write(
            &path,
            br#"{"job":"j","step":2,"cursor":{"epoch":0,"position":4,"overflow":[]},"world_size":1,"generation":1}"#,
        )
        .unwrap();
        let old = read_manifest(dir.path()).unwrap();
        assert_eq!((old.name.as_str(), old.cursor.position), ("", 4));
    }
}
