//! Device tensors over a host collective ([`Staged`]): the TCP ring reads
//! and writes host memory, so a CUDA rank of a generation that does not
//! run NCCL (a mixed CPU/GPU world, or `parallel.collective = "ring"`)
//! copies each operand into a host buffer, runs the ring on it and copies
//! the result back. The buffer is allocated once per generation, grown to
//! the largest operand, and page-locked (pinned) on a CUDA device so the
//! copies run at full PCIe bandwidth without an extra staging copy inside
//! the driver. Only what an operation reads or defines travels: a
//! reduce-scatter copies back only this rank's shard, an all-gather copies
//! down only this rank's shard, a broadcast copies down only on the root.
//!
//! The ring sees exactly the values the device held, so the results are
//! bit for bit those of the plain ring on host tensors (tested on CPU,
//! where the buffer is ordinary memory).

use tch::{Device, Kind, Tensor};

use super::{shard_range, AbortHandle, Collective, CollectiveError};

/// A host collective carrying one device's tensors.
pub struct Staged {
    inner: Box<dyn Collective>,
    device: Device,
    /// Reused host buffer (pinned for CUDA), at least as long as the
    /// largest operand so far.
    host: Option<Tensor>,
}

impl Staged {
    /// `inner` must take flat f32 CPU tensors (the TCP ring).
    pub fn new(inner: Box<dyn Collective>, device: Device) -> Staged {
        Staged {
            inner,
            device,
            host: None,
        }
    }

    /// Bytes of host memory held for staging.
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.numel() * 4)
    }

    fn check(&self, op: &'static str, t: &Tensor) -> Result<usize, CollectiveError> {
        let bad = |detail: String| CollectiveError::Invalid { op, detail };
        if t.kind() != Kind::Float || t.device() != self.device {
            return Err(bad(format!(
                "expected float32 on {:?}, got {:?} on {:?}",
                self.device,
                t.kind(),
                t.device()
            )));
        }
        if t.dim() != 1 || !t.is_contiguous() {
            return Err(bad(format!(
                "expected a flat contiguous tensor, got shape {:?}",
                t.size()
            )));
        }
        Ok(t.numel())
    }

    /// The first `n` elements of the staging buffer (grown if needed).
    fn buffer(&mut self, n: usize) -> Tensor {
        let fits = self.host.as_ref().is_some_and(|h| h.numel() >= n);
        if !fits {
            self.host = None;
            let plain = Tensor::empty([n as i64], (Kind::Float, Device::Cpu));
            self.host = Some(match self.device {
                Device::Cuda(_) => plain.pin_memory(self.device),
                _ => plain,
            });
        }
        let host = self.host.as_ref().expect("just sized");
        host.narrow(0, 0, n as i64)
    }

    /// Runs `f` on a host copy of the elements `down` of `t` (the rest of
    /// the buffer is unspecified), then copies the elements `up` back.
    fn stage(
        &mut self,
        op: &'static str,
        t: &mut Tensor,
        down: std::ops::Range<usize>,
        up: std::ops::Range<usize>,
        f: impl FnOnce(&mut dyn Collective, &mut Tensor) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let n = self.check(op, t)?;
        if n == 0 {
            return Ok(());
        }
        let mut host = self.buffer(n);
        let part =
            |x: &Tensor, r: &std::ops::Range<usize>| x.narrow(0, r.start as i64, r.len() as i64);
        tch::no_grad(|| {
            if !down.is_empty() {
                part(&host, &down).copy_(&part(t, &down));
            }
        });
        f(self.inner.as_mut(), &mut host)?;
        tch::no_grad(|| {
            if !up.is_empty() {
                part(t, &up).copy_(&part(&host, &up));
            }
        });
        Ok(())
    }
}

impl Collective for Staged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = t.numel();
        self.stage("all_reduce", t, 0..n, 0..n, |c, h| c.all_reduce_sum(h))
    }

    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = t.numel();
        let own = shard_range(n, self.world_size(), self.rank());
        self.stage("reduce_scatter", t, 0..n, own, |c, h| {
            c.reduce_scatter_sum(h)
        })
    }

    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = t.numel();
        let own = shard_range(n, self.world_size(), self.rank());
        self.stage("all_gather", t, own, 0..n, |c, h| c.all_gather(h))
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        let n = t.numel();
        let (down, up) = if self.rank() == root {
            (0..n, 0..0)
        } else {
            (0..0, 0..n)
        };
        self.stage("broadcast", t, down, up, |c, h| c.broadcast(h, root))
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.inner.barrier()
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        self.inner.abort_handle()
    }

    fn device(&self) -> Device {
        self.device
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::collective::tcp::{connect_cpu, test_link};

    /// Runs `ops` on every rank of a TCP ring, plain and staged, on the same
    /// inputs; returns (plain, staged) bits per rank.
    fn run(world: usize, len: i64, staged: bool) -> Vec<Vec<u32>> {
        let (ls, peers) = crate::collective::loopback_peers(world);
        let handles: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let peers = peers.clone();
                std::thread::spawn(move || {
                    let ring = connect_cpu(
                        &l,
                        rank,
                        world,
                        &peers,
                        1,
                        Duration::from_secs(30),
                        test_link(),
                    )
                    .unwrap();
                    let mut c: Box<dyn Collective> = if staged {
                        Box::new(Staged::new(Box::new(ring), Device::Cpu))
                    } else {
                        Box::new(ring)
                    };
                    // Arbitrary floats: any reassociation would change bits.
                    let i = Tensor::arange(len, (Kind::Double, Device::Cpu));
                    let input = ((&i * (0.37 + rank as f64)).sin() * 3.1).to_kind(Kind::Float);
                    let mut out = Vec::new();
                    let mut t = input.copy();
                    c.all_reduce_sum(&mut t).unwrap();
                    out.push(t);
                    // A shorter operand after a longer one: stale buffer contents.
                    let mut t = input.narrow(0, 0, len / 2 + 1).copy();
                    c.reduce_scatter_sum(&mut t).unwrap();
                    let own = shard_range(t.numel(), world, rank);
                    out.push(t.narrow(0, own.start as i64, own.len() as i64));
                    let mut t = input.copy();
                    c.reduce_scatter_sum(&mut t).unwrap();
                    c.all_gather(&mut t).unwrap();
                    out.push(t);
                    let mut t = input.copy();
                    c.broadcast(&mut t, world - 1).unwrap();
                    c.barrier().unwrap();
                    out.push(t);
                    let flat = Tensor::cat(&out, 0);
                    Vec::<f32>::try_from(&flat)
                        .unwrap()
                        .into_iter()
                        .map(f32::to_bits)
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn staged_ring_equals_the_plain_ring_bit_for_bit() {
        for world in [2, 3] {
            for len in [1, 7, 10_001] {
                assert_eq!(
                    run(world, len, false),
                    run(world, len, true),
                    "world {world} len {len}"
                );
            }
        }
    }

    #[test]
    fn a_tensor_on_another_device_is_refused() {
        let mut s = Staged::new(Box::new(crate::collective::Solo), Device::Cuda(0));
        let mut t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let e = s.all_reduce_sum(&mut t).unwrap_err();
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
    }
}
