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
    /// Context parallelism (DESIGN.md "Long sequences"): ranks per group
    /// that split each microbatch's row along the sequence. A group trains
    /// rows of up to `context × data.max_tokens` tokens; the data-parallel
    /// world is the generation's world / `context`.
    #[serde(default = "default_context", skip_serializing_if = "is_one")]
    pub context: u32,
}

/// The most ranks one context-parallel group may hold.
pub const MAX_CONTEXT: u32 = 64;

fn default_context() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
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
            context: default_context(),
        }
    }
}

impl ParallelSection {
    /// The data-parallel world of a generation of `world` training ranks:
    /// its context-parallel groups.
    pub fn data_parallel(&self, world: u32) -> u32 {
        world / self.context.max(1)
    }

    /// The longest row a microbatch may hold when a rank's budget is
    /// `max_tokens` (the job's, or the live `accrue set --max-tokens`).
    pub fn row_budget(&self, max_tokens: u32) -> RowBudget {
        RowBudget {
            max_tokens,
            context: self.context.max(1),
        }
    }

    /// The checks of `[parallel]`: a world of 1 to [`limits::MAX_WORKERS`]
    /// workers, the minimum no larger than the maximum; whole
    /// context-parallel groups (both bounds multiples of `context`).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.context == 0 {
            bad("parallel.context", "must be at least 1".into());
        }
        bound(
            bad,
            "parallel.context",
            u64::from(self.context),
            u64::from(MAX_CONTEXT),
            "ranks",
        );
        if self.context > 1 {
            for (field, n) in [
                ("parallel.min_workers", self.min_workers),
                ("parallel.max_workers", self.max_workers),
            ] {
                if n % self.context != 0 {
                    bad(
                        field,
                        format!(
                            "{n} is not a multiple of parallel.context = {} (a generation is whole context-parallel groups)",
                            self.context
                        ),
                    );
                }
            }
        }
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

/// The longest row one microbatch holds: a rank's `data.max_tokens` times
/// the ranks of its context-parallel group. Documents longer than it are
/// overlong (never cut); its `Display` names the fields it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowBudget {
    pub max_tokens: u32,
    pub context: u32,
}

impl RowBudget {
    /// One rank's budget (no context parallelism).
    pub fn single(max_tokens: u32) -> RowBudget {
        RowBudget {
            max_tokens,
            context: 1,
        }
    }

    pub fn tokens(&self) -> u32 {
        self.max_tokens.saturating_mul(self.context)
    }
}

impl std::fmt::Display for RowBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.context {
            1 => write!(f, "data.max_tokens = {}", self.max_tokens),
            c => write!(
                f,
                "data.max_tokens × parallel.context = {} × {c} = {}",
                self.max_tokens,
                self.tokens()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(p: &ParallelSection) -> Vec<(String, String)> {
        let mut out = Vec::new();
        p.validate(&mut |f: &str, m: String| out.push((f.to_string(), m)));
        out
    }

    #[test]
    fn context_takes_whole_groups_at_any_sharding() {
        let ok = ParallelSection {
            context: 2,
            min_workers: 2,
            max_workers: 8,
            sharding: Sharding::Zero2,
            ..Default::default()
        };
        assert!(problems(&ok).is_empty(), "{:?}", problems(&ok));
        let fields = |p: ParallelSection| -> Vec<String> {
            problems(&p).into_iter().map(|(f, _)| f).collect()
        };
        let odd = ParallelSection {
            min_workers: 3,
            ..ok.clone()
        };
        assert_eq!(fields(odd), ["parallel.min_workers"]);
        let fsdp = ParallelSection {
            sharding: Sharding::Fsdp,
            ..ok.clone()
        };
        assert!(fields(fsdp).is_empty());
        let zero = ParallelSection {
            context: 0,
            ..ok.clone()
        };
        assert_eq!(fields(zero), ["parallel.context"]);
        let huge = ParallelSection {
            context: MAX_CONTEXT * 2,
            min_workers: MAX_CONTEXT * 2,
            max_workers: MAX_CONTEXT * 2,
            ..ok
        };
        assert_eq!(fields(huge), ["parallel.context"]);
    }

    #[test]
    fn a_row_is_a_ranks_budget_times_its_group() {
        let p = ParallelSection {
            context: 4,
            ..Default::default()
        };
        assert_eq!(p.data_parallel(8), 2);
        let row = p.row_budget(128);
        assert_eq!(row.tokens(), 512);
        assert_eq!(
            row.to_string(),
            "data.max_tokens × parallel.context = 128 × 4 = 512"
        );
        assert_eq!(RowBudget::single(128).to_string(), "data.max_tokens = 128");
        // Unset, the field is not written back (specs round-trip unchanged).
        let text = toml::to_string(&ParallelSection::default()).unwrap();
        assert!(!text.contains("context"), "{text}");
        let back: ParallelSection = toml::from_str("context = 2\nmin_workers = 2\n").unwrap();
        assert_eq!(back.context, 2);
    }
}
