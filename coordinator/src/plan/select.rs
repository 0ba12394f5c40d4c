//! TEMPORARY placeholder (replaced at merge).
use crate::cursor::Selection;
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepTarget {
    Docs(u64),
    Tokens(u64),
    MicrobatchesPerRank {
        k: u32,
        world_size: u32,
        max_tokens: u32,
    },
}
pub fn select(_t: StepTarget, _c: impl IntoIterator<Item = (u64, u64)>) -> Selection {
    Selection::default()
}
