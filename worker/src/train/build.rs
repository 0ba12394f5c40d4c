//! Which trainer a job gets: the one place that knows both.

use std::path::Path;

use super::fsdp::FsdpTrainer;
use super::replicated::ReplicatedTrainer;
use super::trainer::Trainer;
use crate::collective::Collective;
use crate::config::{JobConfig, Sharding};

/// The trainer `cfg.sharding` asks for, built for this rank (restoring from
/// a checkpoint directory when given).
pub fn build(
    cfg: &JobConfig,
    restore: Option<&Path>,
    coll: Box<dyn Collective>,
) -> anyhow::Result<Box<dyn Trainer>> {
    Ok(match cfg.sharding {
        // FsdpTrainer::new refuses a live reference.
        Sharding::Fsdp => Box::new(FsdpTrainer::new(cfg, restore, coll)?),
        Sharding::Ddp | Sharding::Zero2 => Box::new(ReplicatedTrainer::new(cfg, restore, coll)?),
    })
}
