//! The CPU backend between worker processes: [`CpuRing`] adapts the
//! `accrue-collective` TCP ring to the [`Collective`] trait over flat f32 CPU
//! tensors. Peers' addresses come from the coordinator's configure message;
//! the listener is bound once per worker process and reused by every
//! generation.
//!
//! Summation order: each element is summed once, at the rank owning its
//! segment, in ring order starting after that rank; every rank gets the same
//! bits, which equal [`super::local::LocalGroup`]'s rank-order sums up to
//! float rounding (exactly, when the sums are exact).

use std::net::TcpListener;
use std::time::Duration;

use accrue_collective::{LinkKey, RingConfig, TcpRing};
use tch::Tensor;

use super::{as_f32_slice_mut, check_flat_f32_cpu, Collective, CollectiveError};

/// One rank of a generation's CPU ring.
#[derive(Debug)]
pub struct CpuRing {
    ring: TcpRing,
}

/// Forms the ring of generation `generation` (see [`TcpRing::connect`]):
/// `peers` are the collective addresses of every rank, by rank, and
/// `timeout` bounds the connection and every later operation, and `link`
/// (from the Configure) admits only the generation's members.
pub fn connect_cpu(
    listener: &TcpListener,
    rank: usize,
    world: usize,
    peers: &[String],
    generation: u64,
    timeout: Duration,
    link: LinkKey,
) -> Result<CpuRing, CollectiveError> {
    let cfg = RingConfig {
        rank,
        world,
        peers: peers.to_vec(),
        generation,
        timeout,
        link,
    };
    let ring = TcpRing::connect(listener, cfg)?;
    Ok(CpuRing { ring })
}

/// The link key the tests' rings share (every rank of a test ring must
/// hold the same one, as a generation's members do).
#[cfg(test)]
pub fn test_link() -> LinkKey {
    LinkKey::new(&[7u8; 32], false).expect("32 bytes")
}

impl CpuRing {
    /// The underlying ring (e.g. for `broadcast_bytes` of an NCCL id).
    pub fn ring_mut(&mut self) -> &mut TcpRing {
        &mut self.ring
    }

    fn with_slice(
        &mut self,
        op: &'static str,
        t: &mut Tensor,
        f: impl FnOnce(&mut TcpRing, &mut [f32]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        check_flat_f32_cpu(op, t)?;
        // SAFETY: checked flat contiguous f32 on the CPU; `t` is borrowed
        // mutably for the whole call, so nothing else touches its storage.
        let s = unsafe { as_f32_slice_mut(t) };
        f(&mut self.ring, s)
    }
}

impl Collective for CpuRing {
    fn rank(&self) -> usize {
        self.ring.rank()
    }

    fn world_size(&self) -> usize {
        self.ring.world_size()
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        self.with_slice("all_reduce", t, |r, s| r.all_reduce_sum(s))
    }

    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        self.with_slice("reduce_scatter", t, |r, s| r.reduce_scatter_sum(s))
    }

    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        self.with_slice("all_gather", t, |r, s| r.all_gather(s))
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        self.with_slice("broadcast", t, |r, s| r.broadcast(s, root))
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.ring.barrier()
    }

    fn abort_handle(&self) -> Option<super::AbortHandle> {
        let h = self.ring.abort_handle().ok()?;
        Some(std::sync::Arc::new(move || h.abort()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalGroup;
    use super::*;
    use tch::{Device, Kind};

    /// Runs `f` on each rank of a CPU ring and of a local group, on the same
    /// random inputs; returns (ring outputs, local outputs) by rank.
    fn both(
        world: usize,
        len: i64,
        quantize: bool,
        f: fn(&mut dyn Collective, &mut Tensor),
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        // Deterministic per rank without the process-global generator
        // (tests run in parallel threads).
        let input = move |rank: usize| {
            let i = Tensor::arange(len, (Kind::Double, Device::Cpu));
            let t = ((&i * (0.7 + rank as f64) + 0.3).sin() * 4.0).to_kind(Kind::Float);
            // Multiples of 1/1024 in [-8, 8]: every order of summation is exact.
            if quantize {
                (t.clamp(-8.0, 8.0) * 1024.0).round() / 1024.0
            } else {
                t
            }
        };
        let (ls, peers) = crate::collective::loopback_peers(world);
        let ring: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let peers = peers.clone();
                std::thread::spawn(move || {
                    let timeout = Duration::from_secs(30);
                    let mut c =
                        connect_cpu(&l, rank, world, &peers, 1, timeout, test_link()).unwrap();
                    let mut t = input(rank);
                    f(&mut c, &mut t);
                    Vec::<f32>::try_from(&t).unwrap()
                })
            })
            .collect();
        let local: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(rank, mut c)| {
                std::thread::spawn(move || {
                    let mut t = input(rank);
                    f(&mut c, &mut t);
                    Vec::<f32>::try_from(&t).unwrap()
                })
            })
            .collect();
        let join = |v: Vec<std::thread::JoinHandle<Vec<f32>>>| -> Vec<Vec<f32>> {
            v.into_iter().map(|h| h.join().unwrap()).collect()
        };
        (join(ring), join(local))
    }

    #[test]
    fn cpu_ring_matches_local_group_on_random_tensors() {
        let ops: [fn(&mut dyn Collective, &mut Tensor); 3] = [
            |c, t| c.all_reduce_sum(t).unwrap(),
            |c, t| {
                c.reduce_scatter_sum(t).unwrap();
                c.all_gather(t).unwrap();
            },
            |c, t| {
                c.broadcast(t, c.world_size() - 1).unwrap();
                c.barrier().unwrap();
            },
        ];
        for world in [2, 3, 4] {
            for len in [1, 5, 1001, 300_007] {
                for (i, op) in ops.iter().enumerate() {
                    // Exact inputs: bit-identical to the rank-order sums.
                    let (ring, local) = both(world, len, true, *op);
                    assert_eq!(ring, local, "op {i} world {world} len {len}");
                    // Arbitrary inputs: equal up to rounding, same on every rank.
                    let (ring, local) = both(world, len, false, *op);
                    for (r, l) in ring.iter().zip(&local) {
                        for (a, b) in r.iter().zip(l) {
                            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
                        }
                        assert_eq!(r, &ring[0], "op {i}: ranks differ");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_tensors_and_bad_setups_are_refused() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peers = vec![l.local_addr().unwrap().to_string()];
        let mut c = connect_cpu(&l, 0, 1, &peers, 1, Duration::from_secs(1), test_link()).unwrap();
        let mut t = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let e = c.all_reduce_sum(&mut t).unwrap_err();
        assert!(
            matches!(
                e,
                CollectiveError::Invalid {
                    op: "all_reduce",
                    ..
                }
            ),
            "{e}"
        );
        let e = connect_cpu(&l, 3, 2, &peers, 1, Duration::from_secs(1), test_link()).unwrap_err();
        assert!(matches!(e, CollectiveError::Setup(_)), "{e}");
    }
}
