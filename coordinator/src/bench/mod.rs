//! Benchmarks behind `accrue bench`: each writes one JSON object per line so
//! results can be diffed and plotted. This is printing code, not domain
//! logic: it measures the pure planners in `crate::plan` and the TCP ring
//! of `accrue-collective`.

mod collective;
pub mod control;
pub mod data;
mod packing;

pub use collective::{
    bus_bandwidth_gbps, collective, iters_for, run_rank, CollectiveBenchOpts, CollectiveRow,
    RankTiming, OPS,
};

pub use packing::{
    greedy_baseline, packing, synthetic_lognormal, PackingBenchOpts, PackingRow, SYNTHETIC_DATASET,
    SYNTHETIC_MAX_TOKENS, SYNTHETIC_MEDIAN, SYNTHETIC_SIGMA,
};
