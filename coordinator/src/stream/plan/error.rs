//! Planner errors.

/// Why a step could not be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A document does not fit one microbatch; it is never cut.
    #[error("document {doc} has {tokens} tokens, more than max_tokens = {max_tokens}")]
    Overlong {
        doc: usize,
        tokens: u64,
        max_tokens: u32,
    },
    #[error("world_size must be at least 1")]
    NoRanks,
    #[error("max_tokens must be at least 1")]
    ZeroBudget,
}
