//! Step selection: which of the offered documents form the next step, for
//! the three step modes of DESIGN.md ("Step boundaries"). The selector sees
//! only token counts, in offering order (the cursor's `Candidates`: overflow
//! queue first, then the epoch permutation), and answers with a
//! [`Selection`]; the cursor turns consumed-but-untaken candidates into the
//! overflow queue. Nothing is ever dropped or cut here: a document longer
//! than a microbatch is taken so that [`super::solve`] reports it by name.

use crate::job::batch::StepSize;
use crate::stream::cursor::Selection;

use super::pack::BestFit;

/// How a static step stops looking ahead: after this many consecutive
/// candidates that fit no microbatch (they stay in the stream).
pub const MISFIT_LOOKAHEAD: usize = 16;

/// What a step must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepTarget {
    /// Exactly this many documents (fewer only when the stream ends).
    Docs(u64),
    /// About this many tokens: documents are taken in order while the step
    /// stays at or under the target; the first document is always taken, so
    /// only a single oversized first document can exceed it.
    Tokens(u64),
    /// Fill `k · world_size` microbatches of `max_tokens` by best fit in
    /// offering order; documents that fit no microbatch are carried over.
    MicrobatchesPerRank {
        k: u32,
        world_size: u32,
        max_tokens: u32,
    },
}

impl StepTarget {
    /// The target for a job's step size on `world_size` ranks.
    pub fn new(size: StepSize, world_size: u32, max_tokens: u32) -> Self {
        match size {
            StepSize::Docs(n) => StepTarget::Docs(n),
            StepSize::Tokens(t) => StepTarget::Tokens(t),
            StepSize::MicrobatchesPerRank(k) => StepTarget::MicrobatchesPerRank {
                k,
                world_size,
                max_tokens,
            },
        }
    }

    /// `PackProblem::min_microbatches_per_rank` for this target: `k` for a
    /// static step, else 1 (every rank runs at least one microbatch).
    pub fn min_microbatches_per_rank(&self) -> u32 {
        match *self {
            StepTarget::MicrobatchesPerRank { k, .. } => k,
            _ => 1,
        }
    }
}

/// Chooses a step's documents from candidates offered in order, each given
/// by its token count. The iterator is pulled lazily and no further than
/// needed, so an endless stream is fine.
///
/// - `Docs(n)`: takes the first n (all of them if fewer are offered).
/// - `Tokens(t)`: takes candidates while the step's tokens stay ≤ t; stops
///   at the first that would exceed t, which is left unconsumed (it opens
///   the next step). The first candidate is always taken.
/// - `MicrobatchesPerRank`: best fit, in order, into `k · world_size` bins
///   of `max_tokens` (the same rule [`super::solve`] replays, so the taken
///   documents pack into k microbatches per rank). A candidate that fits no
///   bin is skipped; it is consumed but not taken, so the cursor carries it
///   over. Stops when the bins are full, after [`MISFIT_LOOKAHEAD`]
///   consecutive misfits, or when the candidates run out; trailing misfits
///   after the last taken one are not consumed. A candidate longer than
///   `max_tokens` can never fit: it is taken, and `solve` reports it.
pub fn select(target: StepTarget, candidate_tokens: impl IntoIterator<Item = u64>) -> Selection {
    let candidates = candidate_tokens.into_iter();
    let selection = match target {
        StepTarget::Docs(n) => {
            let consumed = candidates
                .take(usize::try_from(n).unwrap_or(usize::MAX))
                .count();
            Selection {
                taken: (0..consumed).collect(),
                consumed,
            }
        }
        StepTarget::Tokens(t) => select_tokens(t, candidates),
        StepTarget::MicrobatchesPerRank {
            k,
            world_size,
            max_tokens,
        } => select_static(
            k as usize * world_size as usize,
            u64::from(max_tokens),
            candidates,
        ),
    };
    debug_assert!(selection.taken.windows(2).all(|p| p[0] < p[1]));
    debug_assert!(selection
        .taken
        .last()
        .is_none_or(|&l| l < selection.consumed));
    selection
}

fn select_tokens(target: u64, candidates: impl Iterator<Item = u64>) -> Selection {
    let mut step = 0u64;
    let mut consumed = 0;
    let mut candidates = candidates.peekable();
    while let Some(&t) = candidates.peek() {
        if consumed > 0 && step.saturating_add(t) > target {
            break;
        }
        candidates.next();
        step = step.saturating_add(t);
        consumed += 1;
        if step >= target {
            break;
        }
    }
    Selection {
        taken: (0..consumed).collect(),
        consumed,
    }
}

fn select_static(bins: usize, max: u64, candidates: impl Iterator<Item = u64>) -> Selection {
    let mut fit = BestFit::new(max, bins);
    let mut taken = Vec::new();
    let mut misfits = 0;
    if bins == 0 {
        return Selection::default();
    }
    for (pos, t) in candidates.enumerate() {
        if t > max || fit.place(pos, t).is_some() {
            taken.push(pos);
            misfits = 0;
            if fit.is_full() {
                break;
            }
        } else {
            misfits += 1;
            if misfits >= MISFIT_LOOKAHEAD {
                break;
            }
        }
    }
    Selection {
        consumed: taken.last().map_or(0, |&l| l + 1),
        taken,
    }
}
