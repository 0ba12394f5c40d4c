//! State sync of the data-parallel trainer (issue 6): the replica as flat
//! buffers for [`reshard::sync`] — the master parameters (replicated at ddp
//! and zero2) and the AdamW moments (replicated at ddp, sharded by
//! [`shard_range`] of the flat layout at zero2) — plus the optimizer's step
//! count and whether the weights are still the initial ones. All three
//! already live in the flat layout, so ranges are read and written as
//! slices of them.
//!
//! Parameters and ddp moments are written in place (holders rewrite the
//! values they hold); zero2 moment shards for the new layout are allocated
//! beside the old ones and swapped in at the end, so a holder transiently
//! holds both (2 × 2·N/W f32) plus one chunk.

use std::ops::Range;

use tch::{Kind, Tensor};

use super::grads::Grads;
use super::{ReplicatedTrainer, Sharding};
use crate::collective::reshard::{self, FlatBuffer, StateAccess, SyncPlan};
use crate::collective::{shard_range, Collective, Solo};
use crate::train::trainer::swap_collective;
use crate::train::trainer::{Membership, Passes as _};

struct Access<'a> {
    /// The master weights, flat (any dtype).
    params: &'a Tensor,
    /// ddp: the whole flat moments (read and written in place); zero2:
    /// the old shard (read only).
    avg: [&'a Tensor; 2],
    sharding: Sharding,
    old: Range<usize>,
    new: Range<usize>,
    /// zero2: the new moment shards.
    new_avg: [Tensor; 2],
}

fn part(t: &Tensor, start: usize, len: usize) -> Tensor {
    t.narrow(0, start as i64, len as i64)
}

impl StateAccess for Access<'_> {
    fn read(&mut self, buf: usize, range: Range<usize>) -> Tensor {
        // On the model's device; `reshard::sync` moves it where the
        // collective needs it. Copies: the sender's values must not move
        // while they travel.
        let (start, len) = (range.start, range.len());
        match (buf, self.sharding) {
            (0, _) => part(self.params, start, len).to_kind(Kind::Float).copy(),
            (m, Sharding::Ddp) => part(self.avg[m - 1], start, len).copy(),
            (m, Sharding::Zero2) => part(self.avg[m - 1], start - self.old.start, len),
        }
    }

    fn write(&mut self, buf: usize, range: Range<usize>, values: &Tensor) {
        let (start, len) = (range.start, range.len());
        tch::no_grad(|| match (buf, self.sharding) {
            (0, _) => part(self.params, start, len).copy_(values),
            (m, Sharding::Ddp) => part(self.avg[m - 1], start, len).copy_(values),
            (m, Sharding::Zero2) => {
                part(&self.new_avg[m - 1], start - self.new.start, len).copy_(values)
            }
        });
    }
}

impl Membership for ReplicatedTrainer {
    fn group(&mut self) -> &mut dyn Collective {
        self.coll.as_mut()
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        let fits = self.fits(coll.rank(), coll.world_size());
        swap_collective(&mut self.coll, coll, fits, "zero2: the optimizer shard")
    }

    fn set_context(&mut self, group: Option<Box<dyn Collective>>) -> anyhow::Result<()> {
        self.context = group
            .filter(|g| g.world_size() > 1)
            .map(std::sync::Mutex::new);
        Ok(())
    }

    /// `None` at ddp (a replica serves any rank); zero2's optimizer state
    /// is sharded.
    fn state_layout(&self) -> Option<(usize, usize)> {
        match self.sharding {
            Sharding::Ddp => None,
            Sharding::Zero2 => Some(self.rank_world()),
        }
    }

    /// Always at ddp; at zero2 only for the same shard.
    fn fits(&self, rank: usize, world: usize) -> bool {
        match self.sharding {
            Sharding::Ddp => true,
            Sharding::Zero2 => (rank, world) == self.rank_world(),
        }
    }

    /// Joins a new generation taking the training state from the members
    /// that hold it (issue 6, state sync; see [`reshard`]): `coll` is the
    /// new generation's collective, or `None` when this trainer was just
    /// built with it (a member without state). A holder's state is laid
    /// out as its current collective says (the runner checks that against
    /// the coordinator's `prior`). Every rank of `coll` must call it with
    /// the same `plan`. Gradients are zeroed.
    fn sync_state(
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
            params: &self.flat_params,
            avg: [&self.opt.exp_avg[0], &self.opt.exp_avg_sq[0]],
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
        // A zero2 gradient shard follows the new layout.
        self.grads = Grads::new(&self.layout, zero2, self.coll.as_ref(), device);
        self.refresh_compute();
        self.zero_grad();
        Ok(())
    }
}
