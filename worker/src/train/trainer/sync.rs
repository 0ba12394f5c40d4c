//! State sync of the data-parallel trainer (issue 6): the replica as flat
//! buffers for [`reshard::sync`] — the parameters (replicated at ddp and
//! zero2) and the AdamW moments (replicated at ddp, sharded by
//! [`shard_range`] of the flat layout at zero2) — plus the optimizer's step
//! count and whether the weights are still the initial ones.
//!
//! Parameters and ddp moments are written in place (holders rewrite the
//! values they hold); zero2 moment shards for the new layout are allocated
//! beside the old ones and swapped in at the end, so a holder transiently
//! holds both (2 × 2·N/W f32) plus one chunk.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{Sharding, Trainer};
use crate::collective::reshard::{self, FlatBuffer, StateAccess, SyncPlan};
use crate::collective::{shard_range, Collective, Solo};
use crate::train::flat::FlatLayout;
use crate::train::Engine;

struct Access<'a> {
    layout: &'a FlatLayout,
    params: &'a [Tensor],
    /// ddp: per parameter (read and written in place); zero2: the old
    /// shard (read only).
    avg: [&'a [Tensor]; 2],
    sharding: Sharding,
    old: Range<usize>,
    new: Range<usize>,
    /// zero2: the new moment shards.
    new_avg: [Tensor; 2],
}

impl Access<'_> {
    /// Writes `values` (the elements `range` of the flat layout) into
    /// per-parameter tensors.
    fn scatter(&self, dst: &[Tensor], range: Range<usize>, values: &Tensor) {
        tch::no_grad(|| {
            for (i, within) in self.layout.pieces(range.clone()) {
                let at = self.layout.offsets[i] + within.start - range.start;
                let src = values.narrow(0, at as i64, within.len() as i64);
                dst[i]
                    .detach()
                    .view([-1])
                    .narrow(0, within.start as i64, within.len() as i64)
                    .copy_(&src);
            }
        });
    }
}

impl StateAccess for Access<'_> {
    fn read(&mut self, buf: usize, range: Range<usize>) -> Tensor {
        // On the model's device; `reshard::sync` moves it where the
        // collective needs it.
        let device = self.params.first().map_or(Device::Cpu, Tensor::device);
        match (buf, self.sharding) {
            (0, _) => self.layout.slice(self.params, range, device),
            (m, Sharding::Ddp) => self.layout.slice(self.avg[m - 1], range, device),
            (m, Sharding::Zero2) => self.avg[m - 1][0].narrow(
                0,
                (range.start - self.old.start) as i64,
                range.len() as i64,
            ),
        }
    }

    fn write(&mut self, buf: usize, range: Range<usize>, values: &Tensor) {
        match (buf, self.sharding) {
            (0, _) => self.scatter(self.params, range, values),
            (m, Sharding::Ddp) => self.scatter(self.avg[m - 1], range, values),
            (m, Sharding::Zero2) => tch::no_grad(|| {
                self.new_avg[m - 1]
                    .narrow(0, (range.start - self.new.start) as i64, range.len() as i64)
                    .copy_(values)
            }),
        }
    }
}

impl Trainer {
    /// Joins a new generation taking the training state from the members
    /// that hold it (issue 6, state sync; see [`reshard`]): `coll` is the
    /// new generation's collective, or `None` when this trainer was just
    /// built with it (a member without state). A holder's state is laid
    /// out as its current collective says (the runner checks that against
    /// the coordinator's `prior`). Every rank of `coll` must call it with
    /// the same `plan`. Gradients are zeroed.
    pub(super) fn sync_with(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        let old = self.shard();
        let mut coll = coll.unwrap_or_else(|| std::mem::replace(&mut self.coll, Box::new(Solo)));
        let (rank, world) = (coll.rank(), coll.world_size());
        let total = self.layout.total;
        let new = shard_range(total, world, rank);
        let device = self.model.vs.device();
        let zero2 = self.sharding == Sharding::Zero2;
        let buffers: Vec<FlatBuffer> = ["params", "exp_avg", "exp_avg_sq"]
            .iter()
            .enumerate()
            .map(|(i, n)| FlatBuffer {
                name: (*n).into(),
                len: total,
                sharded: zero2 && i > 0,
            })
            .collect();
        let new_len = new.len() as i64;
        let fresh = || {
            if zero2 {
                Tensor::zeros([new_len], (Kind::Float, device))
            } else {
                Tensor::new()
            }
        };
        let mut scalars = [self.opt.step, u64::from(self.pristine)];
        let mut access = Access {
            layout: &self.layout,
            params: &self.params,
            avg: [&self.opt.exp_avg, &self.opt.exp_avg_sq],
            sharding: self.sharding,
            old,
            new,
            new_avg: [fresh(), fresh()],
        };
        let synced = reshard::sync(coll.as_mut(), plan, &buffers, &mut scalars, &mut access);
        let [avg, avg_sq] = access.new_avg;
        self.coll = coll;
        synced?;
        if zero2 {
            self.opt.exp_avg = vec![avg];
            self.opt.exp_avg_sq = vec![avg_sq];
        }
        self.opt.step = scalars[0];
        self.pristine = scalars[1] != 0;
        self.zero_grad();
        Ok(())
    }
}
