//! `[parallel]`: how the model is sharded across a job's workers, how many
//! workers it may run on, and which backend carries the collectives.

use serde::{Deserialize, Serialize};

use crate::job::limits;
use crate::job::section::{bound, is_default};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    #[default]
    Ddp,
    Zero2,
    Fsdp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    #[serde(default)]
    pub sharding: Sharding,
    #[serde(default = "default_min_workers")]
    pub min_workers: u32,
    #[serde(default = "default_max_workers")]
    pub max_workers: u32,
    /// Which backend carries the collectives (see [`CollectiveChoice`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub collective: CollectiveChoice,
}

/// `parallel.collective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveChoice {
    /// NCCL when every member of a generation is a CUDA worker that can
    /// load it, else the TCP ring.
    #[default]
    Auto,
    /// Always the TCP ring (GPU tensors staged through host memory).
    Ring,
}

fn default_min_workers() -> u32 {
    1
}
fn default_max_workers() -> u32 {
    8
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self {
            sharding: Sharding::Ddp,
            min_workers: default_min_workers(),
            max_workers: default_max_workers(),
            collective: CollectiveChoice::Auto,
        }
    }
}

impl ParallelSection {
    /// The checks of `[parallel]`: a world of 1 to [`limits::MAX_WORKERS`]
    /// workers, the minimum no larger than the maximum.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.min_workers == 0 {
            bad("parallel.min_workers", "must be at least 1".into());
        }
        bound(
            bad,
            "parallel.max_workers",
            u64::from(self.max_workers),
            u64::from(limits::MAX_WORKERS),
            "workers",
        );
        if self.max_workers < self.min_workers {
            bad(
                "parallel.max_workers",
                format!(
                    "{} is less than parallel.min_workers = {}",
                    self.max_workers, self.min_workers
                ),
            );
        }
    }
}
