//! Interleaving a mixture's sources by weight, deterministically.
//!
//! Each source's n-th document (0-based, counted since the weights last
//! changed) gets the virtual time `(n + ½) / w`; the stream serves the
//! live source whose next document has the smallest one (weighted fair
//! queuing, as a packet scheduler shares a link). Ties go to the source
//! ranked first by a permutation seeded from the job's seed. Over any
//! window the stream holds `w_s / Σw` of the documents up to one, and with
//! integer weights `d_s` (`docs` per source) every `Σd` consecutive
//! documents from a count of zero hold exactly `d_s` of source s: a
//! `docs_per_step` step of `Σd` holds exactly the promised documents of
//! each source. The state is the counts, plain integers in the cursor.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The weights a mixture is served with and how ties break.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    pub weights: Vec<f64>,
    /// Rank of each source for tie-breaking (lower first), seeded.
    rank: Vec<u32>,
}

impl Weights {
    pub fn new(weights: Vec<f64>, seed: u64) -> Weights {
        let mut order: Vec<u32> = (0..weights.len() as u32).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x6d69_7874_7572_6573));
        let mut rank = vec![0; order.len()];
        for (r, &s) in order.iter().enumerate() {
            rank[s as usize] = r as u32;
        }
        Weights { weights, rank }
    }

    /// The source that serves the next document: the live one (by `live`)
    /// with the earliest virtual time given `counts`, or `None` when no
    /// source is live.
    pub fn next(&self, counts: &[u64], live: impl Fn(usize) -> bool) -> Option<usize> {
        let mut best: Option<usize> = None;
        for s in 0..self.weights.len() {
            if !live(s) {
                continue;
            }
            best = match best {
                None => Some(s),
                Some(b) if self.earlier(s, b, counts) => Some(s),
                keep => keep,
            };
        }
        best
    }

    /// Whether source `a`'s next document comes before source `b`'s:
    /// `(2n_a + 1) / w_a < (2n_b + 1) / w_b`, cross-multiplied (exact for
    /// integer weights).
    fn earlier(&self, a: usize, b: usize, counts: &[u64]) -> bool {
        let ta = (2 * counts[a] + 1) as f64 * self.weights[b];
        let tb = (2 * counts[b] + 1) as f64 * self.weights[a];
        ta < tb || (ta == tb && self.rank[a] < self.rank[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(w: &Weights, n: usize, counts: &mut [u64]) -> Vec<usize> {
        (0..n)
            .map(|_| {
                let s = w.next(counts, |_| true).unwrap();
                counts[s] += 1;
                s
            })
            .collect()
    }

    #[test]
    fn integer_weights_give_exact_counts_per_cycle() {
        let w = Weights::new(vec![5.0, 2.0, 1.0], 7);
        let mut counts = vec![0; 3];
        for _ in 0..50 {
            let step = serve(&w, 8, &mut counts);
            for (s, want) in [(0, 5), (1, 2), (2, 1)] {
                assert_eq!(step.iter().filter(|&&x| x == s).count(), want, "{step:?}");
            }
        }
    }

    #[test]
    fn real_weights_stay_within_one_document_of_their_share() {
        let w = Weights::new(vec![0.7, 0.2, 0.1], 3);
        let mut counts = vec![0u64; 3];
        for n in 1..=1000u64 {
            let s = w.next(&counts, |_| true).unwrap();
            counts[s] += 1;
            for (i, &c) in counts.iter().enumerate() {
                let share = w.weights[i] * n as f64;
                assert!((c as f64 - share).abs() <= 1.0, "n={n} {counts:?}");
            }
        }
    }

    #[test]
    fn dead_sources_are_passed_over_and_ties_follow_the_seed() {
        let w = Weights::new(vec![1.0, 1.0], 1);
        assert_eq!(w.next(&[0, 0], |s| s == 1), Some(1));
        assert_eq!(w.next(&[0, 0], |_| false), None);
        let first = |seed| Weights::new(vec![1.0; 4], seed).next(&[0; 4], |_| true);
        let firsts: std::collections::BTreeSet<_> = (0..32).map(first).collect();
        assert!(firsts.len() > 1, "the seed picks who goes first");
    }
}
