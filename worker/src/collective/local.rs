//! Ranks as threads of one process: each operation deposits every rank's
//! tensor in a shared slot table, waits for all, and computes the result
//! (sums in rank order, so every rank gets bit-identical values). Used by
//! tests of the sharded trainers and as the reference the network backends
//! are checked against.

use std::sync::{Arc, Barrier, Mutex};

use tch::Tensor;

use super::{shard_range, Collective, CollectiveError};

struct Shared {
    barrier: Barrier,
    /// Per rank: (operation, sequence number, length, data).
    slots: Mutex<Slots>,
}

/// One rank of an in-process group (move it to that rank's thread).
pub struct LocalRank {
    rank: usize,
    world: usize,
    seq: u64,
    shared: Arc<Shared>,
}

/// Builds the ranks of an in-process group of `world` threads.
pub struct LocalGroup;

impl LocalGroup {
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<LocalRank> {
        assert!(world > 0);
        let shared = Arc::new(Shared {
            barrier: Barrier::new(world),
            slots: Mutex::new((0..world).map(|_| None).collect()),
        });
        (0..world)
            .map(|rank| LocalRank {
                rank,
                world,
                seq: 0,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl LocalRank {
    /// Deposits `t`, waits for every rank, and hands `f` all ranks' tensors
    /// (in rank order) after checking they called the same operation.
    fn exchange<R>(
        &mut self,
        op: &'static str,
        t: &Tensor,
        f: impl FnOnce(&[&Tensor]) -> R,
    ) -> Result<R, CollectiveError> {
        self.seq += 1;
        lock(&self.shared.slots)[self.rank] = Some((op, self.seq, t.numel(), t.detach().copy()));
        self.shared.barrier.wait();
        let result = {
            let slots = lock(&self.shared.slots);
            let mut all = Vec::with_capacity(self.world);
            let mut mismatch = None;
            for (peer, slot) in slots.iter().enumerate() {
                let (pop, pseq, plen, data) = slot.as_ref().expect("every rank deposited");
                if (*pop, *pseq, *plen) != (op, self.seq, t.numel()) && mismatch.is_none() {
                    mismatch = Some(CollectiveError::Mismatch {
                        op,
                        peer,
                        expected: format!("{op} #{} of {} elements", self.seq, t.numel()),
                        got: format!("{pop} #{pseq} of {plen} elements"),
                    });
                }
                all.push(data);
            }
            match mismatch {
                Some(e) => Err(e),
                None => Ok(f(&all)),
            }
        };
        // Nobody overwrites a slot before every rank has read them all.
        self.shared.barrier.wait();
        result
    }
}

type Slots = Vec<Option<(&'static str, u64, usize, Tensor)>>;

fn lock(m: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ordered_sum(all: &[&Tensor]) -> Tensor {
    let mut acc = all[0].copy();
    for t in &all[1..] {
        acc += *t;
    }
    acc
}

impl Collective for LocalRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let sum = self.exchange("all_reduce", t, ordered_sum)?;
        t.copy_(&sum);
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let r = shard_range(t.numel(), self.world, self.rank);
        let sum = self.exchange("reduce_scatter", t, |all| {
            let parts: Vec<Tensor> = all
                .iter()
                .map(|x| x.narrow(0, r.start as i64, r.len() as i64))
                .collect();
            ordered_sum(&parts.iter().collect::<Vec<_>>())
        })?;
        t.narrow(0, r.start as i64, r.len() as i64).copy_(&sum);
        Ok(())
    }

    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let (len, world) = (t.numel(), self.world);
        let full = self.exchange("all_gather", t, |all| {
            let parts: Vec<Tensor> = (0..world)
                .map(|k| {
                    let r = shard_range(len, world, k);
                    all[k].narrow(0, r.start as i64, r.len() as i64)
                })
                .collect();
            Tensor::cat(&parts, 0)
        })?;
        t.copy_(&full);
        Ok(())
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(CollectiveError::Invalid {
                op: "broadcast",
                detail: format!("root {root} outside world {}", self.world),
            });
        }
        let v = self.exchange("broadcast", t, |all| all[root].copy())?;
        t.copy_(&v);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let empty = Tensor::zeros([0], (tch::Kind::Float, tch::Device::Cpu));
        self.exchange("barrier", &empty, |_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn run(world: usize, len: i64, f: fn(&mut LocalRank, &mut Tensor)) -> Vec<Vec<f32>> {
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|mut r| {
                std::thread::spawn(move || {
                    let base = (r.rank() as f64 + 1.0) * 1000.0;
                    let mut t = Tensor::arange(len, (Kind::Float, tch::Device::Cpu)) + base;
                    f(&mut r, &mut t);
                    Vec::<f32>::try_from(&t).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_over_ranks() {
        let out = run(3, 5, |r, t| r.all_reduce_sum(t).unwrap());
        for v in &out {
            let want: Vec<f32> = (0..5).map(|i| 6000.0 + 3.0 * i as f32).collect();
            assert_eq!(v, &want);
        }
    }

    #[test]
    fn reduce_scatter_then_all_gather_is_all_reduce() {
        let out = run(3, 7, |r, t| {
            r.reduce_scatter_sum(t).unwrap();
            r.all_gather(t).unwrap();
        });
        let want: Vec<f32> = (0..7).map(|i| 6000.0 + 3.0 * i as f32).collect();
        for v in &out {
            assert_eq!(v, &want);
        }
    }

    #[test]
    fn broadcast_copies_root() {
        let out = run(2, 3, |r, t| r.broadcast(t, 1).unwrap());
        for v in &out {
            assert_eq!(v, &vec![2000.0, 2001.0, 2002.0]);
        }
    }

    #[test]
    fn diverging_ranks_fail_loudly() {
        let out = std::panic::catch_unwind(|| {
            run(2, 3, |r, t| {
                let res = if r.rank() == 0 {
                    r.all_reduce_sum(t)
                } else {
                    r.all_gather(t)
                };
                assert!(matches!(res, Err(CollectiveError::Mismatch { .. })));
            })
        });
        assert!(out.is_ok());
    }
}
