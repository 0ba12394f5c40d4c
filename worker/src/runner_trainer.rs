//! The real [`StepExecutor`]s: the libtorch data-parallel `Trainer` (ddp,
//! zero2) and, by `parallel.sharding`, the FSDP engine.

use std::path::Path;
use std::sync::Arc;

use crate::collective::reshard::SyncPlan;
use crate::collective::Collective;
use crate::config::{JobConfig, Sharding};
use crate::objective::head::MicrobatchMeta;
use crate::objective::microbatch::StepNorms;
use crate::runner::{CheckpointWrite, Factory, MicrobatchOutcome, SequenceLogp, StepExecutor};
use crate::train::fsdp::FsdpTrainer;
use crate::train::{PackedBatch, Trainer};
use crate::wire;

fn step_norms(n: &wire::Normalizers) -> StepNorms {
    StepNorms {
        loss_tokens: n.loss_tokens,
        pairs: n.pairs,
        sequences: n.sequences,
    }
}

impl StepExecutor for Trainer {
    fn microbatch(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
        norms: &wire::Normalizers,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let batch = PackedBatch::from_wire(mb)?;
        let meta = MicrobatchMeta::from_wire(mb)?;
        let (s, extra) = Trainer::microbatch_with(self, index, &batch, &meta, &step_norms(norms))?;
        Ok(MicrobatchOutcome {
            loss_sum: s.loss_sum,
            loss_tokens: s.loss_tokens,
            tokens: s.tokens,
            extra,
        })
    }

    fn sequence_logps(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        let batch = PackedBatch::from_wire(mb)?;
        Trainer::reference_logps(self, index, &batch)
    }

    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<f64> {
        Ok(Trainer::optimizer_step(self, lr)?.grad_norm)
    }

    fn zero_grad(&mut self) {
        Trainer::zero_grad(self);
    }

    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let snap = Trainer::checkpoint_snapshot(self)?;
        Ok(Box::new(move |dir: &Path| snap.write(dir)))
    }

    fn state_layout(&self) -> Option<(usize, usize)> {
        Trainer::state_layout(self)
    }

    fn sync_state(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        Trainer::sync_state(self, coll, plan)
    }

    fn fits(&self, rank: usize, world: usize) -> bool {
        Trainer::fits(self, rank, world)
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        Trainer::set_collective(self, coll)
    }

    fn barrier(&mut self) -> anyhow::Result<()> {
        Ok(self.group().barrier()?)
    }

    fn model_flops(&self, mb: &wire::Microbatch, loss_tokens: u64) -> f64 {
        let cu: Vec<i64> = mb.cu_seq_lens.iter().map(|&c| i64::from(c)).collect();
        crate::model::flops::training_flops(&self.model().cfg, &cu, loss_tokens)
    }
}

impl StepExecutor for FsdpTrainer {
    fn microbatch(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
        norms: &wire::Normalizers,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let batch = PackedBatch::from_wire(mb)?;
        let meta = MicrobatchMeta::from_wire(mb)?;
        let (s, extra) =
            FsdpTrainer::microbatch_with(self, index, &batch, &meta, &step_norms(norms))?;
        Ok(MicrobatchOutcome {
            loss_sum: s.loss_sum,
            loss_tokens: s.loss_tokens,
            tokens: s.tokens,
            extra,
        })
    }

    /// A collective: the runner calls it for every microbatch index of a
    /// reference plan (see [`StepExecutor::collective_per_microbatch`]).
    fn sequence_logps(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        let batch = PackedBatch::from_wire(mb)?;
        FsdpTrainer::reference_logps(self, index, &batch)
    }

    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<f64> {
        Ok(FsdpTrainer::optimizer_step(self, lr)?.grad_norm)
    }

    fn zero_grad(&mut self) {
        FsdpTrainer::zero_grad(self);
    }

    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let snap = FsdpTrainer::checkpoint_snapshot(self)?;
        Ok(Box::new(move |dir: &Path| snap.write(dir)))
    }

    fn state_layout(&self) -> Option<(usize, usize)> {
        Some((self.rank(), self.world_size()))
    }

    fn sync_state(
        &mut self,
        coll: Option<Box<dyn Collective>>,
        plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        FsdpTrainer::sync_state(self, coll, plan)
    }

    fn collective_per_microbatch(&self) -> bool {
        true
    }

    fn model_flops(&self, mb: &wire::Microbatch, loss_tokens: u64) -> f64 {
        let cu: Vec<i64> = mb.cu_seq_lens.iter().map(|&c| i64::from(c)).collect();
        crate::model::flops::training_flops(self.model_config(), &cu, loss_tokens)
    }

    /// Shards belong to one (rank, world): anything else is rebuilt.
    fn fits(&self, rank: usize, world: usize) -> bool {
        (rank, world) == (self.rank(), self.world_size())
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        FsdpTrainer::set_collective(self, coll)
    }

    fn barrier(&mut self) -> anyhow::Result<()> {
        Ok(self.group().barrier()?)
    }
}

/// The engine `parallel.sharding` asks for, built for this rank.
pub fn build(
    cfg: &JobConfig,
    restore: Option<&Path>,
    coll: Box<dyn Collective>,
) -> anyhow::Result<Box<dyn StepExecutor>> {
    match cfg.sharding {
        // FsdpTrainer::new refuses a live reference.
        Sharding::Fsdp => Ok(Box::new(FsdpTrainer::new(cfg, restore, coll)?)),
        Sharding::Ddp | Sharding::Zero2 => Ok(Box::new(Trainer::new(cfg, restore, coll)?)),
    }
}

/// Builds the engine per job (restoring from a checkpoint when asked).
pub fn factory() -> Factory {
    Arc::new(build)
}
