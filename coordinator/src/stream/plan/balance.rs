//! Rank balancing for [`super::solve`]: split bins into spare slots, deal
//! them to ranks by LPT (longest processing time first) with an equal
//! number of slots per rank, then improve locally between the costliest and
//! the cheapest rank. Bins here are lists of item indices; every change
//! keeps each bin within the token budget. See README.md beside this file.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// A non-negative cost as a totally ordered integer key (IEEE-754 bit
/// patterns of non-negative floats sort like the floats).
pub(super) fn cost_key(c: f64) -> u64 {
    debug_assert!(c >= 0.0 && c.is_finite(), "cost {c}");
    c.to_bits()
}

/// Splits the costliest multi-item bins in two until there are `slots`
/// bins (or nothing is left to split). Each half is a subset of a bin that
/// fit, so it fits too.
pub(super) fn split_for_balance(bins: &mut Vec<Vec<usize>>, slots: usize, costs: &[f64]) {
    let bin_cost = |b: &[usize]| -> f64 { b.iter().map(|&i| costs[i]).sum() };
    let mut heap: BinaryHeap<(u64, Reverse<usize>)> = bins
        .iter()
        .enumerate()
        .filter(|(_, b)| b.len() >= 2)
        .map(|(i, b)| (cost_key(bin_cost(b)), Reverse(i)))
        .collect();
    while bins.len() < slots {
        let Some((_, Reverse(b))) = heap.pop() else {
            break;
        };
        let mut members = std::mem::take(&mut bins[b]);
        members.sort_unstable_by(|&x, &y| costs[y].total_cmp(&costs[x]).then(x.cmp(&y)));
        // Greedy two-way partition by cost: each item to the lighter half.
        let (mut left, mut right) = (vec![members[0]], vec![members[1]]);
        let (mut lc, mut rc) = (costs[members[0]], costs[members[1]]);
        for &i in &members[2..] {
            if lc <= rc {
                left.push(i);
                lc += costs[i];
            } else {
                right.push(i);
                rc += costs[i];
            }
        }
        let new = bins.len();
        if left.len() >= 2 {
            heap.push((cost_key(lc), Reverse(b)));
        }
        if right.len() >= 2 {
            heap.push((cost_key(rc), Reverse(new)));
        }
        bins[b] = left;
        bins.push(right);
    }
}

/// A load as a key ordered like the loads (`f64::total_cmp`; equal loads,
/// equal keys, but for ±0, which a sum of non-negative costs never makes
/// negative).
pub(super) fn load_key(load: f64) -> u64 {
    let bits = load.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// The costliest rank and the cheapest one, each the lowest-numbered
/// among equals (what a scan of the ranks in order finds).
pub(super) fn extremes(by_load: &BTreeSet<(u64, usize)>) -> (usize, usize) {
    let (&(top, _), &(_, lo)) = (
        by_load.last().expect("two or more ranks"),
        by_load.first().expect("two or more ranks"),
    );
    let &(_, hi) = by_load.range((top, 0)..).next().expect("top is there");
    (hi, lo)
}

/// Above this many (document in the costliest rank × document in the
/// cheapest rank) pairs, the local search skips document exchanges in a
/// round, keeping a round O(docs · m) on very large steps.
const EXCHANGE_WORK_LIMIT: usize = 1 << 14;

/// The local search's work budget per document and bin of the step (pairs
/// looked at, plus a scan of the ranks per round).
const SEARCH_WORK_PER_ITEM: usize = 256;

/// Bins, their totals, and which rank holds which bin.
pub(super) struct Layout<'a> {
    tokens: &'a [u64],
    /// Each item's group: items move only into bins of their own group.
    groups: &'a [u32],
    costs: &'a [f64],
    max: u64,
    bins: Vec<Vec<usize>>,
    bin_tokens: Vec<u64>,
    bin_costs: Vec<f64>,
    /// Bin indices per rank.
    ranks: Vec<Vec<usize>>,
    loads: Vec<f64>,
}

/// One local-search step between the costliest rank `hi` and the cheapest
/// rank `lo`; positions index `ranks[..]` or a bin's items.
#[derive(Debug, Clone, Copy)]
enum Change {
    /// Exchange slot i of `hi` with slot j of `lo` (whole bins).
    Bins(usize, usize),
    /// Move item p of bin a (in `hi`) into bin b (in `lo`).
    Move { a: usize, p: usize, b: usize },
    /// Exchange item p of bin a (in `hi`) with item q of bin b (in `lo`).
    Exchange {
        a: usize,
        p: usize,
        b: usize,
        q: usize,
    },
}

/// The change whose moved cost `d` is in (0, gap), closest to gap / 2:
/// that minimises the larger of the two ranks' new costs.
struct Best {
    gap: f64,
    found: Option<(f64, Change)>,
}

impl Best {
    fn offer(&mut self, d: f64, change: Change) {
        // Relative margins keep float noise from counting as progress.
        if d <= self.gap * 1e-9 || d >= self.gap * (1.0 - 1e-9) {
            return;
        }
        let miss = (self.gap / 2.0 - d).abs();
        if self.found.is_none_or(|(m, _)| miss < m) {
            self.found = Some((miss, change));
        }
    }
}

impl<'a> Layout<'a> {
    pub(super) fn new(
        bins: Vec<Vec<usize>>,
        tokens: &'a [u64],
        costs: &'a [f64],
        max: u64,
        groups: &'a [u32],
    ) -> Self {
        let bin_tokens = bins
            .iter()
            .map(|b| b.iter().map(|&i| tokens[i]).sum())
            .collect();
        let bin_costs = bins
            .iter()
            .map(|b| b.iter().map(|&i| costs[i]).sum())
            .collect();
        Layout {
            tokens,
            groups,
            costs,
            max,
            bins,
            bin_tokens,
            bin_costs,
            ranks: Vec::new(),
            loads: Vec::new(),
        }
    }

    /// LPT with `m` slots per rank: costliest bin first, to the cheapest
    /// rank with a free slot (ties: lower bin, lower rank). Needs
    /// `bins.len() == w * m`.
    pub(super) fn longest_processing_time(&mut self, w: usize, m: usize) {
        debug_assert_eq!(self.bins.len(), w * m);
        let c = &self.bin_costs;
        let mut order: Vec<usize> = (0..c.len()).collect();
        order.sort_unstable_by(|&a, &b| c[b].total_cmp(&c[a]).then(a.cmp(&b)));
        self.ranks = (0..w).map(|_| Vec::with_capacity(m)).collect();
        self.loads = vec![0.0; w];
        // Min-heap of (load, rank) over ranks with a free slot.
        let mut open: BinaryHeap<Reverse<(u64, usize)>> = (0..w).map(|r| Reverse((0, r))).collect();
        for b in order {
            let Reverse((_, r)) = open.pop().expect("w·m slots for w·m bins");
            self.ranks[r].push(b);
            self.loads[r] += c[b];
            if self.ranks[r].len() < m {
                open.push(Reverse((cost_key(self.loads[r]), r)));
            }
        }
    }

    /// Local search: while some change between the costliest and the
    /// cheapest rank strictly lowers the costlier of the two, apply the best.
    pub(super) fn improve(&mut self) {
        let w = self.ranks.len();
        if w < 2 {
            return;
        }
        // Each change strictly lowers the pair's maximum; the cap bounds the
        // work on adversarial inputs, and the work budget keeps the search
        // proportional to the step (issue 19: at 1024 ranks of 64 documents
        // it was a third of the coordinator's time, for a last percent).
        let max_rounds = 2 * (self.tokens.len() + self.bins.len()) + 16;
        let budget = SEARCH_WORK_PER_ITEM * (self.tokens.len() + self.bins.len()) + (1 << 16);
        let mut spent = 0usize;
        // Ranks by load: a round changes two loads, so the costliest and
        // the cheapest rank are found in O(log W), not by a scan of W.
        let mut by_load: BTreeSet<(u64, usize)> =
            (0..w).map(|r| (load_key(self.loads[r]), r)).collect();
        for _ in 0..max_rounds {
            if spent > budget {
                break;
            }
            let (hi, lo) = extremes(&by_load);
            // A round is still charged the W-rank scan it replaced, so
            // the budget, and with it every plan, is what it was.
            spent += w + self.round_work(hi, lo);
            let Some(change) = self.best_change(hi, lo) else {
                break;
            };
            by_load.remove(&(load_key(self.loads[hi]), hi));
            by_load.remove(&(load_key(self.loads[lo]), lo));
            self.apply(hi, lo, change);
            by_load.insert((load_key(self.loads[hi]), hi));
            by_load.insert((load_key(self.loads[lo]), lo));
        }
    }

    /// Pairs [`Self::best_change`] looks at between `hi` and `lo`.
    fn round_work(&self, hi: usize, lo: usize) -> usize {
        let docs = |r: usize| -> usize { self.ranks[r].iter().map(|&b| self.bins[b].len()).sum() };
        let (dh, dl) = (docs(hi), docs(lo));
        let (sh, sl) = (self.ranks[hi].len(), self.ranks[lo].len());
        let exchanges = if dh * dl <= EXCHANGE_WORK_LIMIT {
            dh * dl
        } else {
            0
        };
        sh * sl + dh * sl + exchanges
    }

    fn best_change(&self, hi: usize, lo: usize) -> Option<Change> {
        let mut best = Best {
            gap: self.loads[hi] - self.loads[lo],
            found: None,
        };
        if best.gap <= 0.0 {
            return None;
        }
        let (bc, bt, t, c) = (&self.bin_costs, &self.bin_tokens, self.tokens, self.costs);
        for (i, &a) in self.ranks[hi].iter().enumerate() {
            for (j, &b) in self.ranks[lo].iter().enumerate() {
                best.offer(bc[a] - bc[b], Change::Bins(i, j));
            }
        }
        for &a in &self.ranks[hi] {
            for (p, &x) in self.bins[a].iter().enumerate() {
                for &b in &self.ranks[lo] {
                    if bt[b] + t[x] <= self.max && self.fits_group(x, b) {
                        best.offer(c[x], Change::Move { a, p, b });
                    }
                }
            }
        }
        let docs = |r: usize| -> usize { self.ranks[r].iter().map(|&b| self.bins[b].len()).sum() };
        if docs(hi) * docs(lo) <= EXCHANGE_WORK_LIMIT {
            for &a in &self.ranks[hi] {
                for (p, &x) in self.bins[a].iter().enumerate() {
                    for &b in &self.ranks[lo] {
                        for (q, &y) in self.bins[b].iter().enumerate() {
                            if bt[a] - t[x] + t[y] <= self.max
                                && bt[b] - t[y] + t[x] <= self.max
                                && self.groups[x] == self.groups[y]
                            {
                                best.offer(c[x] - c[y], Change::Exchange { a, p, b, q });
                            }
                        }
                    }
                }
            }
        }
        best.found.map(|(_, change)| change)
    }

    /// Whether item `x` may join bin `b` (empty, or of its group).
    fn fits_group(&self, x: usize, b: usize) -> bool {
        self.bins[b]
            .first()
            .is_none_or(|&y| self.groups[y] == self.groups[x])
    }

    fn apply(&mut self, hi: usize, lo: usize, change: Change) {
        let d = match change {
            Change::Bins(i, j) => {
                let (a, b) = (self.ranks[hi][i], self.ranks[lo][j]);
                self.ranks[hi][i] = b;
                self.ranks[lo][j] = a;
                self.bin_costs[a] - self.bin_costs[b]
            }
            Change::Move { a, p, b } => {
                let x = self.bins[a].swap_remove(p);
                self.bins[b].push(x);
                self.shift(a, b, self.tokens[x] as i64, self.costs[x]);
                self.costs[x]
            }
            Change::Exchange { a, p, b, q } => {
                let (x, y) = (self.bins[a][p], self.bins[b][q]);
                self.bins[a][p] = y;
                self.bins[b][q] = x;
                let dt = self.tokens[x] as i64 - self.tokens[y] as i64;
                let dc = self.costs[x] - self.costs[y];
                self.shift(a, b, dt, dc);
                dc
            }
        };
        self.loads[hi] -= d;
        self.loads[lo] += d;
    }

    /// Moves `dt` tokens and `dc` cost from bin `a` to bin `b`.
    fn shift(&mut self, a: usize, b: usize, dt: i64, dc: f64) {
        self.bin_tokens[a] = self.bin_tokens[a].wrapping_add_signed(-dt);
        self.bin_tokens[b] = self.bin_tokens[b].wrapping_add_signed(dt);
        self.bin_costs[a] -= dc;
        self.bin_costs[b] += dc;
        debug_assert!(self.bin_tokens[a] <= self.max && self.bin_tokens[b] <= self.max);
    }

    /// The bins and, per rank, the indices of its bins.
    pub(super) fn into_parts(self) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
        (self.bins, self.ranks)
    }
}
