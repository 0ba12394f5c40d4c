//! A step's packing problem and its solution: the documents as the packer
//! sees them, the microbatches it makes, and the step's normalisers.

pub use crate::stream::doc::SeqLens;

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
