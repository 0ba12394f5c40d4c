//! The data-parallel SFT trainer: forward + backward of packed microbatches
//! with exact accumulation, then one AdamW step, replicated (`ddp`) or with
//! the optimizer state sharded over ranks (`zero2`).
//!
//! The math (DESIGN.md, "The math"): each microbatch backpropagates
//! `(1/T) Σ_{t∈mb} ℓ_t` with T the step's global loss-token count from the
//! plan, identical on every rank; gradients are summed in place across
//! microbatches, and across ranks once, at the accumulation boundary
//! (`optimizer_step`). Never divide by the number of microbatches or ranks:
//! a short microbatch must weigh less than a long one.
//!
//! At the boundary the gradients are flattened into one f32 buffer
//! ([`FlatLayout`], parameters in name order):
//! - `ddp`: all-reduce (sum) the buffer; every rank clips with the global
//!   norm and applies the same AdamW update to its full replica.
//! - `zero2` (ZeRO stage 2, Rajbhandari et al. 2020): reduce-scatter the
//!   buffer; each rank holds AdamW moments only for its
//!   [`shard_range`] of the flat layout, takes the global norm as
//!   `sqrt(Σ_ranks Σ_shard g²)`, updates its shard of the parameters, and
//!   all-gathers the parameters.

use std::path::Path;

use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};

use crate::batch::{MicrobatchOutcome, PackedBatch};
use crate::collective::{shard_range, Collective, CollectiveError, Solo};
use crate::config::{self, JobConfig};
use crate::error::StepError;
use crate::model::{loss, Llama};
use crate::objective::Objective;

use super::checkpoint::{self, ShardEntry};
use super::flat::FlatLayout;
use super::optim::{self, AdamW};
use super::source::{build_model, frozen};

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global L2 norm over all ranks' summed gradients, before clipping.
    pub grad_norm: f64,
}

/// This trainer's two sharding levels (fsdp is another engine,
/// `train::fsdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Replicated parameters and optimizer state; gradients all-reduced.
    Ddp,
    /// Replicated parameters; gradients reduce-scattered, optimizer state
    /// sharded by flat element range.
    Zero2,
}

impl Sharding {
    fn of(s: config::Sharding) -> anyhow::Result<Sharding> {
        match s {
            config::Sharding::Ddp => Ok(Sharding::Ddp),
            config::Sharding::Zero2 => Ok(Sharding::Zero2),
            config::Sharding::Fsdp => {
                bail!("parallel.sharding = \"fsdp\" runs on the fsdp engine, not this trainer")
            }
        }
    }
}

/// Bytes of training state one rank holds (the memory table of issue 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    /// Parameters (model dtype).
    pub params: u64,
    /// Gradient accumulation buffers held through the step (model dtype).
    pub grads: u64,
    /// AdamW moments (f32).
    pub optimizer: u64,
    /// The flat f32 buffer that lives only at the accumulation boundary
    /// (reduction, then the parameter gather), freed after the step.
    pub boundary: u64,
}

impl StateBytes {
    /// Parameters + gradients + optimizer state.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// A parameter's HF name and its AdamW `(exp_avg, exp_avg_sq)`.
pub type NamedMoments = (String, Tensor, Tensor);

/// Model + optimizer of one rank.
pub struct Trainer {
    model: Llama,
    names: Vec<String>,
    params: Vec<Tensor>,
    layout: FlatLayout,
    sharding: Sharding,
    coll: Box<dyn Collective>,
    /// ddp: one moment pair per parameter; zero2: one flat pair for this
    /// rank's shard of the layout.
    opt: AdamW,
    grad_clip: f64,
    loss_chunk_tokens: usize,
    objective: Objective,
    /// A frozen copy of the initial model: `reference = "live"`, or built
    /// on demand for a reference plan once this replica has trained.
    reference: Option<Llama>,
    /// Whether `model` still holds the job's initial weights.
    pristine: bool,
    /// The job config, to rebuild the initial model for a reference plan.
    init: JobConfig,
}

mod engine;
mod objectives;
mod sync;

/// The collective operations the trainer runs on flat buffers.
#[derive(Clone, Copy)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Trainer {
    /// Builds the model from `cfg.model` (`init = "random"` with the HF
    /// config.json at `cfg.model.config`, seeded by `cfg.job.seed`; or a HF
    /// checkpoint dir), or restores model + optimizer from a checkpoint dir
    /// written by [`Trainer::save_checkpoint`] at any world size. `coll` is
    /// this rank's membership in the generation (`Solo` for one rank).
    pub fn new(
        cfg: &JobConfig,
        restore_from: Option<&Path>,
        coll: Box<dyn Collective>,
    ) -> anyhow::Result<Trainer> {
        let sharding = Sharding::of(cfg.sharding)?;
        let model = build_model(cfg, restore_from)?;
        let adam = cfg.optimizer;
        let mut vars: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let (names, params): (Vec<String>, Vec<Tensor>) = vars.into_iter().unzip();
        let layout = FlatLayout::new(&params);
        let device = model.vs.device();
        let shard = shard_range(layout.total, coll.world_size(), coll.rank());
        let mut opt = match sharding {
            Sharding::Ddp => AdamW::new(adam, &params),
            Sharding::Zero2 => AdamW::new(
                adam,
                &[Tensor::zeros([shard.len() as i64], (Kind::Float, device))],
            ),
        };
        if let Some(dir) = restore_from {
            let (step, mut saved) = checkpoint::load_optimizer_tensors(dir)
                .with_context(|| format!("restoring optimizer from {}", dir.display()))?;
            let (avg, avg_sq) = checkpoint::take_moments(&mut saved, &names, &params, dir)?;
            tch::no_grad(|| match sharding {
                Sharding::Ddp => {
                    for (i, (a, s)) in avg.iter().zip(&avg_sq).enumerate() {
                        opt.exp_avg[i].copy_(a);
                        opt.exp_avg_sq[i].copy_(s);
                    }
                }
                Sharding::Zero2 => {
                    opt.exp_avg[0].copy_(&layout.slice(&avg, shard.clone(), device));
                    opt.exp_avg_sq[0].copy_(&layout.slice(&avg_sq, shard.clone(), device));
                }
            });
            opt.step = step;
        }
        let objective = cfg.objective;
        let reference = if objective.live_reference() {
            Some(frozen(build_model(cfg, None)?))
        } else {
            None
        };
        Ok(Trainer {
            model,
            names,
            params,
            layout,
            sharding,
            coll,
            opt,
            grad_clip: cfg.grad_clip,
            loss_chunk_tokens: cfg.loss_chunk_tokens,
            objective,
            reference,
            pristine: restore_from.is_none(),
            init: cfg.clone(),
        })
    }

    /// A single-rank trainer ([`Solo`] collective).
    pub fn single(cfg: &JobConfig, restore_from: Option<&Path>) -> anyhow::Result<Trainer> {
        Trainer::new(cfg, restore_from, Box::new(Solo))
    }

    /// Forward + backward of one microbatch; the loss is scaled by
    /// `1/global_loss_tokens` and gradients ACCUMULATE (never zeroed here).
    /// A non-finite loss is an error naming the microbatch; nothing is
    /// applied to the gradients then. An empty (padding) microbatch does
    /// nothing: no collective runs per microbatch.
    pub fn microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let mut sums = MicrobatchOutcome {
            tokens: mb.tokens() as u64,
            ..Default::default()
        };
        if mb.is_empty() {
            return Ok(sums);
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        if targets.iter().all(|&t| t == -100) {
            // No loss token: zero gradient, skip the forward.
            return Ok(sums);
        }
        if global_loss_tokens == 0 {
            return Err(StepError::invalid(format!(
                "microbatch {index}: has loss tokens but the step's global loss-token count is 0"
            )));
        }
        let hidden = self.model.hidden(&mb.input_ids, &mb.cu_seq_lens);
        let head = self.model.lm_head_weight();
        let chunked = loss::chunked_nll(
            &hidden,
            head,
            &targets,
            self.loss_chunk_tokens,
            1.0 / global_loss_tokens as f64,
        )
        .with_context(|| format!("microbatch {index}"))?;
        loss::backward_into_model(&hidden, head, &chunked);
        sums.loss_sum = chunked.loss_sum;
        sums.loss_tokens = chunked.loss_tokens;
        Ok(sums)
    }

    /// The accumulation boundary (see [`Engine::optimizer_step`]): reduce
    /// the flat gradient (all-reduce at ddp, reduce-scatter at zero2), clip
    /// with the global norm, AdamW at `lr`. A non-finite norm is an error;
    /// every rank sees the same global norm, so all of them refuse together
    /// and leave their parameters untouched.
    fn boundary(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let device = self.model.vs.device();
        let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
        let mut flat = self.layout.flatten(&grads, device);
        drop(grads);
        let norm = match self.sharding {
            Sharding::Ddp => {
                self.collective(Op::AllReduce, &mut flat)?;
                optim::sum_of_squares(std::slice::from_ref(&flat)).sqrt()
            }
            Sharding::Zero2 => {
                self.collective(Op::ReduceScatter, &mut flat)?;
                let shard = self.narrow_shard(&flat);
                // Σg² over this rank's shard, summed over ranks: the norm of
                // the whole gradient, not of the shard.
                let mine = optim::sum_of_squares(&[shard]) as f32;
                let mut sq = Tensor::from_slice(&[mine]);
                self.collective(Op::AllReduce, &mut sq)?;
                (f32::try_from(&sq)? as f64).sqrt()
            }
        };
        if !norm.is_finite() {
            return Err(StepError::non_finite(format!(
                "gradient norm {norm}; parameters left unchanged"
            )));
        }
        tch::no_grad(|| -> anyhow::Result<()> {
            if let Some(coef) = optim::clip_coefficient(norm, self.grad_clip) {
                let _ = flat.g_mul_scalar_(coef);
            }
            match self.sharding {
                Sharding::Ddp => {
                    let views = self.layout.views(&flat);
                    self.opt.step_with_grads(&self.params, &views, lr);
                }
                Sharding::Zero2 => {
                    let grad = self.narrow_shard(&flat);
                    drop(flat);
                    let range = self.shard();
                    let mine = self.layout.slice(&self.params, range.clone(), device);
                    self.opt
                        .step_with_grads(std::slice::from_ref(&mine), &[grad], lr);
                    let mut full = Tensor::zeros([self.layout.total as i64], (Kind::Float, device));
                    full.narrow(0, range.start as i64, range.len() as i64)
                        .copy_(&mine);
                    self.collective(Op::AllGather, &mut full)?;
                    for (p, v) in self.params.iter().zip(self.layout.views(&full)) {
                        p.shallow_clone().copy_(&v);
                    }
                }
            }
            Ok(())
        })?;
        Ok(StepStats { grad_norm: norm })
    }

    /// This rank's element range of the flat layout.
    fn shard(&self) -> std::ops::Range<usize> {
        shard_range(self.layout.total, self.coll.world_size(), self.coll.rank())
    }

    fn narrow_shard(&self, flat: &Tensor) -> Tensor {
        let r = self.shard();
        flat.narrow(0, r.start as i64, r.len() as i64)
    }

    /// Runs `op` on a flat f32 buffer (staged through host memory when it
    /// lives on a GPU: the CPU ring reads host memory). A no-op at world 1.
    fn collective(&mut self, op: Op, t: &mut Tensor) -> Result<(), CollectiveError> {
        if self.coll.world_size() == 1 {
            return Ok(());
        }
        let coll = self.coll.as_mut();
        let mut run = |t: &mut Tensor| match op {
            Op::AllReduce => coll.all_reduce_sum(t),
            Op::ReduceScatter => coll.reduce_scatter_sum(t),
            Op::AllGather => coll.all_gather(t),
        };
        if t.device() == Device::Cpu {
            run(t)
        } else {
            let mut host = t.to_device(Device::Cpu);
            run(&mut host)?;
            tch::no_grad(|| t.copy_(&host));
            Ok(())
        }
    }

    /// Copies what this rank writes of a checkpoint to CPU memory (see
    /// `checkpoint::save_shard` for the layout): the whole parameters
    /// [`checkpoint::assign_tensors`] gives it and their AdamW moments, per
    /// whole parameter so that they restore at any world size. At zero2
    /// the moment shards are all-gathered first (a collective every rank
    /// joins); nothing is written here.
    fn snapshot(&mut self) -> anyhow::Result<checkpoint::Snapshot> {
        let (rank, world) = (self.coll.rank(), self.coll.world_size());
        let elt = self.model.kind().elt_size_in_bytes();
        let sizes: Vec<(String, usize)> = self
            .names
            .iter()
            .zip(&self.layout.numels)
            .map(|(n, &numel)| (n.clone(), numel * elt))
            .collect();
        let (avg, avg_sq) = self.full_moments()?;
        let assigned = checkpoint::assign_tensors(&sizes, world);
        let mine: Vec<ShardEntry> = self
            .names
            .iter()
            .enumerate()
            .filter(|(_, n)| assigned[*n] == rank)
            .map(|(i, n)| ShardEntry {
                name: n.clone(),
                param: self.params[i].shallow_clone(),
                exp_avg: avg[i].shallow_clone(),
                exp_avg_sq: avg_sq[i].shallow_clone(),
            })
            .collect();
        Ok(checkpoint::Snapshot::new(
            rank,
            world,
            &self.model.raw_config,
            self.model.kind(),
            self.opt.step,
            sizes,
            mine,
        ))
    }

    /// AdamW moments per whole parameter (zero2: all-gathered from the
    /// ranks' shards, a collective every rank must join).
    fn full_moments(&mut self) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        if self.sharding == Sharding::Ddp {
            let c = |v: &[Tensor]| -> Vec<Tensor> { v.iter().map(Tensor::shallow_clone).collect() };
            return Ok((c(&self.opt.exp_avg), c(&self.opt.exp_avg_sq)));
        }
        let device = self.model.vs.device();
        let range = self.shard();
        let mut out = Vec::with_capacity(2);
        for which in 0..2 {
            let mut full = Tensor::zeros([self.layout.total as i64], (Kind::Float, device));
            let local = if which == 0 {
                &self.opt.exp_avg[0]
            } else {
                &self.opt.exp_avg_sq[0]
            };
            full.narrow(0, range.start as i64, range.len() as i64)
                .copy_(local);
            self.collective(Op::AllGather, &mut full)?;
            out.push(self.layout.views(&full));
        }
        let avg_sq = out.pop().unwrap_or_default();
        let avg = out.pop().unwrap_or_default();
        Ok((avg, avg_sq))
    }

    /// HF names → shallow clones of the parameters (sorted by name).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    /// HF names → full parameters (every rank holds them at ddp and zero2;
    /// the same method on the FSDP engine gathers them).
    pub fn named_full_parameters(&mut self) -> anyhow::Result<Vec<(String, Tensor)>> {
        Ok(self.named_parameters())
    }

    /// HF names → the parameters' accumulated (this rank's, unreduced)
    /// gradients (tests).
    pub fn named_grads(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.params.iter().map(|p| p.grad()))
            .collect()
    }

    /// HF names → AdamW `(exp_avg, exp_avg_sq)` per whole parameter and the
    /// optimizer step count. At zero2 this gathers the shards: every rank
    /// must call it.
    pub fn optimizer_state(&mut self) -> anyhow::Result<(u64, Vec<NamedMoments>)> {
        let (avg, avg_sq) = self.full_moments()?;
        let state = self
            .names
            .iter()
            .cloned()
            .zip(avg.into_iter().zip(avg_sq))
            .map(|(n, (a, s))| (n, a, s))
            .collect();
        Ok((self.opt.step, state))
    }

    /// Bytes of parameters, gradients and optimizer state this rank holds.
    pub fn state_bytes(&self) -> StateBytes {
        let elt = self.model.kind().elt_size_in_bytes() as u64;
        let numel = self.layout.total as u64;
        let moments: u64 = self
            .opt
            .exp_avg
            .iter()
            .chain(&self.opt.exp_avg_sq)
            .map(|t| t.numel() as u64 * 4)
            .sum();
        StateBytes {
            params: numel * elt,
            grads: numel * elt,
            optimizer: moments,
            boundary: numel * 4,
        }
    }

    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// (rank, world size) of this trainer's collective.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.coll.rank(), self.coll.world_size())
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut Llama {
        &mut self.model
    }

    /// A token id outside the model's vocabulary is the plan's document's
    /// fault, refused before the embedding would panic on it.
    fn check_vocabulary(&self, index: usize, mb: &PackedBatch) -> anyhow::Result<()> {
        let vocab = self.model.cfg.vocab_size;
        match mb.input_ids.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(StepError::data(format!(
                "microbatch {index}: token {bad} outside the vocabulary ({vocab} tokens)"
            ))),
            None => Ok(()),
        }
    }

    /// Overrides `runtime.loss_chunk_tokens`.
    pub fn set_loss_chunk_tokens(&mut self, n: usize) {
        self.loss_chunk_tokens = n;
    }
}
