//! The step planner: which documents form a step ([`select`]), how they are
//! packed into padding-free microbatches and spread over ranks ([`solve`]),
//! and the step's global normalisers. Pure functions, no I/O; see README.md
//! beside this file for the algorithm.

mod balance;
mod error;
mod free_bins;
mod pack;
mod select;

pub use error::PlanError;
pub use pack::{
    audit, item_cost, lower_bound_per_rank, normalizers, seq_cost, solve, Audit, ATTN_SCALE,
};
pub use select::{select, StepTarget, MISFIT_LOOKAHEAD};

#[cfg(test)]
mod tests;

/// One document as the packer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackItem {
    /// Caller's handle for the document (e.g. its position in the step).
    pub doc: usize,
    /// Lengths of its sequences; a DPO pair has two and they are placed
    /// together, in this order, in one microbatch.
    pub seq_lens: SeqLens,
    /// Loss tokens over its sequences (after the label shift).
    pub loss_tokens: u64,
    /// True for a preference pair (counts toward `Normalizers::pairs`).
    pub is_pair: bool,
}

impl PackItem {
    pub fn tokens(&self) -> u64 {
        self.seq_lens.iter().map(|&l| l as u64).sum()
    }
}

/// A document's sequence lengths: one, or a pair's two. Held inline: an
/// item is built for every document of every step, under the state lock.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SeqLens {
    lens: [u32; 2],
    pair: bool,
}

impl SeqLens {
    pub fn one(len: u32) -> Self {
        Self {
            lens: [len, 0],
            pair: false,
        }
    }

    /// A pair's two sequences, in the order they are placed.
    pub fn pair(first: u32, second: u32) -> Self {
        Self {
            lens: [first, second],
            pair: true,
        }
    }

    /// One or two lengths; `None` for any other count.
    pub fn from_slice(lens: &[u32]) -> Option<Self> {
        match *lens {
            [len] => Some(Self::one(len)),
            [first, second] => Some(Self::pair(first, second)),
            _ => None,
        }
    }
}

impl std::ops::Deref for SeqLens {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.lens[..1 + usize::from(self.pair)]
    }
}

impl std::fmt::Debug for SeqLens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A step's packing problem.
#[derive(Debug, Clone, PartialEq)]
pub struct PackProblem {
    pub items: Vec<PackItem>,
    /// Token budget of one microbatch.
    pub max_tokens: u32,
    pub world_size: u32,
    /// At least this many microbatches per rank (static mode asks for
    /// exactly k; 0 or 1 for the dynamic modes).
    pub min_microbatches_per_rank: u32,
    /// A group per item (a mixture's source): a microbatch holds items of
    /// one group only, so per-microbatch metric sums are per group. Empty:
    /// one group.
    pub groups: Vec<u32>,
}

/// One packed microbatch: the items it holds, in row order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Microbatch {
    /// Indices into `PackProblem::items`.
    pub items: Vec<usize>,
    pub tokens: u64,
    pub loss_tokens: u64,
    /// Attention-aware cost: Σ over sequences of (len + len²/ATTN_SCALE).
    pub cost: f64,
}

impl Microbatch {
    /// An empty, zero-weight microbatch (padding so ranks line up).
    pub fn is_padding(&self) -> bool {
        self.items.is_empty()
    }
}

/// The global normalisers of a step, identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Normalizers {
    pub loss_tokens: u64,
    pub pairs: u64,
    pub documents: u64,
    pub sequences: u64,
    pub tokens: u64,
}

/// The planner's answer: `ranks[r]` holds rank r's microbatches, every rank
/// the same number.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PackSolution {
    pub ranks: Vec<Vec<Microbatch>>,
    pub normalizers: Normalizers,
}

impl PackSolution {
    pub fn microbatches_per_rank(&self) -> usize {
        self.ranks.first().map_or(0, Vec::len)
    }
}
