//! Accrue worker: runs the coordinator's step plans (forward/backward over
//! padding-free packed microbatches, exact accumulation, optimizer step) with
//! libtorch through `tch`. The only crate that links libtorch.

pub mod config;
pub mod model;
pub mod train;

pub use accrue_proto::v1 as wire;
