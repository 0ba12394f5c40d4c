//! Bytes over a [`Collective`]: the collectives move flat float32 tensors,
//! and an all-gather only copies, so bytes travel as the bits of f32 words
//! (reinterpreted, never converted: NaN patterns arrive as sent). Used to
//! gather every rank's step result onto rank 0 (issue 19: one result
//! message a step instead of one per rank).

use tch::{Kind, Tensor};

use super::{Collective, CollectiveError};

/// Lengths travel as f32 values: exact below 2^24.
const MAX_LEN: usize = 1 << 24;

/// Every rank's `mine`, in rank order, on every rank: an all-gather of the
/// lengths, then one of the bytes in equal slots (the longest, rounded up
/// to whole words). Every rank must call it at the same point.
pub fn all_gather_bytes(
    coll: &mut dyn Collective,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, CollectiveError> {
    let (rank, world) = (coll.rank(), coll.world_size());
    if world == 1 {
        return Ok(vec![mine.to_vec()]);
    }
    if mine.len() >= MAX_LEN {
        return Err(CollectiveError::Invalid {
            op: "all_gather_bytes",
            detail: format!("{} bytes, at most {} travel", mine.len(), MAX_LEN - 1),
        });
    }
    let device = coll.device();
    let mut lens = vec![0f32; world];
    lens[rank] = mine.len() as f32;
    let mut t = Tensor::from_slice(&lens).to_device(device);
    coll.all_gather(&mut t)?;
    let lens: Vec<usize> = Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu))
        .map_err(|e| bad(format!("reading the lengths: {e}")))?
        .into_iter()
        .map(|l| l as usize)
        .collect();
    let slot = lens.iter().copied().max().unwrap_or(0).div_ceil(4) * 4;
    if slot == 0 {
        return Ok(vec![Vec::new(); world]);
    }
    let mut buf = vec![0u8; world * slot];
    buf[rank * slot..rank * slot + mine.len()].copy_from_slice(mine);
    let mut t = Tensor::from_slice(&buf)
        .view_dtype(Kind::Float)
        .to_device(device);
    coll.all_gather(&mut t)?;
    let all = Vec::<u8>::try_from(&t.to_device(tch::Device::Cpu).view_dtype(Kind::Uint8))
        .map_err(|e| bad(format!("reading the bytes: {e}")))?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &len)| all[r * slot..r * slot + len.min(slot)].to_vec())
        .collect())
}

fn bad(detail: String) -> CollectiveError {
    CollectiveError::Invalid {
        op: "all_gather_bytes",
        detail,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::collective::local::LocalGroup;
    use crate::collective::tcp::{connect_cpu, test_link};

    /// What rank `r` contributes: lengths 0, 1, 5, 8 and 1003 bytes, with
    /// the bits of a signalling NaN among them.
    fn payload(r: usize) -> Vec<u8> {
        let len = [0, 1, 5, 8, 1003][r % 5];
        let mut v: Vec<u8> = (0..len).map(|i| (i * 31 + r * 7) as u8).collect();
        if len >= 8 {
            v[4..8].copy_from_slice(&0x7f80_0001u32.to_le_bytes());
        }
        v
    }

    #[test]
    fn every_rank_gets_every_ranks_bytes_exactly_over_the_ring_and_in_process() {
        for world in [2, 5] {
            let want: Vec<Vec<u8>> = (0..world).map(payload).collect();
            let local: Vec<_> = LocalGroup::new(world)
                .into_iter()
                .enumerate()
                .map(|(r, mut c)| std::thread::spawn(move || all_gather_bytes(&mut c, &payload(r))))
                .collect();
            for h in local {
                assert_eq!(h.join().unwrap().unwrap(), want, "local, world {world}");
            }
            let (ls, peers) = crate::collective::loopback_peers(world);
            let ring: Vec<_> = ls
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let peers = peers.clone();
                    std::thread::spawn(move || {
                        let t = Duration::from_secs(30);
                        let mut c = connect_cpu(&l, r, world, &peers, 1, t, test_link()).unwrap();
                        // Twice: the second call reuses the ring in order.
                        let first = all_gather_bytes(&mut c, &payload(r)).unwrap();
                        let second = all_gather_bytes(&mut c, &payload(r + 1)).unwrap();
                        (first, second)
                    })
                })
                .collect();
            let next: Vec<Vec<u8>> = (0..world).map(|r| payload(r + 1)).collect();
            for h in ring {
                let (first, second) = h.join().unwrap();
                assert_eq!(first, want, "ring, world {world}");
                assert_eq!(second, next, "ring, world {world}, second call");
            }
        }
    }

    #[test]
    fn all_empty_and_single_rank_gathers_need_no_data_round() {
        let handles: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|mut c| std::thread::spawn(move || all_gather_bytes(&mut c, &[])))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), vec![Vec::<u8>::new(); 3]);
        }
        let mut solo = crate::collective::Solo;
        assert_eq!(
            all_gather_bytes(&mut solo, b"abc").unwrap(),
            vec![b"abc".to_vec()]
        );
    }
}
