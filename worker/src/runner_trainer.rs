//! The real [`StepExecutor`]: the libtorch `Trainer` (crate::train).

use std::path::Path;
use std::sync::Arc;

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

    fn save_checkpoint(&self, dir: &Path) -> anyhow::Result<()> {
        Trainer::save_checkpoint(self, dir)
    }

    fn model_flops(&self, mb: &wire::Microbatch, loss_tokens: u64) -> f64 {
        let cu: Vec<i64> = mb.cu_seq_lens.iter().map(|&c| i64::from(c)).collect();
        crate::model::flops::training_flops(&self.model().cfg, &cu, loss_tokens)
    }
}

/// Builds a `Trainer` per job (restoring from a checkpoint when asked).
pub fn factory() -> Factory {
    Arc::new(|cfg, restore| Ok(Box::new(Trainer::new(cfg, restore)?) as Box<dyn StepExecutor>))
}
