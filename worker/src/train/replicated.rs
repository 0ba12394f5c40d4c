//! The data-parallel trainer: forward + backward of packed microbatches
//! with exact accumulation, then one AdamW step, replicated (`ddp`) or with
//! gradients and optimizer state sharded over ranks (`zero2`).
//!
//! The math (DESIGN.md, "The math"): each microbatch backpropagates
//! `(1/T) Σ_{t∈mb} ℓ_t` with T the step's global loss-token count from the
//! plan, identical on every rank; gradients are summed across microbatches
//! and across ranks. Never divide by the number of microbatches or ranks:
//! a short microbatch must weigh less than a long one.
//!
//! State, all in one flat layout ([`FlatLayout`], the weight-decay group
//! first): the master weights (`model.dtype`; the model's variables are
//! views of one flat buffer), the float32 gradient accumulator (see
//! `grads`) and the AdamW moments. With mixed precision
//! (`precision.compute` ≠ `model.dtype`) forward and backward run on a
//! compute-dtype copy of the model, refreshed from the masters after every
//! update; its gradients are summed in float32.
//! - `ddp`: gradients accumulate whole and are all-reduced at the
//!   boundary; every rank clips with the global norm and updates its full
//!   replica.
//! - `zero2`: gradients are reduce-scattered into each rank's float32
//!   shard after every microbatch; at the boundary each rank takes the
//!   global norm as `sqrt(Σ_ranks Σ_shard g²)`, updates its shard of the
//!   master weights with its shard of the moments, and all-gathers them.

mod grads;
mod objectives;
mod state;
mod sync;

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};

use crate::batch::{MicrobatchOutcome, PackedBatch};
use crate::collective::{shard_range, Collective, CollectiveError, Solo};
use crate::config::{self, JobConfig};
use crate::error::StepError;
use crate::model::context::RowShard;
use crate::model::recompute::VarGroups;
use crate::model::{loss, Init, Llama, PackedAttention, Routes};
use crate::objective::Objective;

use super::checkpoint;
use super::flat::FlatLayout;
use super::optim::{self, AdamW};
use super::source::{build_model, frozen};
use super::trainer::{Passes as _, Policy, StepStats, Trainer};
use grads::Grads;

pub use grads::BUCKET_ELEMENTS;

/// This trainer's two sharding levels (fsdp is the other trainer,
/// `train::fsdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Replicated parameters and optimizer state; gradients all-reduced.
    Ddp,
    /// Replicated parameters; gradients reduce-scattered during the step,
    /// optimizer state sharded by flat element range.
    Zero2,
}

impl Sharding {
    fn of(s: config::Sharding) -> anyhow::Result<Sharding> {
        match s {
            config::Sharding::Ddp => Ok(Sharding::Ddp),
            config::Sharding::Zero2 => Ok(Sharding::Zero2),
            config::Sharding::Fsdp => {
                bail!("parallel.sharding = \"fsdp\" runs on the sharded trainer (FsdpTrainer), not the replicated one")
            }
        }
    }
}

/// Model + optimizer of one rank.
pub struct ReplicatedTrainer {
    /// The master weights (`model.dtype`); its variables are views of
    /// `flat_params`.
    model: Llama,
    /// Mixed precision: the compute-dtype copy forward/backward run on.
    compute: Option<Llama>,
    /// HF names, sorted.
    names: Vec<String>,
    /// The master variables, in `names` order.
    params: Vec<Tensor>,
    /// The variables the backward differentiates (the compute copy's, or
    /// `params`), in `names` order.
    compute_params: Vec<Tensor>,
    groups: VarGroups,
    layout: FlatLayout,
    flat_params: Tensor,
    sharding: Sharding,
    coll: Box<dyn Collective>,
    grads: Grads,
    /// One flat moment pair: the whole layout at ddp, this rank's shard at
    /// zero2.
    opt: AdamW,
    grad_clip: f64,
    loss_chunk_tokens: usize,
    checkpointing: bool,
    /// Gradient reduction dtype.
    reduce: Kind,
    objective: Objective,
    /// A frozen copy of the initial model: `reference = "live"`, or built
    /// on demand for a reference plan once this replica has trained.
    reference: Option<Llama>,
    /// Whether `model` still holds the job's initial weights.
    pristine: bool,
    /// The job config, to rebuild the initial model for a reference plan.
    init: JobConfig,
    /// The step's load-balancing weights (`train::routing`), from
    /// `begin_step` to the optimizer step.
    step_aux: Option<Tensor>,
    /// Context parallelism (`parallel.context`, issue 37): this rank's
    /// group, whose ranks share every microbatch's row.
    context: Option<Mutex<Box<dyn Collective>>>,
}

/// The experts `mb` replays on `model`'s sparse layers (none for a dense
/// model or a microbatch without routing); a routing that does not fit
/// the model is the plan's error, naming the microbatch.
pub(crate) fn replay_of(
    model: &Llama,
    index: usize,
    mb: &PackedBatch,
) -> anyhow::Result<Vec<Tensor>> {
    crate::model::moe::replay_tensors(&mb.routing, mb.tokens(), &model.arch, model.vs.device())
        .map_err(|e| StepError::invalid(format!("microbatch {index}: {e}")))
}

/// The collective operations the trainer runs on flat buffers.
#[derive(Clone, Copy)]
enum Op {
    AllReduce,
    AllGather,
}

/// Points each variable at its place in `flat` (PyTorch's
/// `param.data = view`): the optimizer then updates the model in place.
fn bind(params: &[Tensor], layout: &FlatLayout, flat: &Tensor) {
    for (p, v) in params.iter().zip(layout.views(flat)) {
        p.shallow_clone().set_data(&v);
    }
}

impl ReplicatedTrainer {
    /// Builds the model from `cfg.model` (`init = "random"` with the HF
    /// config.json at `cfg.model.config`, seeded by `cfg.job.seed`; or a HF
    /// checkpoint dir), or restores model + optimizer from a checkpoint dir
    /// written by [`Checkpointing::save_checkpoint`](crate::train::Checkpointing::save_checkpoint) at any world size, on
    /// `cfg.device`. `coll` is this rank's membership in the generation
    /// (`Solo` for one rank).
    pub fn new(
        cfg: &JobConfig,
        restore_from: Option<&Path>,
        coll: Box<dyn Collective>,
    ) -> anyhow::Result<ReplicatedTrainer> {
        let sharding = Sharding::of(cfg.sharding)?;
        let model = build_model(cfg, restore_from)?;
        // Every variable, or a LoRA job's adapters (its base is frozen).
        let (names, params): (Vec<String>, Vec<Tensor>) = model.trainable().into_iter().unzip();
        let decay: Vec<bool> = names
            .iter()
            .map(|n| optim::decays(n, &cfg.no_decay))
            .collect();
        let layout = FlatLayout::grouped(&params, &decay);
        let device = model.vs.device();
        // Adapters are float32 whatever the base's dtype.
        let master = if cfg.lora.is_some() {
            Kind::Float
        } else {
            cfg.dtype
        };
        let flat_params = tch::no_grad(|| layout.flatten(&params, device).to_kind(master));
        bind(&params, &layout, &flat_params);
        let groups = VarGroups::new(
            &names,
            model.cfg.num_hidden_layers,
            model.cfg.tie_word_embeddings,
        );
        let compute = if cfg.mixed() {
            let m = Llama::new(
                model.cfg.clone(),
                model.raw_config.clone(),
                cfg.precision.compute,
                device,
                Init::Empty,
            )?;
            Some(m)
        } else {
            None
        };
        let compute_params = match &compute {
            Some(m) => {
                let mut v: Vec<(String, Tensor)> = m.vs.variables().into_iter().collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                v.into_iter().map(|(_, t)| t).collect()
            }
            None => params.iter().map(Tensor::shallow_clone).collect(),
        };
        let shard = shard_range(layout.total, coll.world_size(), coll.rank());
        let opt_range = match sharding {
            Sharding::Ddp => 0..layout.total,
            Sharding::Zero2 => shard,
        };
        let mut opt = AdamW::new(cfg.optimizer, &[opt_range.len()], device);
        if let Some(dir) = restore_from {
            let (step, mut saved) = checkpoint::load_optimizer_tensors(dir)
                .with_context(|| format!("restoring optimizer from {}", dir.display()))?;
            let (avg, avg_sq) = checkpoint::take_moments(&mut saved, &names, &params, dir)?;
            layout.copy_range_into(&opt.exp_avg[0], &avg, opt_range.clone());
            layout.copy_range_into(&opt.exp_avg_sq[0], &avg_sq, opt_range);
            opt.step = step;
        }
        let grads = Grads::new(&layout, sharding == Sharding::Zero2, coll.as_ref(), device);
        let objective = cfg.objective;
        // A LoRA job's reference is its base with the adapters off.
        let reference = if objective.live_reference() && cfg.lora.is_none() {
            Some(reference_model(cfg)?)
        } else {
            None
        };
        let mut t = ReplicatedTrainer {
            model,
            compute,
            names,
            params,
            compute_params,
            groups,
            layout,
            flat_params,
            sharding,
            coll,
            grads,
            opt,
            grad_clip: cfg.grad_clip,
            loss_chunk_tokens: cfg.loss_chunk_tokens,
            checkpointing: cfg.activation_checkpointing,
            reduce: cfg.precision.reduce,
            objective,
            reference,
            pristine: restore_from.is_none(),
            init: cfg.clone(),
            step_aux: None,
            context: None,
        };
        t.refresh_compute();
        Ok(t)
    }

    /// A single-rank trainer ([`Solo`] collective).
    pub fn single(
        cfg: &JobConfig,
        restore_from: Option<&Path>,
    ) -> anyhow::Result<ReplicatedTrainer> {
        ReplicatedTrainer::new(cfg, restore_from, Box::new(Solo))
    }

    /// Context parallelism (issue 37): every microbatch's row is split
    /// over `group` (this rank and the others given the same microbatches,
    /// `crate::model::context`), each rank training its share; the
    /// data-parallel reduction over the trainer's collective sums the
    /// shares. A group of one is no split.
    pub fn with_context(mut self, group: Box<dyn Collective>) -> ReplicatedTrainer {
        self.context = (group.world_size() > 1).then(|| Mutex::new(group));
        self
    }

    /// Whether only LoRA adapters train.
    fn lora(&self) -> bool {
        self.model.adapters.is_some()
    }

    /// The LoRA dropout masks' keys of a training forward of `mb` (none
    /// without dropout).
    fn dropout_keys(&self, mb: &PackedBatch) -> Option<crate::model::lora::DropoutKeys> {
        self.init.lora.as_ref().filter(|l| l.dropout > 0.0)?;
        Some(crate::model::lora::DropoutKeys::new(
            self.init.seed,
            self.opt.step,
            &mb.input_ids,
            &mb.cu_seq_lens,
        ))
    }

    /// The model forward/backward run on (the compute copy, or the masters).
    fn net(&self) -> &Llama {
        self.compute.as_ref().unwrap_or(&self.model)
    }

    /// Copies the master weights into the compute copy (mixed precision).
    fn refresh_compute(&mut self) {
        if self.compute.is_none() {
            return;
        }
        tch::no_grad(|| {
            for (c, p) in self.compute_params.iter().zip(&self.params) {
                c.shallow_clone().copy_(p);
            }
        });
    }

    /// Forward + backward of one microbatch; the loss is scaled by
    /// `1/global_loss_tokens` and gradients ACCUMULATE (never zeroed here).
    /// A non-finite loss is an error naming the microbatch; nothing is
    /// applied to the gradients then. An empty (padding) microbatch adds
    /// nothing; at zero2 every rank calls this for every microbatch index
    /// (the gradient reduce-scatter is a collective).
    pub fn microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let (sums, grads) = self.sft_grads(index, mb, global_loss_tokens)?;
        self.absorb(&grads)?;
        Ok(sums)
    }

    /// The SFT loss sums and gradients of one microbatch (nothing applied).
    fn sft_grads(
        &self,
        index: usize,
        mb: &PackedBatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<(MicrobatchOutcome, Vec<Tensor>)> {
        let mut sums = MicrobatchOutcome {
            tokens: mb.tokens() as u64,
            ..Default::default()
        };
        if mb.is_empty() {
            return Ok((sums, Vec::new()));
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        if targets.iter().all(|&t| t == -100) {
            // No loss token: zero gradient, skip the forward.
            return Ok((sums, Vec::new()));
        }
        if global_loss_tokens == 0 {
            return Err(StepError::invalid(format!(
                "microbatch {index}: has loss tokens but the step's global loss-token count is 0"
            )));
        }
        if let Some(group) = &self.context {
            let mut group = group.lock().unwrap_or_else(|p| p.into_inner());
            return self.sft_grads_context(index, mb, &targets, global_loss_tokens, group.as_mut());
        }
        let net = self.net();
        let routes = self.routes(index, mb)?;
        let keys = self.dropout_keys(mb);
        let fwd = crate::model::lora::with_dropout(keys.clone(), || {
            net.forward_train(&mb.input_ids, &mb.cu_seq_lens, self.checkpointing, &routes)
        });
        let aux_share = fwd.aux_share;
        let head = net.lm_head_weight();
        let chunked = loss::chunked_nll_with(
            &fwd.hidden,
            head,
            &targets,
            self.loss_chunk_tokens,
            1.0 / global_loss_tokens as f64,
            net.arch.final_softcap,
            self.groups.head.is_some(),
        )
        .with_context(|| format!("microbatch {index}"))?;
        let grads = crate::model::lora::with_dropout(keys, || {
            net.backward_train(
                fwd,
                &chunked.grad_hidden,
                &chunked.grad_weight,
                &self.compute_params,
                &self.groups,
            )
        });
        sums.loss_sum = chunked.loss_sum;
        sums.loss_tokens = chunked.loss_tokens;
        let norms = crate::batch::StepNorms {
            loss_tokens: global_loss_tokens,
            pairs: 0,
            sequences: 0,
        };
        self.report_routing(aux_share, &norms, mb, &mut sums);
        Ok((sums, grads))
    }

    /// [`Self::sft_grads`] of this rank's share of `mb`'s row under context
    /// parallelism: every rank of the group runs it for every microbatch
    /// (each layer's attention is a collective of the group), and every
    /// rank reports the row's sums (its ranks' shares summed over the
    /// group), so a group answers its plan rank as one rank would.
    fn sft_grads_context(
        &self,
        index: usize,
        mb: &PackedBatch,
        targets: &[i64],
        global_loss_tokens: u64,
        group: &mut dyn Collective,
    ) -> anyhow::Result<(MicrobatchOutcome, Vec<Tensor>)> {
        let net = self.net();
        if self.model.arch.moe.is_some() || self.dropout_keys(mb).is_some() {
            return Err(StepError::invalid(format!(
                "microbatch {index}: context parallelism does not run mixture-of-experts models or LoRA dropout yet"
            )));
        }
        let shard = RowShard::new(
            &mb.cu_seq_lens,
            group.world_size() as i64,
            group.rank() as i64,
        );
        let ids = shard.take(&mb.input_ids);
        let local = shard.take(targets);
        let fwd = net
            .forward_train_context(&ids, &shard, group, &Routes::default())
            .with_context(|| format!("microbatch {index}"))?;
        let chunked = loss::chunked_nll_with(
            &fwd.hidden,
            net.lm_head_weight(),
            &local,
            self.loss_chunk_tokens,
            1.0 / global_loss_tokens as f64,
            net.arch.final_softcap,
            self.groups.head.is_some(),
        )
        .with_context(|| format!("microbatch {index}"))?;
        let grads = net.backward_train_context(
            fwd,
            &chunked.grad_hidden,
            &chunked.grad_weight,
            &self.compute_params,
            &self.groups,
            group,
        )?;
        let shares = [chunked.loss_sum, chunked.loss_tokens as f64];
        let row = crate::model::context::sum_values(group, &shares)
            .with_context(|| format!("microbatch {index}: summing the loss over the group"))?;
        let sums = MicrobatchOutcome {
            tokens: mb.tokens() as u64,
            loss_sum: row[0],
            loss_tokens: row[1].round() as u64,
            ..Default::default()
        };
        Ok((sums, grads))
    }

    /// How a training forward of `mb` routes: the experts its generation
    /// used where it carries them (routing replay), and the step's
    /// load-balancing weights when the loss is on. A microbatch run
    /// outside a step (probes, tests) takes them from its own counts.
    fn routes(&self, index: usize, mb: &PackedBatch) -> anyhow::Result<Routes> {
        let replay = replay_of(self.net(), index, mb)?;
        let Some(spec) = self.aux_spec() else {
            return Ok(Routes { replay, aux: None });
        };
        let aux = match &self.step_aux {
            Some(a) => Some(a.shallow_clone()),
            None => {
                let counts = self.local_counts(std::slice::from_ref(mb))?;
                super::routing::aux_weights(&counts, &spec, self.net().vs.device())
            }
        };
        Ok(Routes { replay, aux })
    }

    /// The MoE spec when the load-balancing loss is on.
    fn aux_spec(&self) -> Option<crate::model::config::MoeSpec> {
        self.model.arch.moe.filter(|m| m.aux_loss_coef > 0.0)
    }

    /// The expert counts of `batches` on this rank (forward only, routed
    /// as their training forward will be).
    fn local_counts(&self, batches: &[PackedBatch]) -> anyhow::Result<Vec<i64>> {
        let net = self.net();
        let experts = net.arch.moe.map_or(0, |m| m.experts);
        let mut total = vec![0i64; experts];
        for (i, mb) in batches.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
            let routes = Routes {
                replay: replay_of(net, i, mb)?,
                aux: None,
            };
            // Routed as the training forward will be, dropout included.
            crate::model::lora::with_dropout(self.dropout_keys(mb), || {
                tch::no_grad(|| net.hidden_routed(&mb.input_ids, &mb.cu_seq_lens, &routes))
            })
            .add_counts(&mut total)?;
        }
        Ok(total)
    }

    /// Adds the load-balancing loss's and routing replay's metric sums to
    /// `sums`.
    fn report_routing(
        &self,
        share: Option<f64>,
        norms: &crate::batch::StepNorms,
        mb: &PackedBatch,
        sums: &mut MicrobatchOutcome,
    ) {
        super::routing::report(&mut sums.extra, share, self.aux_spec(), norms, mb);
    }

    /// Adds one microbatch's gradients to the accumulator (zero2: a
    /// reduce-scatter into this rank's shard, every rank joins).
    fn absorb(&mut self, grads: &[Tensor]) -> anyhow::Result<()> {
        self.grads
            .absorb(&self.layout, grads, self.coll.as_mut(), self.reduce)
    }

    /// The accumulation boundary (see [`Trainer::optimizer_step`]): reduce
    /// the gradient (all-reduce at ddp; zero2 reduced it per microbatch),
    /// clip with the global norm, AdamW at `lr` (one pass over the flat
    /// buffers, the clip factor applied inside), all-gather the master
    /// shards at zero2. A non-finite norm is an error; every rank sees the
    /// same global norm, so all of them refuse together and leave their
    /// parameters untouched.
    ///
    /// [`Trainer::optimizer_step`]: crate::train::Trainer::optimizer_step
    fn boundary(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let mut flat = self.grads.take_flat(&self.layout);
        let norm = match self.sharding {
            Sharding::Ddp => {
                if self.coll.world_size() > 1 {
                    grads::round_to(&mut flat, self.reduce);
                    self.collective(Op::AllReduce, &mut flat)?;
                    grads::round_to(&mut flat, self.reduce);
                }
                optim::sum_of_squares(std::slice::from_ref(&flat)).sqrt()
            }
            Sharding::Zero2 => {
                // Σg² over this rank's shard, summed over ranks: the norm of
                // the whole gradient, not of the shard.
                let mine = optim::sum_of_squares(std::slice::from_ref(&flat)) as f32;
                let mut sq = Tensor::from_slice(&[mine]).to_device(self.coll.device());
                self.collective(Op::AllReduce, &mut sq)?;
                (f32::try_from(&sq.to_device(Device::Cpu))? as f64).sqrt()
            }
        };
        if !norm.is_finite() {
            return Err(StepError::non_finite(format!(
                "gradient norm {norm}; parameters left unchanged"
            )));
        }
        let scale = optim::clip_coefficient(norm, self.grad_clip).unwrap_or(1.0);
        let range = match self.sharding {
            Sharding::Ddp => 0..self.layout.total,
            Sharding::Zero2 => self.shard(),
        };
        let mine = self
            .flat_params
            .narrow(0, range.start as i64, range.len() as i64);
        let segments = self.layout.segments(range);
        self.opt.update(&[mine], &[flat], &[segments], lr, scale);
        if self.sharding == Sharding::Zero2 {
            self.gather_params()?;
        }
        self.refresh_compute();
        Ok(StepStats { grad_norm: norm })
    }

    /// All-gathers the master weights' shards (zero2).
    fn gather_params(&mut self) -> anyhow::Result<()> {
        if self.flat_params.kind() == Kind::Float {
            let mut flat = self.flat_params.shallow_clone();
            return Ok(self.collective(Op::AllGather, &mut flat)?);
        }
        // The collectives move float32.
        let mut full = self.flat_params.to_kind(Kind::Float);
        self.collective(Op::AllGather, &mut full)?;
        tch::no_grad(|| self.flat_params.copy_(&full));
        Ok(())
    }

    /// This rank's element range of the flat layout.
    fn shard(&self) -> std::ops::Range<usize> {
        shard_range(self.layout.total, self.coll.world_size(), self.coll.rank())
    }

    /// Runs `op` on a flat f32 buffer, through the collective's device when
    /// the buffer lives elsewhere. A no-op at world 1.
    fn collective(&mut self, op: Op, t: &mut Tensor) -> Result<(), CollectiveError> {
        if self.coll.world_size() == 1 {
            return Ok(());
        }
        let device = self.coll.device();
        let coll = self.coll.as_mut();
        let mut run = |t: &mut Tensor| match op {
            Op::AllReduce => coll.all_reduce_sum(t),
            Op::AllGather => coll.all_gather(t),
        };
        if t.device() == device {
            return run(t);
        }
        let mut moved = t.to_device(device);
        run(&mut moved)?;
        tch::no_grad(|| t.copy_(&moved));
        Ok(())
    }

    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// (rank, world size) of this trainer's collective.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.coll.rank(), self.coll.world_size())
    }

    /// The master model (its variables are the trained parameters).
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model forward and backward run on (the compute copy under mixed
    /// precision): benchmarks time the phases of a microbatch with it.
    pub fn compute_model(&self) -> &Llama {
        self.net()
    }

    /// The backward of a training forward of [`Self::compute_model`] from
    /// its loss's gradients, accumulated like a microbatch's (benchmarks;
    /// zero2: a collective).
    pub fn backward(
        &mut self,
        fwd: crate::model::recompute::Forward,
        grad_hidden: &Tensor,
        grad_head: &Tensor,
    ) -> anyhow::Result<()> {
        let grads = self.net().backward_train(
            fwd,
            grad_hidden,
            grad_head,
            &self.compute_params,
            &self.groups,
        );
        self.absorb(&grads)
    }

    /// Sets the packed-attention implementation of the model(s) run.
    pub fn set_attention(&mut self, mode: PackedAttention) {
        self.model.attention = mode;
        if let Some(c) = &mut self.compute {
            c.attention = mode;
        }
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

    /// Overrides `runtime.activation_checkpointing`.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }
}

/// The frozen initial model reference log-probs are taken on, in the
/// compute dtype.
fn reference_model(cfg: &JobConfig) -> anyhow::Result<Llama> {
    let mut m = build_model(cfg, None)?;
    if cfg.mixed() {
        m.vs.set_kind(cfg.precision.compute);
    }
    Ok(frozen(m))
}

impl Trainer for ReplicatedTrainer {
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

    fn device(&self) -> tch::Device {
        self.model.vs.device()
    }

    /// ddp and zero2 hold every parameter on every rank.
    fn policy(&mut self, _ready: bool) -> anyhow::Result<Policy<'_>> {
        Ok(Policy::Held(self.compute_model()))
    }
}
