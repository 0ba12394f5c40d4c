//! The replicated trainer (ddp, zero2) as an [`Engine`].

use super::{Sharding, StepStats, Trainer};
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::collective::reshard::SyncPlan;
use crate::collective::Collective;
use crate::error::StepError;
use crate::train::engine::{swap_collective, CheckpointWrite, Engine, Policy};

impl Engine for Trainer {
    fn train_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        self.objective_microbatch(index, batch, meta, norms)
    }

    fn reference_logps(
        &mut self,
        index: usize,
        batch: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        self.initial_logps(index, batch)
    }

    fn eval_logps(
        &mut self,
        index: usize,
        batch: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        self.current_logps(index, batch)
    }

    /// Every rank must call it, ranks with only padding microbatches too
    /// (they contribute zeros to the reduction).
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let result = if lr.is_finite() {
            let r = self.boundary(lr);
            if r.is_ok() {
                self.pristine = false;
            }
            r
        } else {
            Err(StepError::invalid(format!(
                "non-finite learning rate {lr}; parameters left unchanged"
            )))
        };
        self.zero_grad();
        result
    }

    fn zero_grad(&mut self) {
        self.grads.zero();
    }

    fn grads_finite(&self) -> bool {
        self.grads.finite(&self.layout)
    }

    /// The microbatch's own gradients, checked and dropped: nothing is
    /// reduced (a zero2 rank would otherwise sum other ranks' probes in).
    fn probe_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<(MicrobatchOutcome, bool)> {
        self.zero_grad();
        let (o, grads) = self.objective_grads(index, batch, meta, norms)?;
        let finite = o.loss_sum.is_finite() && crate::train::finite::all_finite(&grads);
        Ok((o, finite))
    }

    /// zero2 reduce-scatters every microbatch's gradient.
    fn collective_per_microbatch(&self) -> bool {
        self.sharding == Sharding::Zero2 && self.coll.world_size() > 1
    }

    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let snap = self.snapshot()?;
        Ok(Box::new(move |dir| snap.write(dir)))
    }

    /// `None` at ddp (a replica serves any rank); zero2's optimizer state
    /// is sharded.
    fn state_layout(&self) -> Option<(usize, usize)> {
        match self.sharding {
            Sharding::Ddp => None,
            Sharding::Zero2 => Some(self.rank_world()),
        }
    }

    fn sync_state(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        self.sync_with(coll, plan)
    }

    /// Always at ddp; at zero2 only for the same shard.
    fn fits(&self, rank: usize, world: usize) -> bool {
        match self.sharding {
            Sharding::Ddp => true,
            Sharding::Zero2 => (rank, world) == self.rank_world(),
        }
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        let fits = self.fits(coll.rank(), coll.world_size());
        swap_collective(&mut self.coll, coll, fits, "zero2: the optimizer shard")
    }

    fn group(&mut self) -> &mut dyn Collective {
        self.coll.as_mut()
    }

    fn device(&self) -> tch::Device {
        self.model.vs.device()
    }

    /// ddp and zero2 hold every parameter on every rank.
    fn policy(&mut self, _ready: bool) -> anyhow::Result<Policy<'_>> {
        Ok(Policy::Held(self.compute_model()))
    }

    fn model_flops(&self, cu_seq_lens: &[i64], loss_tokens: u64) -> f64 {
        crate::model::flops::training_flops(&self.model.cfg, cu_seq_lens, loss_tokens)
    }
}
