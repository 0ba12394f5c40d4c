//! The ring schedules as plain data, with no I/O: for one rank, the byte
//! ranges it sends to the next rank and receives from the previous one, in
//! order, split into pieces of at most a chunk each, and for every piece how
//! many pieces of the other direction must be finished before it may start.
//! [`crate::TcpRing`] runs a schedule with a sender thread and a receiving
//! thread; the `after` counts are what let them overlap without ever reading
//! bytes that have not arrived yet or overwriting bytes still being sent.
//!
//! Segment `s` of the buffer is `shard_range(len, world, s)`. With `n` ranks
//! (Patarasuk & Yuan 2009; NCCL's ring):
//! - reduce-scatter, steps `k = 0..n-1`: send segment `r-k-1`, receive
//!   segment `r-k-2` and add it in; after the last step rank `r` holds the
//!   full sum of segment `r` (each element is summed at exactly one rank, so
//!   every rank ends with bit-identical values once they are gathered);
//! - all-gather, steps `k = 0..n-1`: send segment `r-k`, receive segment
//!   `r-k-1` and copy it in;
//! - all-reduce: reduce-scatter then all-gather (steps numbered on);
//! - broadcast: a pipelined chain `root → root+1 → … → root-1`.

use std::ops::Range;

use crate::shard::shard_range;

/// What a received piece does with its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// Overwrite the destination bytes.
    Copy,
    /// Add the little-endian f32s to the destination's.
    SumF32,
}

/// One message: a byte range of the buffer sent (or received) at a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Ring step; the sender's and the receiver's pieces of one message carry
    /// the same step and byte range.
    pub step: u32,
    /// Bytes of the buffer.
    pub bytes: Range<usize>,
    /// For received pieces: what to do with the bytes.
    pub apply: Apply,
    /// How many pieces of the other direction must be finished first.
    pub after: usize,
}

/// Everything one rank sends and receives in one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Length of the buffer in bytes.
    pub total: usize,
    /// Sent to the next rank, in order.
    pub sends: Vec<Piece>,
    /// Received from the previous rank, in order.
    pub recvs: Vec<Piece>,
}

/// Geometry shared by the builders.
#[derive(Debug, Clone, Copy)]
pub struct Ring {
    pub world: usize,
    pub rank: usize,
    /// Most bytes in one piece (rounded down to whole elements, at least one).
    pub chunk_bytes: usize,
}

impl Ring {
    fn seg(&self, len: usize, elem: usize, s: isize) -> Range<usize> {
        let s = s.rem_euclid(self.world as isize) as usize;
        let r = shard_range(len, self.world, s);
        r.start * elem..r.end * elem
    }

    /// Splits `bytes` into pieces of at most a chunk (one empty piece if
    /// `bytes` is empty, so that every step still exchanges a header).
    fn pieces(&self, bytes: Range<usize>, elem: usize, step: u32, apply: Apply) -> Vec<Piece> {
        let chunk = (self.chunk_bytes / elem).max(1) * elem;
        let mut out = Vec::new();
        let mut at = bytes.start;
        loop {
            let end = (at + chunk).min(bytes.end);
            out.push(Piece {
                step,
                bytes: at..end,
                apply,
                after: 0,
            });
            at = end;
            if at >= bytes.end {
                return out;
            }
        }
    }
}

fn reduce_scatter_into(s: &mut Schedule, g: Ring, len: usize, first_step: u32) {
    let r = g.rank as isize;
    for k in 0..g.world.saturating_sub(1) {
        let step = first_step + k as u32;
        let ki = k as isize;
        s.sends
            .extend(g.pieces(g.seg(len, 4, r - ki - 1), 4, step, Apply::Copy));
        s.recvs
            .extend(g.pieces(g.seg(len, 4, r - ki - 2), 4, step, Apply::SumF32));
    }
}

fn all_gather_into(s: &mut Schedule, g: Ring, len: usize, elem: usize, first_step: u32) {
    let r = g.rank as isize;
    for k in 0..g.world.saturating_sub(1) {
        let step = first_step + k as u32;
        let ki = k as isize;
        s.sends
            .extend(g.pieces(g.seg(len, elem, r - ki), elem, step, Apply::Copy));
        s.recvs
            .extend(g.pieces(g.seg(len, elem, r - ki - 1), elem, step, Apply::Copy));
    }
}

fn empty(total: usize) -> Schedule {
    Schedule {
        total,
        sends: Vec::new(),
        recvs: Vec::new(),
    }
}

/// Reduce-scatter of `len` f32s: afterwards segment `rank` holds the sum.
pub fn reduce_scatter(g: Ring, len: usize) -> Schedule {
    let mut s = empty(len * 4);
    reduce_scatter_into(&mut s, g, len, 0);
    link(s)
}

/// All-gather of `len` elements of `elem` bytes: every rank contributes its
/// segment and ends with all of them.
pub fn all_gather(g: Ring, len: usize, elem: usize) -> Schedule {
    let mut s = empty(len * elem);
    all_gather_into(&mut s, g, len, elem, 0);
    link(s)
}

/// All-reduce (sum) of `len` f32s: reduce-scatter, then all-gather.
pub fn all_reduce(g: Ring, len: usize) -> Schedule {
    let mut s = empty(len * 4);
    reduce_scatter_into(&mut s, g, len, 0);
    all_gather_into(&mut s, g, len, 4, g.world as u32 - 1);
    link(s)
}

/// Broadcast of `total` bytes from `root` along the ring; each rank forwards
/// a piece as soon as it has it (the last rank before `root` only receives).
pub fn broadcast(g: Ring, total: usize, root: usize) -> Schedule {
    let mut s = empty(total);
    let d = (g.rank + g.world - root) % g.world;
    if d > 0 {
        s.recvs = g.pieces(0..total, 1, d as u32 - 1, Apply::Copy);
    }
    if d + 1 < g.world {
        s.sends = g.pieces(0..total, 1, d as u32, Apply::Copy);
    }
    link(s)
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Fills in `after`: a piece waits for every piece of the other direction
/// from an earlier step that touches the same bytes (a send for the bytes it
/// needs to have arrived; a receive for the bytes still to be sent from the
/// old contents).
fn link(mut s: Schedule) -> Schedule {
    fn deps(mine: &mut [Piece], other: &[Piece]) {
        for p in mine.iter_mut() {
            p.after = other
                .iter()
                .rposition(|o| o.step < p.step && overlaps(&o.bytes, &p.bytes))
                .map_or(0, |i| i + 1);
            debug_assert!(!other
                .iter()
                .any(|o| o.step == p.step && overlaps(&o.bytes, &p.bytes)));
        }
    }
    let recvs = s.recvs.clone();
    deps(&mut s.sends, &recvs);
    let sends = s.sends.clone();
    deps(&mut s.recvs, &sends);
    s
}

#[cfg(test)]
mod tests {
    //! Runs the schedules of all ranks against each other in memory, picking
    //! the next enabled action at random: a missing `after` on a send shows
    //! up as a wrong result under some interleaving. (A receive's `after` is
    //! implied by causality in any ring, the simulated one included: it is
    //! there so that the two threads' memory accesses are provably disjoint.)
    use std::collections::VecDeque;

    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// A message in flight: step, byte range, payload.
    type Message = (u32, Range<usize>, Vec<u8>);

    /// Runs one schedule per rank over byte buffers; returns the buffers.
    fn simulate(scheds: &[Schedule], mut bufs: Vec<Vec<u8>>, seed: u64) -> Vec<Vec<u8>> {
        let n = scheds.len();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut sent = vec![0usize; n];
        let mut recvd = vec![0usize; n];
        // Channel r carries rank r's messages to rank r+1.
        let mut chans: Vec<VecDeque<Message>> = vec![VecDeque::new(); n];
        loop {
            let mut enabled = Vec::new();
            for r in 0..n {
                let s = &scheds[r];
                if let Some(p) = s.sends.get(sent[r]) {
                    if recvd[r] >= p.after {
                        enabled.push((r, true));
                    }
                }
                if let Some(p) = s.recvs.get(recvd[r]) {
                    let prev = (r + n - 1) % n;
                    if sent[r] >= p.after && !chans[prev].is_empty() {
                        enabled.push((r, false));
                    }
                }
            }
            if enabled.is_empty() {
                for r in 0..n {
                    assert_eq!(sent[r], scheds[r].sends.len(), "rank {r} stuck sending");
                    assert_eq!(recvd[r], scheds[r].recvs.len(), "rank {r} stuck receiving");
                }
                assert!(chans.iter().all(|c| c.is_empty()), "unread messages");
                return bufs;
            }
            let (r, send) = enabled[rng.random_range(0..enabled.len())];
            if send {
                let p = &scheds[r].sends[sent[r]];
                chans[r].push_back((p.step, p.bytes.clone(), bufs[r][p.bytes.clone()].to_vec()));
                sent[r] += 1;
            } else {
                let p = &scheds[r].recvs[recvd[r]];
                let (step, bytes, data) = chans[(r + n - 1) % n].pop_front().unwrap();
                assert_eq!(
                    (step, &bytes),
                    (p.step, &p.bytes),
                    "rank {r} got the wrong piece"
                );
                let dst = &mut bufs[r][bytes];
                match p.apply {
                    Apply::Copy => dst.copy_from_slice(&data),
                    Apply::SumF32 => {
                        for (d, s) in dst.chunks_exact_mut(4).zip(data.chunks_exact(4)) {
                            let v = f32::from_le_bytes(d.try_into().unwrap())
                                + f32::from_le_bytes(s.try_into().unwrap());
                            d.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
                recvd[r] += 1;
            }
        }
    }

    fn f32s(v: &[u8]) -> Vec<f32> {
        v.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Rank r's element i: small integers, so any summation order is exact.
    fn input(world: usize, len: usize) -> Vec<Vec<u8>> {
        (0..world)
            .map(|r| {
                (0..len)
                    .flat_map(|i| (((i * 7 + r * 13) % 101) as f32 - 50.0).to_le_bytes())
                    .collect()
            })
            .collect()
    }

    fn sums(inputs: &[Vec<u8>]) -> Vec<f32> {
        let all: Vec<Vec<f32>> = inputs.iter().map(|b| f32s(b)).collect();
        (0..all[0].len())
            .map(|i| all.iter().map(|v| v[i]).sum())
            .collect()
    }

    proptest! {
        #[test]
        fn all_reduce_sums_everywhere(world in 1usize..6, len in 0usize..40, chunk in 1usize..24, seed: u64) {
            let inputs = input(world, len);
            let want = sums(&inputs);
            let scheds: Vec<_> = (0..world)
                .map(|rank| all_reduce(Ring { world, rank, chunk_bytes: chunk }, len))
                .collect();
            for (r, out) in simulate(&scheds, inputs, seed).iter().enumerate() {
                prop_assert_eq!(&f32s(out), &want, "rank {}", r);
            }
        }

        #[test]
        fn reduce_scatter_then_all_gather(world in 1usize..6, len in 0usize..40, chunk in 1usize..24, seed: u64) {
            let inputs = input(world, len);
            let want = sums(&inputs);
            let g = |rank| Ring { world, rank, chunk_bytes: chunk };
            let rs: Vec<_> = (0..world).map(|r| reduce_scatter(g(r), len)).collect();
            let mid = simulate(&rs, inputs, seed);
            for (r, out) in mid.iter().enumerate() {
                let own = shard_range(len, world, r);
                prop_assert_eq!(&f32s(out)[own.clone()], &want[own], "rank {}", r);
            }
            let ag: Vec<_> = (0..world).map(|r| all_gather(g(r), len, 4)).collect();
            for (r, out) in simulate(&ag, mid, seed ^ 1).iter().enumerate() {
                prop_assert_eq!(&f32s(out), &want, "rank {}", r);
            }
        }

        #[test]
        fn broadcast_copies_root(world in 1usize..6, root_pick in 0usize..6, len in 0usize..40, chunk in 1usize..24, seed: u64) {
            let root = root_pick % world;
            let inputs: Vec<Vec<u8>> = (0..world).map(|r| vec![r as u8; len]).collect();
            let scheds: Vec<_> = (0..world)
                .map(|rank| broadcast(Ring { world, rank, chunk_bytes: chunk }, len, root))
                .collect();
            for out in simulate(&scheds, inputs, seed) {
                prop_assert_eq!(out, vec![root as u8; len]);
            }
        }
    }

    #[test]
    fn every_step_exchanges_a_message_even_when_empty() {
        let g = Ring {
            world: 3,
            rank: 1,
            chunk_bytes: 64,
        };
        let s = all_reduce(g, 0);
        assert_eq!(s.sends.len(), 4);
        assert_eq!(s.recvs.len(), 4);
        assert!(s.sends.iter().all(|p| p.bytes.is_empty()));
    }

    #[test]
    fn pieces_are_whole_elements_of_at_most_a_chunk() {
        let g = Ring {
            world: 2,
            rank: 0,
            chunk_bytes: 10,
        };
        let s = all_reduce(g, 9);
        for p in s.sends.iter().chain(&s.recvs) {
            assert!(p.bytes.len() <= 8 && p.bytes.len() % 4 == 0, "{p:?}");
        }
    }
}
