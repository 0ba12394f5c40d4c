//! The data cursor: where a job's document stream stands. It is plain data
//! (serialisable, persisted with the job) and moves only when a step commits,
//! so an aborted step is re-planned from the same cursor with the same
//! documents.
//!
//! Order within an epoch is a seeded permutation (ChaCha8 seeded from the job
//! seed and the epoch, Fisher–Yates), so it is reproducible across restarts
//! and machines without storing the permutation.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Position of a job's data stream.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    /// 0-based epoch of the next document.
    pub epoch: u64,
    /// Index into the epoch's permutation of the next document.
    pub position: u64,
    /// Dataset indices taken out of order and carried to the next step; they
    /// are served before the permutation continues.
    pub overflow: Vec<u64>,
}

/// How the stream orders documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    pub seed: u64,
    pub shuffle: bool,
    /// Number of documents in the dataset.
    pub len: u64,
    /// Last epoch (exclusive) the stream serves; `None` = endless.
    pub epochs: Option<u64>,
}

impl Order {
    /// The dataset indices of `epoch` in serving order.
    pub fn permutation(&self, epoch: u64) -> Vec<u64> {
        let mut perm: Vec<u64> = (0..self.len).collect();
        if self.shuffle {
            // Distinct, reproducible stream per (seed, epoch).
            let mut rng =
                ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            perm.shuffle(&mut rng);
        }
        perm
    }

    /// Candidates in serving order from `cursor`: the overflow queue first,
    /// then the rest of the current epoch, then the following epochs.
    pub fn candidates<'a>(&'a self, cursor: &'a Cursor) -> Candidates<'a> {
        Candidates {
            order: self,
            overflow: &cursor.overflow,
            next_overflow: 0,
            epoch: cursor.epoch,
            position: cursor.position,
            perm: None,
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
    /// Where the stream stands after this candidate (for the permutation part).
    from_overflow: bool,
    epoch: u64,
    position: u64,
}

/// Iterator over [`Candidate`]s; see [`Order::candidates`].
pub struct Candidates<'a> {
    order: &'a Order,
    overflow: &'a [u64],
    next_overflow: usize,
    epoch: u64,
    position: u64,
    perm: Option<(u64, Vec<u64>)>,
}

impl Iterator for Candidates<'_> {
    type Item = Candidate;

    fn next(&mut self) -> Option<Candidate> {
        if let Some(&index) = self.overflow.get(self.next_overflow) {
            self.next_overflow += 1;
            return Some(Candidate {
                index,
                from_overflow: true,
                epoch: self.epoch,
                position: self.position,
            });
        }
        if self.order.len == 0 {
            return None;
        }
        if self.position >= self.order.len {
            self.epoch += 1;
            self.position = 0;
        }
        if self.order.epochs.is_some_and(|e| self.epoch >= e) {
            return None;
        }
        if self.perm.as_ref().is_none_or(|(e, _)| *e != self.epoch) {
            self.perm = Some((self.epoch, self.order.permutation(self.epoch)));
        }
        let (_, perm) = self.perm.as_ref().expect("permutation just built");
        let index = perm[self.position as usize];
        self.position += 1;
        Some(Candidate {
            index,
            from_overflow: false,
            epoch: self.epoch,
            position: self.position,
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

impl Cursor {
    /// The cursor after a step that made `selection` from the candidates
    /// `order.candidates(self)` offered.
    pub fn advance(&self, order: &Order, selection: &Selection) -> Cursor {
        self.advance_skipping(order, selection, |_| false)
    }

    /// [`Self::advance`] when the selector was offered the candidates
    /// without those `skip` names (quarantined documents): a skipped
    /// candidate the step passed over is dropped, never carried over.
    pub fn advance_skipping(
        &self,
        order: &Order,
        selection: &Selection,
        skip: impl Fn(u64) -> bool,
    ) -> Cursor {
        let mut taken = selection.taken.clone();
        taken.sort_unstable();
        let mut next = Cursor {
            epoch: self.epoch,
            position: self.position,
            overflow: Vec::new(),
        };
        let mut last_from_stream = None;
        let mut overflow_consumed = 0;
        let mut untaken_from_stream = Vec::new();
        let mut offered = 0;
        for c in order.candidates(self) {
            if offered == selection.consumed {
                break;
            }
            if skip(c.index) {
                if c.from_overflow {
                    overflow_consumed += 1;
                } else {
                    last_from_stream = Some(c);
                }
                continue;
            }
            let i = offered;
            offered += 1;
            let untaken = taken.binary_search(&i).is_err();
            if c.from_overflow {
                overflow_consumed += 1;
                if untaken {
                    next.overflow.push(c.index);
                }
            } else {
                if untaken {
                    untaken_from_stream.push(c.index);
                }
                last_from_stream = Some(c);
            }
        }
        // Overflow the selector never looked at stays queued, ahead of this
        // step's new carry-overs: nothing is lost, older documents go first.
        next.overflow
            .extend_from_slice(&self.overflow[overflow_consumed..]);
        next.overflow.extend(untaken_from_stream);
        if let Some(c) = last_from_stream {
            next.epoch = c.epoch;
            next.position = c.position;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(len: u64, shuffle: bool, epochs: Option<u64>) -> Order {
        Order {
            seed: 7,
            shuffle,
            len,
            epochs,
        }
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
        let c1 = c0.advance(&o, &sel);
        assert_eq!(
            c1,
            Cursor {
                epoch: 0,
                position: 4,
                overflow: vec![1, 3]
            }
        );
        // Overflow is served first, then the permutation resumes.
        let next: Vec<u64> = o.candidates(&c1).take(4).map(|c| c.index).collect();
        assert_eq!(next, vec![1, 3, 4, 0]);
        // Taking only overflow leaves the position where it was.
        let c2 = c1.advance(
            &o,
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
                overflow: vec![]
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
        };
        let n = c.advance(
            &o,
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
                overflow: vec![3, 4]
            }
        );
        // Consumed past the queue: old untaken first, then new misfits.
        let n = c.advance(
            &o,
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
                overflow: vec![3, 4, 6]
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
        };
        let n = c.advance(
            &o,
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
                overflow: vec![]
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
            cursor = cursor.advance(
                &o,
                &Selection {
                    taken,
                    consumed: offered.len(),
                },
            );
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..17).collect::<Vec<_>>());
    }
}
