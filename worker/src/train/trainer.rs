//! The trainer interface (issue 13): what the runner needs from one rank's
//! model replica and optimizer, whatever the sharding level. Two trainers
//! implement it — [`ReplicatedTrainer`](super::ReplicatedTrainer) (ddp, zero2) and
//! [`FsdpTrainer`](super::FsdpTrainer)
//! (fsdp) — and [`build`](super::build()) picks one by the job's sharding; a generator
//! worker's [`Generator`](super::Generator) implements it to take part in a
//! generation without training.
//!
//! [`Trainer`] is four traits, so that each trainer implements each part in
//! the file that does the work, not through a layer of forwarding methods:
//! [`Passes`] (forward and backward over microbatches: the objectives),
//! [`Membership`] (the generation's collective and the state layout:
//! resharding), [`Checkpointing`] (snapshot and write) and [`Trainer`]
//! itself (the optimizer step and the policy for generation). What the
//! trainers share is written once: the global-norm clip
//! (`optim::clip_coefficient`), agreement between ranks
//! (`collective::count_failures`, and [`Checkpointing::save_checkpoint`]),
//! the collective swap ([`swap_collective`]) and the objective dispatch
//! (`objective::microbatch::objective`).

use std::path::Path;

use anyhow::bail;

use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::collective::reshard::SyncPlan;
use crate::collective::{count_failures, Collective};
use crate::model::Llama;

/// Writes a rank's snapshotted part of a checkpoint into a directory (on a
/// background thread, no collectives); returns the names of the files
/// written.
pub type CheckpointWrite = Box<dyn FnOnce(&Path) -> anyhow::Result<Vec<String>> + Send>;

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global L2 norm over all ranks' summed gradients, before clipping.
    pub grad_norm: f64,
}

/// Forward and backward passes over packed microbatches under the job's
/// objective. Gradients accumulate across `train_microbatch` calls and are
/// consumed once by [`Trainer::optimizer_step`].
pub trait Passes {
    /// Forward/backward of one microbatch under the job's objective,
    /// normalised by the step's global `norms` from the plan (SFT: each
    /// loss token scaled by `1 / norms.loss_tokens`); gradients accumulate.
    fn train_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome>;

    /// Reference plans: each sequence's log-prob summed over its loss
    /// tokens (and, for policy gradient, per token) under the job's
    /// initial weights, forward only.
    fn reference_logps(
        &mut self,
        _index: usize,
        _batch: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        bail!("this worker cannot run reference plans")
    }

    /// Eval plans: each sequence's log-prob summed over its loss tokens
    /// under the CURRENT weights, forward only (no gradient, nothing
    /// changes); every rank calls it for every microbatch index.
    fn eval_logps(
        &mut self,
        _index: usize,
        _batch: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        bail!("this worker cannot run eval plans")
    }

    /// Whether [`Self::begin_step`] has work; the runner then converts a
    /// plan's microbatches before the first one runs.
    fn needs_whole_step(&self) -> bool {
        false
    }

    /// Before a step's microbatches, with all of them (this rank's, in plan
    /// order, padding ones empty): what needs the whole step first.
    /// Qwen3-MoE's load-balancing loss counts the step's routing here (a
    /// forward-only pass and one all-reduce, every rank joins; see
    /// `train::routing`).
    fn begin_step(&mut self, _batches: &[PackedBatch]) -> anyhow::Result<()> {
        Ok(())
    }

    /// Drops the accumulated gradients (abort, failed step).
    fn zero_grad(&mut self);

    /// Whether the gradients this rank accumulated (its shards, under
    /// fsdp) are all finite; no collective. Probe plans ask it after each
    /// microbatch.
    fn grads_finite(&self) -> bool;

    /// Probe plans: forward and backward of one microbatch on its own,
    /// from zero gradients; its sums and whether its loss and this rank's
    /// gradients are finite. Nothing is reduced across ranks where the
    /// trainer can avoid it (fsdp cannot: its units are gathered).
    fn probe_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<(MicrobatchOutcome, bool)> {
        self.zero_grad();
        let o = self.train_microbatch(index, batch, meta, norms)?;
        let finite = o.loss_sum.is_finite() && self.grads_finite();
        Ok((o, finite))
    }

    /// True when every microbatch, padding included, runs collectives
    /// (FSDP gathers per unit): empty microbatches must then be run too,
    /// or ranks would diverge.
    fn collective_per_microbatch(&self) -> bool {
        false
    }

    /// Training FLOPs of a microbatch with these sequence boundaries run
    /// with `loss_tokens` targets (for MFU; `model::flops`).
    /// 0 when the trainer cannot tell.
    fn model_flops(&self, _cu_seq_lens: &[i64], _loss_tokens: u64) -> f64 {
        0.0
    }
}

/// A rank's place in its generation: the collective it runs on and the
/// layout of the state it holds (DESIGN.md "Elasticity": a new generation
/// keeps a replica that fits, else syncs or rebuilds it).
pub trait Membership {
    /// This replica's collective.
    fn group(&mut self) -> &mut dyn Collective;

    /// Joins a new generation's collective, keeping the replica (see
    /// [`swap_collective`]).
    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()>;

    /// Joins a new generation's context-parallel group (`None`: rows are
    /// not split); called after [`Self::set_collective`] or the build.
    fn set_context(&mut self, group: Option<Box<dyn Collective>>) -> anyhow::Result<()> {
        match group {
            Some(g) if g.world_size() > 1 => {
                bail!("this trainer does not split rows (context parallelism)")
            }
            _ => Ok(()),
        }
    }

    /// The shard layout `(rank, world)` of the state this replica holds;
    /// `None` when it is whole (ddp: a replica serves any rank).
    fn state_layout(&self) -> Option<(usize, usize)> {
        None
    }

    /// Whether the replica's state stays valid as `rank` of `world` (a new
    /// generation at the same step); false makes the runner rebuild it.
    fn fits(&self, _rank: usize, _world: usize) -> bool {
        true
    }

    /// Joins a new generation taking the training state from the members
    /// that hold it (see `collective::reshard`): `coll` is the new
    /// collective, or `None` when the trainer was just built with it (a
    /// member without state). Every rank calls it with the same `plan`.
    fn sync_state(
        &mut self,
        _coll: Option<Box<dyn Collective>>,
        _plan: &SyncPlan,
    ) -> anyhow::Result<()> {
        bail!("this worker cannot take its state from peers")
    }

    /// Waits until every rank reached this point.
    fn barrier(&mut self) -> anyhow::Result<()> {
        Ok(self.group().barrier()?)
    }
}

/// A rank's part of a checkpoint.
pub trait Checkpointing: Membership {
    /// Copies this rank's part of a checkpoint into memory (may run
    /// collectives: every rank calls it at the same point) and returns the
    /// writer that puts it into a directory later, without collectives.
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite>;

    /// Snapshots and writes this rank's part of a checkpoint in `dir` at
    /// once (every rank calls it); returns once every rank has written and
    /// fails on every rank if any rank failed.
    fn save_checkpoint(&mut self, dir: &Path) -> anyhow::Result<()> {
        let written = self.checkpoint_snapshot().and_then(|w| w(dir));
        let failed = count_failures(self.group(), written.is_ok())?;
        written?;
        if failed > 0 {
            bail!(
                "{failed} other rank(s) failed to write their part of {}",
                dir.display()
            );
        }
        Ok(())
    }
}

/// One rank's model replica with its optimizer.
pub trait Trainer: Passes + Membership + Checkpointing {
    /// The accumulation boundary: reduce gradients across ranks, clip with
    /// the global norm, step the optimizer at `lr`, zero the gradients. On
    /// a non-finite norm it fails on every rank and leaves the parameters
    /// untouched.
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats>;

    /// The whole model for generation (issue 17): the weights forward runs
    /// on, in the compute dtype. A replicated trainer lends its own; a
    /// sharded one gathers a temporary copy, freed when the [`Policy`] is
    /// dropped. Every rank of the generation calls it once per round,
    /// `ready` saying whether its own plan can run: a sharded trainer first
    /// agrees on it with the other ranks, so that one rank refusing its
    /// plan fails every rank instead of leaving them waiting in the gather.
    fn policy(&mut self, _ready: bool) -> anyhow::Result<Policy<'_>> {
        bail!("this worker cannot generate")
    }

    /// A generator of a disaggregated RL job: loads the policy trainer
    /// rank 0 broadcasts over the weight ring; returns its version and
    /// size.
    fn receive_policy(&mut self) -> anyhow::Result<super::policy_sync::Received> {
        bail!("only a generator worker takes its weights from trainer rank 0")
    }

    /// The device the replica lives on.
    fn device(&self) -> tch::Device {
        tch::Device::Cpu
    }
}

/// The model a generation round decodes with: the trainer's own
/// (ddp, zero2), or the full parameters gathered for the round (fsdp, as
/// FSDP's `summon_full_params`), which exist only as long as this value.
pub enum Policy<'a> {
    Held(&'a Llama),
    Gathered(Box<Llama>),
}

impl std::ops::Deref for Policy<'_> {
    type Target = Llama;

    fn deref(&self) -> &Llama {
        match self {
            Policy::Held(m) => m,
            Policy::Gathered(m) => m,
        }
    }
}

/// Replaces `current` with a new generation's collective when the state
/// fits the new rank and world; the error names both layouts.
pub fn swap_collective(
    current: &mut Box<dyn Collective>,
    new: Box<dyn Collective>,
    fits: bool,
    what: &str,
) -> anyhow::Result<()> {
    if !fits {
        bail!(
            "{what} of rank {} of {} cannot serve rank {} of {}; restore from a checkpoint",
            current.rank(),
            current.world_size(),
            new.rank(),
            new.world_size()
        );
    }
    *current = new;
    Ok(())
}
