//! `[checkpoint]`: how often a job writes a checkpoint and how many it
//! keeps for recovery. No checks: every value is valid (0 means "only at
//! the end" and "all").

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Write a checkpoint every this many committed steps (0 = only at the end).
    #[serde(default)]
    pub every_steps: u64,
    /// Complete checkpoints the job keeps in its index for recovery (the
    /// newest; 0 = all). Steps since the oldest kept one stay replayable.
    #[serde(default = "default_checkpoint_keep")]
    pub keep: u64,
}

fn default_checkpoint_keep() -> u64 {
    3
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self {
            every_steps: 0,
            keep: default_checkpoint_keep(),
        }
    }
}
