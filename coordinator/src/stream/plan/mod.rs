//! The step planner: which documents form a step ([`select`]), how they are
//! packed into padding-free microbatches and spread over ranks ([`solve`]),
//! and the step's global normalisers. Pure functions, no I/O; see README.md
//! beside this file for the algorithm.

mod balance;
mod error;
mod free_bins;
mod pack;
mod problem;
mod select;

pub use error::PlanError;
pub use pack::{
    audit, item_cost, lower_bound_per_rank, normalizers, seq_cost, solve, Audit, ATTN_SCALE,
};
pub use problem::{Microbatch, Normalizers, PackItem, PackProblem, PackSolution, SeqLens};
pub use select::{select, StepTarget, MISFIT_LOOKAHEAD};

#[cfg(test)]
mod tests;
