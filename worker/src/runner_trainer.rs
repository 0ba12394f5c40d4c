//! The real [`StepExecutor`]s: the libtorch data-parallel `Trainer` (ddp,
//! zero2) and, by `parallel.sharding`, the FSDP engine.

use std::path::Path;
use std::sync::Arc;

use crate::collective::Collective;
use crate::config::JobConfig;
use crate::runner::{Factory, MicrobatchOutcome, StepExecutor};
use crate::train::{PackedBatch, Trainer};
use crate::wire;

impl StepExecutor for Trainer {
    fn microbatch(
        &mut self,
        index: usize,
        mb: &wire::Microbatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let batch = PackedBatch::from_wire(mb)?;
        let s = Trainer::microbatch(self, index, &batch, global_loss_tokens)?;
        Ok(MicrobatchOutcome {
            loss_sum: s.loss_sum,
            loss_tokens: s.loss_tokens,
            tokens: s.tokens,
        })
    }

    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<f64> {
        Ok(Trainer::optimizer_step(self, lr)?.grad_norm)
    }

    fn zero_grad(&mut self) {
        Trainer::zero_grad(self);
    }

    fn save_checkpoint(&mut self, dir: &Path) -> anyhow::Result<()> {
        Trainer::save_checkpoint(self, dir)
    }

    fn fits(&self, rank: usize, world: usize) -> bool {
        Trainer::fits(self, rank, world)
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        Trainer::set_collective(self, coll)
    }
}

/// The engine `parallel.sharding` asks for, built for this rank.
pub fn build(
    cfg: &JobConfig,
    restore: Option<&Path>,
    coll: Box<dyn Collective>,
) -> anyhow::Result<Box<dyn StepExecutor>> {
    match cfg.parallel.sharding.to_ascii_lowercase().as_str() {
        // MERGE: the lead replaces this arm with
        // `Ok(Box::new(crate::train::fsdp::FsdpTrainer::new(cfg, restore, coll)?))`
        // once train/fsdp.rs is on the branch.
        "fsdp" => anyhow::bail!("parallel.sharding = \"fsdp\": fsdp: not built yet"),
        _ => Ok(Box::new(Trainer::new(cfg, restore, coll)?)),
    }
}

/// Builds the engine per job (restoring from a checkpoint when asked).
pub fn factory() -> Factory {
    Arc::new(build)
}
