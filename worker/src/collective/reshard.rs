//! State sync between the members of a new generation (issue 6, "recovery
//! of model state"): members that hold the configured step's training state
//! in memory (the *holders*, each laid out as `prior` = rank of world at the
//! job's sharding level) hand it to the members that do not, and every
//! member ends with its own part under the new layout — over the
//! generation's [`Collective`], no disk involved.
//!
//! The state is a list of flat float32 buffers ([`FlatBuffer`]) plus a few
//! integer scalars (the optimizer's step count…). A buffer is either
//! replicated (every holder has all of it: ddp parameters and moments, the
//! zero2 parameters) or sharded by [`shard_range`] (zero2 moments, every
//! FSDP unit). Per buffer, in chunks of at most `chunk` elements:
//! - replicated: the first holder broadcasts the chunk;
//! - sharded: every rank starts from zeros, the one holder designated for
//!   each old shard (the lowest new rank whose prior is that shard) copies
//!   its elements in at their old offsets, an all-reduce (sum) makes the
//!   chunk whole on every rank, and each rank keeps its new shard. Exactly
//!   one rank contributes each element, so the sum is exact.
//!
//! Transient memory: one chunk (`chunk` f32 elements) per collective, plus
//! whatever the executor allocates for its new shards while the old ones
//! are still read (see the trainers' `sync_state`). Cost on the wire: a
//! broadcast or all-reduce of the whole state once.

use std::ops::Range;

use tch::{Kind, Tensor};

use super::{shard_range, Collective};

/// Default chunk: 16 Mi elements (64 MiB of f32) per collective call.
pub const DEFAULT_CHUNK: usize = 16 << 20;

/// One flat float32 buffer of a replica's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatBuffer {
    /// What it is, for error messages (`params`, `model.layers.0 exp_avg`).
    pub name: String,
    /// Elements of the whole buffer (identical on every rank).
    pub len: usize,
    /// Whether each rank holds only its [`shard_range`] of it.
    pub sharded: bool,
}

/// Who holds what in the new generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncPlan {
    /// Per rank of the new generation: the layout `(rank, world)` of the
    /// state it holds, or `None` when it holds none.
    pub priors: Vec<Option<(usize, usize)>>,
    /// Most elements per collective call (bounds the transient buffer).
    pub chunk: usize,
}

/// A state sync that cannot work (nothing to copy from, a missing shard).
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("state sync: no member of the new generation holds the state")]
    NoHolder,
    #[error(
        "state sync: holders disagree on the prior world size ({0:?}); resharding needs one layout"
    )]
    MixedWorlds(Vec<usize>),
    #[error("state sync: shard {shard} of {world} is held by no member of the new generation")]
    MissingShard { shard: usize, world: usize },
    #[error("state sync: the plan has {got} ranks, the collective {want}")]
    WorldMismatch { got: usize, want: usize },
    #[error("state sync of {buffer}: {source}")]
    Collective {
        buffer: String,
        #[source]
        source: super::CollectiveError,
    },
}

impl SyncPlan {
    /// The first holder (the broadcast root), or an error.
    pub fn root(&self) -> Result<usize, SyncError> {
        self.priors
            .iter()
            .position(Option::is_some)
            .ok_or(SyncError::NoHolder)
    }

    /// Checks that the holders cover every old shard of the sharded
    /// buffers (one prior world, each of its ranks held by someone).
    pub fn check_sharded(&self) -> Result<usize, SyncError> {
        let mut worlds: Vec<usize> = self.priors.iter().flatten().map(|p| p.1).collect();
        worlds.sort_unstable();
        worlds.dedup();
        match worlds.as_slice() {
            [] => Err(SyncError::NoHolder),
            [w] => {
                for shard in 0..*w {
                    if self.contributor(shard, *w).is_none() {
                        return Err(SyncError::MissingShard { shard, world: *w });
                    }
                }
                Ok(*w)
            }
            _ => Err(SyncError::MixedWorlds(worlds)),
        }
    }

    /// The new rank that contributes old shard `shard` of `world`.
    pub fn contributor(&self, shard: usize, world: usize) -> Option<usize> {
        self.priors.iter().position(|p| *p == Some((shard, world)))
    }
}

/// Where a rank's state lives: read from the held (old) layout, write into
/// the new one. Ranges are of the whole flat buffer.
pub trait StateAccess {
    /// Elements `range` of buffer `buf` as a flat f32 tensor; `range`
    /// lies inside what this rank holds (its old shard, or all of a
    /// replicated buffer).
    fn read(&mut self, buf: usize, range: Range<usize>) -> Tensor;
    /// Stores elements `range` of buffer `buf` (inside this rank's new
    /// shard, or anywhere in a replicated buffer); `values` lives on the
    /// collective's device.
    fn write(&mut self, buf: usize, range: Range<usize>, values: &Tensor);
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let (lo, hi) = (a.start.max(b.start), a.end.min(b.end));
    (lo < hi).then_some(lo..hi)
}

/// Runs the sync on this rank (every rank of `coll` calls it with the same
/// `plan`, `buffers` and scalar count): afterwards every element of this
/// rank's new part of every buffer has been written, and the scalars are
/// the first holder's. `scalars` is this rank's (read on the root,
/// overwritten everywhere).
pub fn sync(
    coll: &mut dyn Collective,
    plan: &SyncPlan,
    buffers: &[FlatBuffer],
    scalars: &mut [u64],
    state: &mut dyn StateAccess,
) -> Result<(), SyncError> {
    let (rank, world) = (coll.rank(), coll.world_size());
    if plan.priors.len() != world {
        return Err(SyncError::WorldMismatch {
            got: plan.priors.len(),
            want: world,
        });
    }
    let root = plan.root()?;
    let prior_world = if buffers.iter().any(|b| b.sharded) {
        Some(plan.check_sharded()?)
    } else {
        None
    };
    let mine = plan.priors[rank];
    let failed = |buffer: &str| {
        let buffer = buffer.to_string();
        move |source| SyncError::Collective { buffer, source }
    };
    let device = coll.device();
    // Scalars as 16-bit pieces in f32 (exact whatever the backend).
    let mut s = Tensor::from_slice(&encode(scalars)).to_device(device);
    coll.broadcast(&mut s, root).map_err(failed("scalars"))?;
    let got = Vec::<f32>::try_from(&s.to_device(tch::Device::Cpu)).unwrap_or_default();
    scalars.copy_from_slice(&decode(&got, scalars.len()));
    let chunk = plan.chunk.max(1);
    for (i, b) in buffers.iter().enumerate() {
        let new = if b.sharded {
            shard_range(b.len, world, rank)
        } else {
            0..b.len
        };
        let held = match (mine, b.sharded) {
            (Some(_), false) if rank == root => Some(0..b.len),
            (Some((r, w)), true) if plan.contributor(r, w) == Some(rank) => {
                debug_assert_eq!(Some(w), prior_world);
                Some(shard_range(b.len, w, r))
            }
            _ => None,
        };
        let mut start = 0;
        while start < b.len {
            let range = start..(start + chunk).min(b.len);
            start = range.end;
            let mut t = Tensor::zeros([range.len() as i64], (Kind::Float, device));
            if let Some(ov) = held.as_ref().and_then(|h| overlap(h, &range)) {
                let part = state.read(i, ov.clone()).to_device(device);
                t.narrow(0, (ov.start - range.start) as i64, ov.len() as i64)
                    .copy_(&part);
            }
            if b.sharded {
                coll.all_reduce_sum(&mut t).map_err(failed(&b.name))?;
            } else {
                coll.broadcast(&mut t, root).map_err(failed(&b.name))?;
            }
            if let Some(ov) = overlap(&new, &range) {
                let part = t.narrow(0, (ov.start - range.start) as i64, ov.len() as i64);
                state.write(i, ov, &part);
            }
        }
    }
    Ok(())
}

fn encode(v: &[u64]) -> Vec<f32> {
    v.iter()
        .flat_map(|x| (0..4).map(move |k| ((x >> (16 * k)) & 0xffff) as f32))
        .collect()
}

fn decode(v: &[f32], n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            (0..4).fold(0u64, |acc, k| {
                acc | ((v.get(4 * i + k).copied().unwrap_or(0.0) as u64) << (16 * k))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::local::LocalGroup;
    use super::*;

    #[test]
    fn scalars_round_trip_exactly() {
        let v = [0u64, 1, 65_535, 65_536, u64::MAX, 123_456_789_012_345];
        assert_eq!(decode(&encode(&v), v.len()), v);
    }

    #[test]
    fn plans_name_what_is_missing() {
        let p = SyncPlan {
            priors: vec![Some((0, 3)), None, Some((2, 3))],
            chunk: 4,
        };
        assert_eq!(p.root().unwrap(), 0);
        let e = p.check_sharded().unwrap_err();
        assert!(e.to_string().contains("shard 1 of 3"), "{e}");
        let none = SyncPlan {
            priors: vec![None, None],
            chunk: 4,
        };
        assert!(matches!(none.root(), Err(SyncError::NoHolder)));
        let mixed = SyncPlan {
            priors: vec![Some((0, 1)), Some((1, 2))],
            chunk: 4,
        };
        assert!(matches!(
            mixed.check_sharded(),
            Err(SyncError::MixedWorlds(_))
        ));
    }

    /// Rank state: old shards (by buffer), new shards written.
    struct Mem {
        old: Vec<(Range<usize>, Vec<f32>)>,
        new: Vec<Vec<Option<f32>>>,
    }

    impl StateAccess for Mem {
        fn read(&mut self, buf: usize, range: Range<usize>) -> Tensor {
            let (held, data) = &self.old[buf];
            assert!(
                held.start <= range.start && range.end <= held.end,
                "read outside"
            );
            Tensor::from_slice(&data[range.start - held.start..range.end - held.start])
        }
        fn write(&mut self, buf: usize, range: Range<usize>, values: &Tensor) {
            let v = Vec::<f32>::try_from(values).unwrap();
            for (i, x) in range.zip(v) {
                assert!(self.new[buf][i].replace(x).is_none(), "written twice");
            }
        }
    }

    /// `priors` → every rank ends with exactly its new part of
    /// `value(buf, i)`, for chunk sizes that cut shards anywhere.
    fn check(priors: Vec<Option<(usize, usize)>>, chunk: usize) {
        let buffers = vec![
            FlatBuffer {
                name: "replicated".into(),
                len: 23,
                sharded: false,
            },
            FlatBuffer {
                name: "sharded".into(),
                len: 17,
                sharded: true,
            },
        ];
        let value = |b: usize, i: usize| (b * 1000 + i) as f32 + 0.25;
        let world = priors.len();
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(rank, mut coll)| {
                let (priors, buffers) = (priors.clone(), buffers.clone());
                std::thread::spawn(move || {
                    let old = buffers
                        .iter()
                        .enumerate()
                        .map(|(b, f)| {
                            let held = match priors[rank] {
                                None => 0..0,
                                Some(_) if !f.sharded => 0..f.len,
                                Some((r, w)) => shard_range(f.len, w, r),
                            };
                            (held.clone(), held.map(|i| value(b, i)).collect())
                        })
                        .collect();
                    let mut mem = Mem {
                        old,
                        new: buffers.iter().map(|f| vec![None; f.len]).collect(),
                    };
                    let mut scalars = if priors[rank].is_some() {
                        vec![7u64, 1 << 40]
                    } else {
                        vec![0, 0]
                    };
                    let plan = SyncPlan { priors, chunk };
                    sync(&mut coll, &plan, &buffers, &mut scalars, &mut mem).unwrap();
                    (mem.new, scalars)
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let (new, scalars) = h.join().unwrap();
            assert_eq!(scalars, vec![7, 1 << 40]);
            for (b, f) in buffers.iter().enumerate() {
                let want = if f.sharded {
                    shard_range(f.len, world, rank)
                } else {
                    0..f.len
                };
                for (i, got) in new[b].iter().enumerate() {
                    if want.contains(&i) {
                        assert_eq!(
                            *got,
                            Some(value(b, i)),
                            "rank {rank} buffer {b} element {i}"
                        );
                    } else {
                        assert_eq!(*got, None, "rank {rank} wrote outside its shard");
                    }
                }
            }
        }
    }

    #[test]
    fn joiners_get_the_state_and_holders_reshard() {
        for chunk in [1, 5, 64] {
            // 2 → 3: a joiner; the holders' layout changes too.
            check(vec![Some((0, 2)), Some((1, 2)), None], chunk);
            // 3 → 3 with ranks permuted.
            check(vec![Some((2, 3)), Some((0, 3)), Some((1, 3))], chunk);
            // 1 → 2: a joiner beside the only holder.
            check(vec![Some((0, 1)), None], chunk);
        }
    }
}
