//! The data cursor: where a job's document stream stands. It is plain data
//! (serialisable, persisted with the job) and moves only when a step commits,
//! so an aborted step is re-planned from the same cursor with the same
//! documents.
//!
//! Order within an epoch is a seeded permutation (ChaCha8 seeded from the job
//! seed and the epoch, Fisher–Yates), so it is reproducible across restarts
//! and machines without storing the permutation.

use std::sync::{Arc, Mutex};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::stream::mix::Weights;

/// Position of a job's data stream: the checkpoint contract's type (a
/// checkpoint records it, a job resumed from one continues there); what it
/// means — epochs of a seeded permutation, the overflow queue, a mixture's
/// other sources and interleave — is this module's.
pub use accrue_checkpoint::{Cursor, SourcePos};

/// One source of a mixture: its units (a range of the dataset) and epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceOrder {
    pub start: u64,
    pub len: u64,
    /// Last epoch (exclusive) it serves; `None` = endless.
    pub epochs: Option<u64>,
}

/// Permutations already drawn, per source (the latest epoch each), so a
/// job's plans do not shuffle a large source again every step.
type PermCache = Arc<Mutex<Vec<Option<(u64, Arc<[u64]>)>>>>;

/// How the stream orders documents.
#[derive(Debug, Clone)]
pub struct Order {
    pub seed: u64,
    pub shuffle: bool,
    /// Number of documents in the dataset.
    pub len: u64,
    /// Last epoch (exclusive) the stream serves; `None` = endless.
    pub epochs: Option<u64>,
    /// A mixture (two sources or more): each source's part of the dataset,
    /// in order; empty for a single source.
    pub mix: Vec<SourceOrder>,
    /// The mixture's weights now, and which change of them they are.
    pub weights: Weights,
    pub weights_rev: u32,
    perms: PermCache,
}

impl PartialEq for Order {
    fn eq(&self, o: &Self) -> bool {
        (
            self.seed,
            self.shuffle,
            self.len,
            self.epochs,
            &self.mix,
            &self.weights,
            self.weights_rev,
        ) == (
            o.seed,
            o.shuffle,
            o.len,
            o.epochs,
            &o.mix,
            &o.weights,
            o.weights_rev,
        )
    }
}

impl Order {
    /// One source of `len` documents.
    pub fn single(seed: u64, shuffle: bool, len: u64, epochs: Option<u64>) -> Order {
        Order {
            seed,
            shuffle,
            len,
            epochs,
            mix: Vec::new(),
            weights: Weights::new(vec![1.0], seed),
            weights_rev: 0,
            perms: Arc::new(Mutex::new(vec![None])),
        }
    }

    /// A mixture of `sources` (consecutive parts of the dataset) served by
    /// `weights`; one source is a single stream.
    pub fn mixture(
        seed: u64,
        shuffle: bool,
        sources: Vec<SourceOrder>,
        weights: Vec<f64>,
    ) -> Order {
        let len = sources.iter().map(|s| s.len).sum();
        if sources.len() == 1 {
            return Order::single(seed, shuffle, len, sources[0].epochs);
        }
        let n = sources.len();
        Order {
            seed,
            shuffle,
            len,
            epochs: None,
            mix: sources,
            weights: Weights::new(weights, seed),
            weights_rev: 0,
            perms: Arc::new(Mutex::new(vec![None; n])),
        }
    }

    /// The same order served with other weights (change number `rev`).
    pub fn with_weights(&self, weights: Vec<f64>, rev: u32) -> Order {
        let mut o = self.clone();
        o.weights = Weights::new(weights, self.seed);
        o.weights_rev = rev;
        o
    }

    fn sources(&self) -> usize {
        self.mix.len().max(1)
    }

    fn part(&self, s: usize) -> SourceOrder {
        match self.mix.get(s) {
            Some(p) => *p,
            None => SourceOrder {
                start: 0,
                len: self.len,
                epochs: self.epochs,
            },
        }
    }

    /// The source of dataset index `index`.
    pub fn source_of(&self, index: u64) -> usize {
        self.mix
            .iter()
            .position(|p| index >= p.start && index < p.start + p.len)
            .unwrap_or(0)
    }

    /// The dataset indices of source `s`'s `epoch` in serving order.
    fn source_permutation(&self, s: usize, epoch: u64) -> Arc<[u64]> {
        {
            let cache = self.perms.lock().expect("permutation cache");
            if let Some(Some((e, p))) = cache.get(s) {
                if *e == epoch {
                    return p.clone();
                }
            }
        }
        let part = self.part(s);
        let mut perm: Vec<u64> = (part.start..part.start + part.len).collect();
        if self.shuffle {
            // Distinct, reproducible stream per (seed, source, epoch); a
            // single source keeps the stream it always had.
            let seed = match self.mix.is_empty() {
                true => self.seed,
                false => self.seed ^ (s as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
            };
            let mut rng =
                ChaCha8Rng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            perm.shuffle(&mut rng);
        }
        let perm: Arc<[u64]> = perm.into();
        let mut cache = self.perms.lock().expect("permutation cache");
        if let Some(slot) = cache.get_mut(s) {
            *slot = Some((epoch, perm.clone()));
        }
        perm
    }

    /// The dataset index served `i`-th in `epoch` (a single source;
    /// cached per epoch, no copy).
    pub fn index_at(&self, epoch: u64, i: u64) -> u64 {
        self.source_permutation(0, epoch)[i as usize]
    }

    /// The dataset indices of `epoch` in serving order (a single source).
    pub fn permutation(&self, epoch: u64) -> Vec<u64> {
        self.source_permutation(0, epoch).to_vec()
    }

    /// Candidates in serving order from `cursor`: the overflow queue first,
    /// then the stream (a mixture: its sources interleaved by weight).
    pub fn candidates<'a>(&'a self, cursor: &'a Cursor) -> Candidates<'a> {
        let n = self.sources();
        let counts = if !self.mix.is_empty()
            && cursor.mix_rev == self.weights_rev
            && cursor.mixed.len() == n
        {
            cursor.mixed.clone()
        } else {
            vec![0; n]
        };
        Candidates {
            order: self,
            overflow: &cursor.overflow,
            next_overflow: 0,
            pos: (0..n).map(|s| cursor.source(s)).collect(),
            counts,
            perms: vec![None; n],
        }
    }

    /// True when the stream has nothing left to serve from `cursor`.
    pub fn exhausted(&self, cursor: &Cursor) -> bool {
        self.candidates(cursor).next().is_none()
    }
}

/// One document offered to the step selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub index: u64,
    from_overflow: bool,
}

/// Iterator over [`Candidate`]s; see [`Order::candidates`].
pub struct Candidates<'a> {
    order: &'a Order,
    overflow: &'a [u64],
    next_overflow: usize,
    /// Where each source stands after the candidates given so far.
    pos: Vec<SourcePos>,
    counts: Vec<u64>,
    perms: Vec<Option<(u64, Arc<[u64]>)>>,
}

impl Candidates<'_> {
    /// Source `s`'s next (epoch, position), an ended epoch wrapped.
    fn next_of(&self, s: usize) -> SourcePos {
        let p = self.pos[s];
        let len = self.order.part(s).len;
        if len > 0 && p.position >= len {
            SourcePos {
                epoch: p.epoch + 1,
                position: 0,
            }
        } else {
            p
        }
    }

    fn live(&self, s: usize) -> bool {
        let part = self.order.part(s);
        part.len > 0 && part.epochs.is_none_or(|e| self.next_of(s).epoch < e)
    }

    /// Writes where the stream stands after the candidates given so far
    /// into `c` (positions and, for a mixture, the interleave's counts).
    fn write_state(&self, c: &mut Cursor) {
        c.epoch = self.pos[0].epoch;
        c.position = self.pos[0].position;
        c.sources = self.pos[1..].to_vec();
        if self.order.mix.is_empty() {
            c.mixed = Vec::new();
            c.mix_rev = 0;
        } else {
            c.mixed = self.counts.clone();
            c.mix_rev = self.order.weights_rev;
        }
    }
}

impl Iterator for Candidates<'_> {
    type Item = Candidate;

    fn next(&mut self) -> Option<Candidate> {
        if let Some(&index) = self.overflow.get(self.next_overflow) {
            self.next_overflow += 1;
            return Some(Candidate {
                index,
                from_overflow: true,
            });
        }
        let s = if self.order.mix.is_empty() {
            Some(0).filter(|_| self.live(0))
        } else {
            let counts = std::mem::take(&mut self.counts);
            let s = self.order.weights.next(&counts, |s| self.live(s));
            self.counts = counts;
            s
        }?;
        let at = self.next_of(s);
        if self.perms[s].as_ref().is_none_or(|(e, _)| *e != at.epoch) {
            self.perms[s] = Some((at.epoch, self.order.source_permutation(s, at.epoch)));
        }
        let (_, perm) = self.perms[s].as_ref().expect("permutation just built");
        let index = perm[at.position as usize];
        self.pos[s] = SourcePos {
            epoch: at.epoch,
            position: at.position + 1,
        };
        self.counts[s] += 1;
        Some(Candidate {
            index,
            from_overflow: false,
        })
    }
}

/// Which of the offered candidates a step took. `consumed` candidates were
/// looked at, in order; those among them not in `taken` are carried over.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selection {
    /// Positions (0-based, in offering order) of the taken candidates.
    pub taken: Vec<usize>,
    /// How many candidates, from the first, the selector looked at.
    pub consumed: usize,
}

impl Order {
    /// The cursor after a step that made `selection` from the candidates
    /// `self.candidates(cursor)` offered.
    pub fn advance(&self, cursor: &Cursor, selection: &Selection) -> Cursor {
        self.advance_skipping(cursor, selection, |_| false)
    }

    /// [`Self::advance`] when the selector was offered the candidates
    /// without those `skip` names (quarantined documents): a skipped
    /// candidate the step passed over is dropped, never carried over.
    pub fn advance_skipping(
        &self,
        cursor: &Cursor,
        selection: &Selection,
        skip: impl Fn(u64) -> bool,
    ) -> Cursor {
        let order = self;
        let mut taken = selection.taken.clone();
        taken.sort_unstable();
        let mut next = cursor.clone();
        next.overflow = Vec::new();
        let mut overflow_consumed = 0;
        let mut untaken_from_stream = Vec::new();
        let mut offered = 0;
        // `taken` is sorted and offers are counted up: a pointer into it
        // answers "taken?" for each in turn, no search per candidate.
        let mut next_taken = taken.iter().copied().peekable();
        let mut it = order.candidates(cursor);
        // Stop before pulling past the last consumed candidate: the
        // iterator's state is then where the stream stands after the step.
        while offered < selection.consumed {
            let Some(c) = it.next() else { break };
            if skip(c.index) {
                if c.from_overflow {
                    overflow_consumed += 1;
                }
                continue;
            }
            let i = offered;
            offered += 1;
            let untaken = next_taken.next_if_eq(&i).is_none();
            if c.from_overflow {
                overflow_consumed += 1;
                if untaken {
                    next.overflow.push(c.index);
                }
            } else if untaken {
                untaken_from_stream.push(c.index);
            }
        }
        // Overflow the selector never looked at stays queued, ahead of this
        // step's new carry-overs: nothing is lost, older documents go first.
        next.overflow
            .extend_from_slice(&cursor.overflow[overflow_consumed..]);
        next.overflow.extend(untaken_from_stream);
        it.write_state(&mut next);
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(len: u64, shuffle: bool, epochs: Option<u64>) -> Order {
        Order::single(7, shuffle, len, epochs)
    }

    /// Issue 19: planning a step must not reshuffle the whole dataset; the
    /// epoch's permutation is drawn once and shared by every clone of the
    /// job's order (each plan clones it).
    #[test]
    fn an_epochs_permutation_is_drawn_once_for_every_step() {
        let order = Order::single(7, true, 10_000, None);
        let first = order.source_permutation(0, 0);
        let again = order.clone().source_permutation(0, 0);
        assert!(Arc::ptr_eq(&first, &again));
        let next_epoch = order.source_permutation(0, 1);
        assert!(!Arc::ptr_eq(&first, &next_epoch));
    }

    #[test]
    fn permutation_is_seeded_and_complete() {
        let o = order(100, true, None);
        let a = o.permutation(0);
        assert_eq!(a, o.permutation(0));
        assert_ne!(a, o.permutation(1), "epochs are shuffled differently");
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn candidates_cross_epochs_and_stop_at_limit() {
        let o = order(3, false, Some(2));
        let got: Vec<u64> = o.candidates(&Cursor::default()).map(|c| c.index).collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1, 2]);
        let endless = order(3, false, None);
        assert_eq!(endless.candidates(&Cursor::default()).take(10).count(), 10);
    }

    #[test]
    fn advance_carries_untaken_candidates_as_overflow() {
        let o = order(5, false, None);
        let c0 = Cursor::default();
        let sel = Selection {
            taken: vec![0, 2],
            consumed: 4,
        };
        let c1 = o.advance(&c0, &sel);
        assert_eq!(
            c1,
            Cursor {
                epoch: 0,
                position: 4,
                overflow: vec![1, 3],
                ..Default::default()
            }
        );
        // Overflow is served first, then the permutation resumes.
        let next: Vec<u64> = o.candidates(&c1).take(4).map(|c| c.index).collect();
        assert_eq!(next, vec![1, 3, 4, 0]);
        // Taking only overflow leaves the position where it was.
        let c2 = o.advance(
            &c1,
            &Selection {
                taken: vec![0, 1],
                consumed: 2,
            },
        );
        assert_eq!(
            c2,
            Cursor {
                epoch: 0,
                position: 4,
                overflow: vec![],
                ..Default::default()
            }
        );
    }

    #[test]
    fn overflow_beyond_the_consumed_candidates_is_kept() {
        // Regression: a queue longer than what a step consumed lost its tail.
        let o = order(10, false, None);
        let c = Cursor {
            epoch: 0,
            position: 5,
            overflow: vec![1, 3, 4],
            ..Default::default()
        };
        let n = o.advance(
            &c,
            &Selection {
                taken: vec![0],
                consumed: 1,
            },
        );
        assert_eq!(
            n,
            Cursor {
                epoch: 0,
                position: 5,
                overflow: vec![3, 4],
                ..Default::default()
            }
        );
        // Consumed past the queue: old untaken first, then new misfits.
        let n = o.advance(
            &c,
            &Selection {
                taken: vec![0, 3],
                consumed: 5,
            },
        );
        assert_eq!(
            n,
            Cursor {
                epoch: 0,
                position: 7,
                overflow: vec![3, 4, 6],
                ..Default::default()
            }
        );
    }

    #[test]
    fn advance_over_epoch_boundary() {
        let o = order(3, false, None);
        let c = Cursor {
            epoch: 0,
            position: 2,
            overflow: vec![],
            ..Default::default()
        };
        let n = o.advance(
            &c,
            &Selection {
                taken: vec![0, 1, 2],
                consumed: 3,
            },
        );
        assert_eq!(
            n,
            Cursor {
                epoch: 1,
                position: 2,
                overflow: vec![],
                ..Default::default()
            }
        );
    }

    #[test]
    fn every_document_served_once_per_epoch() {
        let o = order(17, true, Some(1));
        let mut cursor = Cursor::default();
        let mut seen = Vec::new();
        while !o.exhausted(&cursor) {
            let offered: Vec<u64> = o.candidates(&cursor).take(5).map(|c| c.index).collect();
            // Take every other candidate; the rest overflow.
            let taken: Vec<usize> = (0..offered.len()).step_by(2).collect();
            seen.extend(taken.iter().map(|&i| offered[i]));
            cursor = o.advance(
                &cursor,
                &Selection {
                    taken,
                    consumed: offered.len(),
                },
            );
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..17).collect::<Vec<_>>());
    }

    fn mixture(epochs: [Option<u64>; 3]) -> Order {
        let parts = [(0, 10), (10, 20), (30, 5)]
            .iter()
            .zip(epochs)
            .map(|(&(start, len), epochs)| SourceOrder { start, len, epochs })
            .collect();
        Order::mixture(11, true, parts, vec![2.0, 1.0, 1.0])
    }

    #[test]
    fn a_mixture_serves_each_source_exactly_once_per_source_epoch() {
        let o = mixture([Some(2), Some(1), Some(3)]);
        let mut cursor = Cursor::default();
        let mut seen = vec![0u64; 35];
        let mut steps = 0;
        while !o.exhausted(&cursor) {
            let offered: Vec<u64> = o.candidates(&cursor).take(4).map(|c| c.index).collect();
            let per_source = |s: usize| offered.iter().filter(|&&i| o.source_of(i) == s).count();
            if steps < 2 {
                // While every source is live a step of Σdocs = 4 holds
                // exactly 2, 1 and 1 documents of the three sources.
                assert_eq!(
                    (per_source(0), per_source(1), per_source(2)),
                    (2, 1, 1),
                    "{offered:?}"
                );
            }
            for &i in &offered {
                seen[i as usize] += 1;
            }
            // Every other step takes half and carries the rest over.
            let taken: Vec<usize> = if steps % 2 == 0 {
                (0..offered.len()).collect()
            } else {
                (0..offered.len()).step_by(2).collect()
            };
            for (k, &i) in offered.iter().enumerate() {
                if !taken.contains(&k) {
                    seen[i as usize] -= 1;
                }
            }
            let sel = Selection {
                taken,
                consumed: offered.len(),
            };
            cursor = o.advance(&cursor, &sel);
            // The cursor survives a round trip through its stored form.
            cursor = serde_json::from_str(&serde_json::to_string(&cursor).unwrap()).unwrap();
            steps += 1;
        }
        for (i, &n) in seen.iter().enumerate() {
            let want = match i {
                0..10 => 2,
                10..30 => 1,
                _ => 3,
            };
            assert_eq!(n, want, "document {i}");
        }
    }

    #[test]
    fn new_weights_restart_the_interleave_from_their_step() {
        let o = mixture([None, None, None]);
        let c = Cursor::default();
        let sel = Selection {
            taken: (0..3).collect(),
            consumed: 3,
        };
        let c = o.advance(&c, &sel);
        assert_eq!(c.mixed.iter().sum::<u64>(), 3);
        // Only source 2 from now on: its weight dominates every count.
        let only = o.with_weights(vec![1e-9, 1e-9, 1.0], 1);
        let next: Vec<usize> = only
            .candidates(&c)
            .take(5)
            .map(|x| only.source_of(x.index))
            .collect();
        assert_eq!(next, vec![2; 5]);
        let c2 = only.advance(
            &c,
            &Selection {
                taken: (0..5).collect(),
                consumed: 5,
            },
        );
        assert_eq!(c2.mix_rev, 1);
        assert_eq!(c2.mixed, vec![0, 0, 5]);
    }
}
