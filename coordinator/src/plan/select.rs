//! Step selection (filled in by its own change).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepTarget {
    Docs(u64),
}
pub fn select() {}
