//! Collectives between the worker processes of one generation (DESIGN.md
//! "Ranks and collectives"): a bandwidth-optimal ring over TCP, pure Rust,
//! no libtorch, so the worker (CPU training), the coordinator's benchmark and
//! the NCCL bootstrap all share it.
//!
//! - [`shard_range`]: how a flat buffer is split among ranks (the layout the
//!   trainers, reduce-scatter and all-gather agree on).
//! - [`plan`]: the ring schedules as data (which byte ranges each rank sends
//!   and receives at each step, and what each piece waits for), with no I/O.
//! - [`TcpRing`]: runs those schedules over two TCP connections per rank
//!   (to the next rank, from the previous one) with a sender thread so that
//!   sending and receiving overlap, per-message generation/sequence checks,
//!   and a deadline on every operation.
//!
//! The algorithm is the ring all-reduce of Patarasuk & Yuan, "Bandwidth
//! optimal all-reduce algorithms for clusters of workstations" (2009), as
//! used by Horovod and NCCL's ring: reduce-scatter then all-gather, each
//! rank sending 2·(n−1)/n of the buffer in total.

mod config;
mod connect;
mod error;
pub mod plan;
mod ring;
mod wire;

use std::ops::Range;

pub use config::RingConfig;
pub use error::{RingError, RingResult};
pub use ring::{RingAbort, TcpRing};
pub use wire::Op;

/// The elements of a flat buffer of `len` elements owned by `rank` of
/// `world`: contiguous, in rank order, the first `len % world` ranks one
/// element longer.
pub fn shard_range(len: usize, world: usize, rank: usize) -> Range<usize> {
    assert!(world > 0 && rank < world, "rank {rank} of world {world}");
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let end = start + base + usize::from(rank < extra);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_in_order() {
        for len in [0usize, 1, 2, 7, 64, 1001] {
            for world in 1..=5 {
                let mut next = 0;
                for rank in 0..world {
                    let r = shard_range(len, world, rank);
                    assert_eq!(r.start, next, "len {len} world {world} rank {rank}");
                    assert!(r.len() == len / world || r.len() == len / world + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
