//! Benchmarks behind `accrue bench`: each writes one JSON object per line so
//! results can be diffed and plotted. This is printing code, not domain
//! logic: it measures the coordinator's pure planner, its server under a
//! fleet of fake workers, the data layer, recovery, and the TCP ring of
//! `accrue-collective`. [`run`] turns the subcommands' flags into these
//! calls and their rows into tables and verdicts.

mod collective;
pub mod control;
pub mod data;
mod packing;
pub mod recovery;
pub mod run;

pub use collective::{collective, run_rank, CollectiveBenchOpts, CollectiveRow};

pub use packing::{packing, PackingBenchOpts, PackingRow};
