//! How a flat buffer is split among ranks: the layout the trainers,
//! reduce-scatter and all-gather agree on.

use std::ops::Range;

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
