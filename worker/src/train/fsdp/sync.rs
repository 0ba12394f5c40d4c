//! State sync of the FSDP trainer (issue 6): every unit's parameter shard
//! and its two AdamW moment shards are flat buffers sharded by
//! [`shard_range`] over the unit, resharded unit by unit through
//! [`reshard::sync`] (all-reduce of zeros plus the old owner's elements,
//! in bounded chunks). The new shards are allocated beside the old ones and
//! swapped in at the end: a holder transiently holds both layouts
//! (3·N/W_old + 3·N/W_new f32) plus one chunk.

use std::ops::Range;

use tch::{Kind, Tensor};

use super::FsdpTrainer;
use crate::collective::reshard::{self, FlatBuffer, StateAccess, SyncPlan};
use crate::collective::{shard_range, Collective, Solo};
use crate::train::trainer::swap_collective;
use crate::train::trainer::Membership;

struct Access<'a> {
    /// Per buffer (unit u: 3u params, 3u+1 exp_avg, 3u+2 exp_avg_sq): the
    /// old shard and its range.
    old: Vec<(&'a Tensor, Range<usize>)>,
    /// Per buffer: the new shard and its range.
    new: Vec<(Tensor, Range<usize>)>,
}

impl StateAccess for Access<'_> {
    fn read(&mut self, buf: usize, range: Range<usize>) -> Tensor {
        let (t, held) = &self.old[buf];
        // A frozen unit's shard is in the compute dtype; the sync moves f32.
        t.narrow(0, (range.start - held.start) as i64, range.len() as i64)
            .to_kind(Kind::Float)
    }

    fn write(&mut self, buf: usize, range: Range<usize>, values: &Tensor) {
        let (t, mine) = &mut self.new[buf];
        t.narrow(0, (range.start - mine.start) as i64, range.len() as i64)
            .copy_(values);
    }
}

impl Membership for FsdpTrainer {
    fn group(&mut self) -> &mut dyn Collective {
        self.coll.as_mut()
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        let fits = self.fits(coll.rank(), coll.world_size());
        swap_collective(&mut self.coll, coll, fits, "fsdp shards")
    }

    fn set_context(&mut self, group: Option<Box<dyn Collective>>) -> anyhow::Result<()> {
        self.context = group
            .filter(|g| g.world_size() > 1)
            .map(|g| std::sync::Arc::new(std::sync::Mutex::new(g)));
        Ok(())
    }

    /// Every shard belongs to one (rank, world).
    fn state_layout(&self) -> Option<(usize, usize)> {
        Some((self.rank(), self.world_size()))
    }

    /// Shards belong to one (rank, world): anything else is rebuilt.
    fn fits(&self, rank: usize, world: usize) -> bool {
        (rank, world) == (self.rank(), self.world_size())
    }

    /// Joins a new generation taking the training state from the members
    /// that hold it (see `Membership::sync_state`): `coll` is the new
    /// generation's collective, or `None` when this trainer was just built
    /// with it (a member without state). Every rank of the new collective
    /// calls it with the same `plan`; gradients are zeroed.
    fn sync_state(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        let (old_rank, old_world) = (self.rank(), self.world_size());
        let mut coll = coll.unwrap_or_else(|| std::mem::replace(&mut self.coll, Box::new(Solo)));
        let (rank, world) = (coll.rank(), coll.world_size());
        let mut buffers = Vec::with_capacity(3 * self.layouts.len());
        let mut old = Vec::with_capacity(buffers.capacity());
        let mut new = Vec::with_capacity(buffers.capacity());
        for (u, l) in self.layouts.iter().enumerate() {
            let held = shard_range(l.numel, old_world, old_rank);
            let mine = shard_range(l.numel, world, rank);
            let mut parts = vec![("params", &self.params[u])];
            // A frozen unit (a LoRA job's base) has no moments.
            if self.trains(u) {
                parts.push(("exp_avg", &self.opt.exp_avg[u]));
                parts.push(("exp_avg_sq", &self.opt.exp_avg_sq[u]));
            }
            for (what, t) in parts {
                buffers.push(FlatBuffer {
                    name: format!("{} {what}", l.name),
                    len: l.numel,
                    sharded: true,
                });
                old.push((t, held.clone()));
                let fresh = Tensor::zeros([mine.len() as i64], (t.kind(), self.device));
                new.push((fresh, mine.clone()));
            }
        }
        let mut scalars = [self.opt.step];
        let mut access = Access { old, new };
        let synced = reshard::sync(coll.as_mut(), plan, &buffers, &mut scalars, &mut access);
        let Access { old, new } = access;
        drop(old);
        let mut fresh = new.into_iter().map(|(t, _)| t);
        self.coll = coll;
        synced?;
        for u in 0..self.layouts.len() {
            let Some(p) = fresh.next() else {
                anyhow::bail!("fsdp state sync: missing new shards of unit {u}");
            };
            if !self.trains(u) {
                self.params[u] = p;
                continue;
            }
            let (Some(m), Some(v)) = (fresh.next(), fresh.next()) else {
                anyhow::bail!("fsdp state sync: missing new moments of unit {u}");
            };
            self.grads[u] = Tensor::zeros_like(&p);
            self.params[u] = p;
            self.opt.exp_avg[u] = m;
            self.opt.exp_avg_sq[u] = v;
            self.segments[u] = self.layouts[u].segments(world, rank, &self.no_decay);
        }
        self.opt.step = scalars[0];
        Ok(())
    }
}
