//! Best fit's open bins by free room: which bin has the least room that
//! still holds `t` tokens (lowest index on ties). Room is an integer no
//! larger than `max_tokens`, so it indexes a bit set (a bit per room value,
//! a summary bit per word) instead of an ordered set of (room, bin) pairs:
//! at 16k documents a step, the ordered set's three searches per document
//! were a tenth of the coordinator's time (issue 19).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Rooms up to this take a bit each (128 KiB at most); bins larger than
/// that (a `max_tokens` over a million) use the ordered set.
const DENSE_MAX: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub(super) enum FreeBins {
    Dense(Dense),
    /// (room, bin) of every open bin.
    Sparse(BTreeSet<(u64, usize)>),
}

#[derive(Debug, Clone)]
pub(super) struct Dense {
    /// Bit `r % 64` of `words[r / 64]`: some open bin has room `r`.
    words: Vec<u64>,
    /// Bit `w % 64` of `summary[w / 64]`: `words[w]` is not zero.
    summary: Vec<u64>,
    /// The bins of each room, lowest index first out.
    bins: HashMap<u64, BinaryHeap<Reverse<usize>>, BuildHasherDefault<RoomHasher>>,
    /// Open bins with any room.
    roomy: usize,
}

impl FreeBins {
    /// Open bins of at most `max` room.
    pub(super) fn new(max: u64) -> Self {
        if max <= DENSE_MAX {
            let words = (max / 64 + 1) as usize;
            FreeBins::Dense(Dense {
                words: vec![0; words],
                summary: vec![0; words.div_ceil(64)],
                bins: HashMap::default(),
                roomy: 0,
            })
        } else {
            FreeBins::Sparse(BTreeSet::new())
        }
    }

    /// The ordered set whatever the room (the reference the dense form is
    /// tested against).
    #[cfg(test)]
    pub(super) fn sparse() -> Self {
        FreeBins::Sparse(BTreeSet::new())
    }

    /// Takes out the bin with the least room of at least `t`, lowest index
    /// on ties: its (room, index).
    pub(super) fn take(&mut self, t: u64) -> Option<(u64, usize)> {
        match self {
            FreeBins::Sparse(set) => {
                let key = set.range((t, 0)..).next().copied()?;
                set.remove(&key);
                Some(key)
            }
            FreeBins::Dense(d) => {
                let room = d.at_least(t)?;
                let heap = d.bins.get_mut(&room).expect("a set bit has bins");
                let Reverse(bin) = heap.pop().expect("a set bit has bins");
                if heap.is_empty() {
                    d.clear(room);
                }
                if room > 0 {
                    d.roomy -= 1;
                }
                Some((room, bin))
            }
        }
    }

    /// Puts open bin `bin` back with `room` left.
    pub(super) fn put(&mut self, room: u64, bin: usize) {
        match self {
            FreeBins::Sparse(set) => {
                set.insert((room, bin));
            }
            FreeBins::Dense(d) => {
                d.bins.entry(room).or_default().push(Reverse(bin));
                d.set(room);
                if room > 0 {
                    d.roomy += 1;
                }
            }
        }
    }

    /// True when no open bin has any room.
    pub(super) fn all_full(&self) -> bool {
        match self {
            FreeBins::Sparse(set) => set.last().is_none_or(|&(r, _)| r == 0),
            FreeBins::Dense(d) => d.roomy == 0,
        }
    }
}

/// Hashes a room with one multiplication (Fibonacci hashing): rooms are
/// small integers, never chosen by an adversary, and SipHash was a fifth
/// of a placement.
#[derive(Default)]
pub(super) struct RoomHasher(u64);

impl Hasher for RoomHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Dense {
    /// The least room of at least `t` some bin has.
    fn at_least(&self, t: u64) -> Option<u64> {
        let w = usize::try_from(t / 64)
            .ok()
            .filter(|&w| w < self.words.len())?;
        let here = self.words[w] & (!0u64 << (t % 64));
        if here != 0 {
            return Some(w as u64 * 64 + u64::from(here.trailing_zeros()));
        }
        let next = w + 1;
        let first = next / 64;
        for (i, &s) in self.summary.iter().enumerate().skip(first) {
            let s = if i == first {
                s & (!0u64 << (next % 64))
            } else {
                s
            };
            if s != 0 {
                let word = i * 64 + s.trailing_zeros() as usize;
                return Some(word as u64 * 64 + u64::from(self.words[word].trailing_zeros()));
            }
        }
        None
    }

    fn set(&mut self, room: u64) {
        let w = (room / 64) as usize;
        self.words[w] |= 1 << (room % 64);
        self.summary[w / 64] |= 1 << (w % 64);
    }

    fn clear(&mut self, room: u64) {
        let w = (room / 64) as usize;
        self.words[w] &= !(1 << (room % 64));
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any sequence of takes and puts gives what the ordered set gives,
        /// rooms around word and summary boundaries included.
        #[test]
        fn the_bit_set_takes_the_bins_the_ordered_set_takes(
            max in prop_oneof![Just(0u64), Just(63), Just(64), Just(4095), Just(4096), 1u64..70_000],
            ops in proptest::collection::vec((any::<bool>(), any::<proptest::sample::Index>()), 1..300),
        ) {
            let (mut dense, mut sparse) = (FreeBins::new(max), FreeBins::sparse());
            prop_assert!(matches!(dense, FreeBins::Dense(_)));
            let mut next_bin = 0;
            for (put, at) in ops {
                // Rooms near the edges of words as often as anywhere.
                let edges = [0, 1, 62, 63, 64, 65, 4095, 4096, 4097, max];
                let pick = at.index(2 * edges.len());
                let room = match edges.get(pick) {
                    Some(&e) => e.min(max),
                    None => at.index(max as usize + 1) as u64,
                };
                if put {
                    dense.put(room, next_bin);
                    sparse.put(room, next_bin);
                    next_bin += 1;
                } else {
                    prop_assert_eq!(dense.take(room), sparse.take(room), "take {}", room);
                }
                prop_assert_eq!(dense.all_full(), sparse.all_full());
            }
        }
    }

    #[test]
    fn bins_beyond_the_dense_limit_use_the_ordered_set() {
        assert!(matches!(FreeBins::new(DENSE_MAX), FreeBins::Dense(_)));
        let mut big = FreeBins::new(DENSE_MAX + 1);
        assert!(matches!(big, FreeBins::Sparse(_)));
        big.put(5, 0);
        assert_eq!(big.take(6), None);
        assert_eq!(big.take(5), Some((5, 0)));
    }
}
