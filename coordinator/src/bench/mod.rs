//! Benchmarks behind `accrue bench`: each writes one JSON object per line so
//! results can be diffed and plotted. This is printing code, not domain
//! logic: it measures the pure planners in `crate::plan`.

mod packing;

pub use packing::{
    greedy_baseline, packing, synthetic_lognormal, PackingBenchOpts, PackingRow, SYNTHETIC_DATASET,
    SYNTHETIC_MAX_TOKENS, SYNTHETIC_MEDIAN, SYNTHETIC_SIGMA,
};
