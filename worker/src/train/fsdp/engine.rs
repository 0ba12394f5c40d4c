//! The sharded trainer (fsdp) as an [`Engine`].

use super::FsdpTrainer;
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::collective::reshard::SyncPlan;
use crate::collective::Collective;
use crate::train::engine::{swap_collective, CheckpointWrite, Engine, Policy};
use crate::train::trainer::StepStats;

impl Engine for FsdpTrainer {
    fn train_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        self.objective_microbatch(index, batch, meta, norms)
    }

    /// A collective: the runner calls it for every microbatch index of a
    /// reference plan (see [`Engine::collective_per_microbatch`]).
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

    /// A collective; the gradient shards are zeroed whatever the outcome.
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let result = self.boundary(lr);
        self.zero_grad();
        result
    }

    fn zero_grad(&mut self) {
        for g in &mut self.grads {
            let _ = g.zero_();
        }
    }

    fn grads_finite(&self) -> bool {
        crate::train::finite::all_finite(&self.grads)
    }

    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let snap = self.snapshot()?;
        Ok(Box::new(move |dir| snap.write(dir)))
    }

    /// Every shard belongs to one (rank, world).
    fn state_layout(&self) -> Option<(usize, usize)> {
        Some((self.rank(), self.world_size()))
    }

    fn sync_state(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        self.sync_with(coll, plan)
    }

    /// Shards belong to one (rank, world): anything else is rebuilt.
    fn fits(&self, rank: usize, world: usize) -> bool {
        (rank, world) == (self.rank(), self.world_size())
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        let fits = self.fits(coll.rank(), coll.world_size());
        swap_collective(&mut self.coll, coll, fits, "fsdp shards")
    }

    fn group(&mut self) -> &mut dyn Collective {
        self.coll.as_mut()
    }

    fn collective_per_microbatch(&self) -> bool {
        true
    }

    /// A collective: the full parameters are gathered for the round.
    fn policy(&mut self, ready: bool) -> anyhow::Result<Policy<'_>> {
        Ok(Policy::Gathered(Box::new(self.gather_policy(ready)?)))
    }

    fn device(&self) -> tch::Device {
        self.device
    }

    fn model_flops(&self, cu_seq_lens: &[i64], loss_tokens: u64) -> f64 {
        crate::model::flops::training_flops(self.model_config(), cu_seq_lens, loss_tokens)
    }
}
