//! FSDP full-shard training (`parallel.sharding = "fsdp"`, DESIGN.md "Ranks
//! and collectives"): parameters, gradients and AdamW moments are sharded per
//! unit; a unit's full parameters exist only while it runs.
//!
//! Units are the embedding, each decoder layer, and the head (final norm +
//! untied LM head); see [`units`]. Each unit's parameters are one flat
//! float32 buffer of which this rank keeps only its [`shard_range`]
//! (the master copy, whatever the compute dtype).
//!
//! A microbatch (the math of DESIGN.md "The math", as in [`ReplicatedTrainer`](crate::train::ReplicatedTrainer)):
//! 1. forward, unit by unit: all-gather the unit, run it without autograd,
//!    keep only its input activation, free the gathered parameters;
//! 2. head: all-gather, chunked LM head + cross-entropy scaled by `1/T`
//!    (T = the step's global loss-token count from the plan), gradient of
//!    the final hidden state and of the head, reduce-scatter the head's
//!    gradient into the accumulating shard;
//! 3. backward, layer by layer in reverse: all-gather again, recompute the
//!    layer from its saved input with autograd, backpropagate the upstream
//!    gradient, reduce-scatter the parameter gradient and ADD this rank's
//!    part into its gradient shard, free;
//! 4. embedding: its gradient needs only the token ids and the upstream
//!    gradient (`embedding_dense_backward`), so it is not gathered again.
//!
//! Lockstep: every rank must issue the same collectives. A microbatch opens
//! with a two-number all-reduce (ranks with work, ranks that failed to
//! prepare theirs): if no rank has a loss token every rank skips the
//! microbatch with no further collective; otherwise every rank takes part,
//! ranks without work (padding microbatches) contributing zeros. A second
//! all-reduce after the loss makes every rank stop, before any gradient is
//! applied, when one rank's loss is not finite.
//!
//! DPO and policy gradient (see `objective`) replace step 2's
//! cross-entropy with the objective's per-token weights on the gathered
//! head; reference plans run steps 1 and 2 forward only on the initial
//! weights. A live reference (a frozen full copy per rank) is refused.
//!
//! Generation rounds gather the whole model for the round's duration
//! (`policy`).
//!
//! Follows PyTorch FSDP (`FlatParameter` per wrapped module, reshard after
//! forward, pre-backward all-gather) — Zhao et al., "PyTorch FSDP", 2023.

mod objective;
mod pass;
mod policy;
mod shell;
mod sync;
pub mod units;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context};
use tch::{nn, Device, Kind, Tensor};

use crate::batch::{MicrobatchOutcome, PackedBatch};
use crate::collective::{shard_range, Collective};
use crate::config::{JobConfig, ModelSource};
use crate::error::StepError;
use crate::model::config::Arch;
use crate::model::norm::RmsNorm;
use crate::model::rope::Rope;
use crate::model::{weights, ModelConfig, PackedAttention};
use crate::objective::Objective;

use super::checkpoint::{self, ShardEntry};
use super::memory::StateBytes;
use super::optim::{self, AdamW, Segment};
use super::source::build_model;
use super::trainer::{CheckpointWrite, Checkpointing, Passes as _, Policy, StepStats, Trainer};
use shell::LayerShell;
use units::UnitLayout;

/// One rank of an FSDP group: its shards of every unit, and the shells
/// that run a unit on gathered parameters.
pub struct FsdpTrainer {
    coll: Box<dyn Collective>,
    cfg: ModelConfig,
    raw_config: serde_json::Value,
    /// Compute dtype (the shards are float32).
    kind: Kind,
    /// Parameter dtype (`model.dtype`): what checkpoints hold; bfloat16
    /// (pure bf16) also rounds the master shards after every update.
    param_kind: Kind,
    /// Per unit: the weight-decay runs of this rank's shard.
    segments: Vec<Vec<Segment>>,
    /// `optimizer.no_decay`, to cut the runs again for a new layout.
    no_decay: Vec<String>,
    device: Device,
    layouts: Vec<UnitLayout>,
    /// Per unit: this rank's shard of the flat parameters.
    params: Vec<Tensor>,
    /// Per unit: this rank's shard of the accumulated gradient.
    grads: Vec<Tensor>,
    /// Moments of `params`, in unit order.
    opt: AdamW,
    shells: Vec<LayerShell>,
    _norm_vs: nn::VarStore,
    norm: RmsNorm,
    /// RoPE tables (one, or Gemma 3's global and sliding).
    ropes: Vec<Rope>,
    /// Embeddings × this (Gemma).
    embed_scale: Option<f64>,
    grad_clip: f64,
    loss_chunk_tokens: usize,
    /// The job's objective (a live reference is refused in [`Self::new`]).
    objective: Objective,
    /// Built from a checkpoint (`restore`): its weights are not the job's
    /// initial ones, so it cannot run reference plans.
    restored: bool,
    /// Packed-attention implementation (as `Llama::attention`).
    pub attention: PackedAttention,
    /// The family's variants (its sparse layers, the final-logit soft-cap).
    arch: Arch,
    /// The step's load-balancing weights (`train::routing`), from
    /// `begin_step` to the optimizer step.
    step_aux: Option<Tensor>,
    /// A LoRA job (`lora`): the base's units are frozen, each layer's
    /// adapters are a unit of their own.
    lora: Option<FsdpLora>,
    /// `job.seed` (LoRA dropout masks).
    seed: u64,
    /// Context parallelism (`parallel.context`, issue 37): the group this
    /// rank splits every row with (`crate::model::context`); shared so a
    /// pass can hold it while it gathers units over `coll`.
    context: Option<Group>,
}

/// A context-parallel group's collective.
type Group = std::sync::Arc<std::sync::Mutex<Box<dyn Collective>>>;

/// What a LoRA job adds to the FSDP trainer. The base's units are sharded
/// like any unit but frozen: their shards are held in the compute dtype,
/// with no gradient and no AdamW moments, and are never reduced. Each
/// layer's adapters form one more unit (float32, sharded, gathered,
/// reduce-scattered and updated as a full fine-tuning unit is).
struct FsdpLora {
    config: crate::config::LoraConfig,
    /// Turns every shell's adapters off (the reference is the base).
    switch: crate::model::lora::Switch,
    /// Per decoder layer, its adapters' unit.
    units: Vec<Option<usize>>,
    /// The pretrained base's folder (`model.init`); `None`: a random init,
    /// which checkpoints then carry.
    base_dir: Option<std::path::PathBuf>,
}

/// Config and full tensors of a HF checkpoint directory.
fn read_hf_dir(
    dir: &Path,
) -> anyhow::Result<(ModelConfig, serde_json::Value, HashMap<String, Tensor>)> {
    let (cfg, raw) = ModelConfig::from_file(&dir.join("config.json"))?;
    let tensors = weights::read_tensors(&weights::checkpoint_files(dir)?)?;
    Ok((cfg, raw, tensors))
}

/// Whether unit `u` trains: every unit, or only a LoRA job's adapter units.
fn trains_unit(lora: Option<&FsdpLora>, u: usize) -> bool {
    lora.is_none_or(|l| l.units.contains(&Some(u)))
}

impl FsdpTrainer {
    /// Builds this rank's shards: every rank builds the same model once
    /// (seeded random init through [`ReplicatedTrainer::new`](crate::train::ReplicatedTrainer::new), a HF checkpoint at
    /// `cfg.model.init`, or `restore` — a checkpoint written by any
    /// trainer at any world size, optimizer moments included), keeps its
    /// shards and drops the full copy. No collective is called.
    pub fn new(
        cfg: &JobConfig,
        restore: Option<&Path>,
        coll: Box<dyn Collective>,
    ) -> anyhow::Result<FsdpTrainer> {
        let objective = cfg.objective;
        // A LoRA job's reference is its own base (adapters off): no copy.
        if objective.live_reference() && cfg.lora.is_none() {
            bail!(
                "objective.reference = \"live\" with parallel.sharding = \"fsdp\": \
                 fsdp supports reference = \"cached\" only (a live reference keeps a \
                 frozen full copy of the model on every rank, which fsdp exists to avoid)"
            );
        }
        let kind = cfg.precision.compute;
        let device = cfg.device;
        let (mcfg, raw, tensors, source) = match (restore, &cfg.model) {
            // LoRA: the base from `model.init` with its adapters (from the
            // checkpoint, `lora.init` or PEFT's init), built once.
            _ if cfg.lora.is_some() => {
                let m = build_model(cfg, restore)?;
                let named = m.vs.variables().into_iter().collect();
                let source =
                    restore.map_or_else(|| "model.init".into(), |d| d.display().to_string());
                (m.cfg.clone(), m.raw_config.clone(), named, source)
            }
            (Some(dir), _) => {
                let (c, r, t) = read_hf_dir(dir)
                    .with_context(|| format!("restoring model from {}", dir.display()))?;
                (c, r, t, dir.display().to_string())
            }
            (None, ModelSource::Random { .. }) => {
                let m = build_model(cfg, None)?;
                let named = m.vs.variables().into_iter().collect();
                (
                    m.cfg.clone(),
                    m.raw_config.clone(),
                    named,
                    "random init".into(),
                )
            }
            (None, ModelSource::Checkpoint(dir)) => {
                let (c, r, t) = read_hf_dir(dir)
                    .with_context(|| format!("model.init: loading {}", dir.display()))?;
                (c, r, t, dir.display().to_string())
            }
        };
        let targets = match &cfg.lora {
            Some(l) => Some(crate::model::lora::targets_per_layer(&mcfg.arch()?, l)?),
            None => None,
        };
        let switch = crate::model::lora::Switch::new();
        let shell_adapters = match (&cfg.lora, &targets) {
            (Some(lora), Some(targets)) => Some(shell::ShellAdapters {
                lora,
                targets,
                switch: &switch,
            }),
            _ => None,
        };
        let shells: Vec<LayerShell> = (0..mcfg.num_hidden_layers)
            .map(|i| LayerShell::new(&mcfg, i, kind, device, shell_adapters.as_ref()))
            .collect();
        let layer_names: Vec<Vec<String>> = shells.iter().map(|s| s.names()).collect();
        let adapter_names: Vec<Vec<String>> = shells.iter().map(|s| s.adapter_names()).collect();
        let layouts = units::build_layouts(&mcfg, &layer_names, &adapter_names, &tensors, &source)?;
        let lora = cfg.lora.as_ref().map(|config| FsdpLora {
            config: config.clone(),
            switch: switch.clone(),
            units: units::adapter_units(&adapter_names),
            base_dir: match &cfg.model {
                ModelSource::Checkpoint(dir) => Some(dir.clone()),
                ModelSource::Random { .. } => None,
            },
        });
        let trains = |u: usize| trains_unit(lora.as_ref(), u);
        let (rank, world) = (coll.rank(), coll.world_size());
        let mut params = Vec::with_capacity(layouts.len());
        for (u, l) in layouts.iter().enumerate() {
            let flat = l.flatten_named(&tensors, "", &source)?;
            let shard = l.take_shard(&flat, world, rank).to_device(device);
            // A frozen unit is held in the compute dtype only.
            params.push(if trains(u) {
                shard
            } else {
                shard.to_kind(kind)
            });
        }
        drop(tensors);
        let empty = || Tensor::zeros([0], (Kind::Float, device));
        let grads = params
            .iter()
            .enumerate()
            .map(|(u, p)| {
                if trains(u) {
                    Tensor::zeros_like(p)
                } else {
                    empty()
                }
            })
            .collect();
        let segments = layouts
            .iter()
            .enumerate()
            .map(|(u, l)| {
                if trains(u) {
                    l.segments(world, rank, &cfg.no_decay)
                } else {
                    Vec::new()
                }
            })
            .collect();
        let adam = cfg.optimizer;
        let lens: Vec<usize> = params
            .iter()
            .enumerate()
            .map(|(u, p)| if trains(u) { p.numel() } else { 0 })
            .collect();
        let mut opt = AdamW::new(adam, &lens, device);
        if let Some(dir) = restore {
            let (step, moments) = checkpoint::load_optimizer_tensors(dir)
                .with_context(|| format!("restoring optimizer from {}", dir.display()))?;
            let source = format!("{} (optimizer state)", dir.display());
            for (u, l) in layouts.iter().enumerate().filter(|(u, _)| trains(*u)) {
                for (suffix, dst) in [
                    (".exp_avg", &mut opt.exp_avg),
                    (".exp_avg_sq", &mut opt.exp_avg_sq),
                ] {
                    let flat = l.flatten_named(&moments, suffix, &source)?;
                    dst[u] = l.take_shard(&flat, world, rank).to_device(device);
                }
            }
            opt.step = step;
        }
        let arch = mcfg.arch()?;
        let ropes = arch
            .ropes
            .iter()
            .map(|r| Rope::new(mcfg.head_dim(), r.theta, &r.scaling))
            .collect();
        let (norm_vs, norm) = shell::norm_shell(&mcfg, device);
        Ok(FsdpTrainer {
            coll,
            cfg: mcfg,
            raw_config: raw,
            kind,
            param_kind: cfg.dtype,
            segments,
            no_decay: cfg.no_decay.clone(),
            device,
            layouts,
            params,
            grads,
            opt,
            shells,
            _norm_vs: norm_vs,
            norm,
            ropes,
            embed_scale: arch.embed_scale,
            grad_clip: cfg.grad_clip,
            loss_chunk_tokens: cfg.loss_chunk_tokens,
            objective,
            restored: restore.is_some(),
            attention: PackedAttention::default(),
            arch: arch.clone(),
            step_aux: None,
            lora,
            seed: cfg.seed,
            context: None,
        })
    }

    /// Context parallelism: every microbatch's row split over `group`
    /// (this rank and the others given the same microbatches); a group of
    /// one is no split.
    pub fn with_context(mut self, group: Box<dyn Collective>) -> FsdpTrainer {
        self.context =
            (group.world_size() > 1).then(|| std::sync::Arc::new(std::sync::Mutex::new(group)));
        self
    }

    /// The LoRA dropout masks' keys of a training forward of `mb` (none
    /// without dropout).
    fn dropout_keys(&self, mb: &PackedBatch) -> Option<crate::model::lora::DropoutKeys> {
        self.lora.as_ref().filter(|l| l.config.dropout > 0.0)?;
        Some(crate::model::lora::DropoutKeys::new(
            self.seed,
            self.opt.step,
            &mb.input_ids,
            &mb.cu_seq_lens,
        ))
    }

    /// Whether unit `u` trains (every unit, or a LoRA job's adapters).
    fn trains(&self, u: usize) -> bool {
        trains_unit(self.lora.as_ref(), u)
    }

    /// Runs `f` with the adapters off (a LoRA job's reference: the base).
    fn without_adapters<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let Some(switch) = self.lora.as_ref().map(|l| l.switch.clone()) else {
            return f(self);
        };
        switch.set(false);
        let out = f(self);
        switch.set(true);
        out
    }

    pub fn rank(&self) -> usize {
        self.coll.rank()
    }

    /// The model's architecture.
    pub fn model_config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn world_size(&self) -> usize {
        self.coll.world_size()
    }

    /// Forward + backward of one microbatch (a collective: every rank calls
    /// it for every microbatch index of the step, padding ones included).
    /// The loss is scaled by `1/global_loss_tokens`; this rank's gradient
    /// shards ACCUMULATE. Returns this rank's metric sums.
    pub fn microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome> {
        self.run_microbatch(index, mb, None, global_loss_tokens)
    }

    /// The full parameters, gathered, in the compute dtype, with HF names
    /// sorted by name (as [`ReplicatedTrainer::named_parameters`](crate::train::ReplicatedTrainer::named_parameters); a collective).
    pub fn named_full_parameters(&mut self) -> anyhow::Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for u in 0..self.layouts.len() {
            let flat = self.gather(u)?;
            for s in &self.layouts[u].slots {
                out.push((
                    s.name.clone(),
                    s.view(&flat).to_kind(self.param_kind).copy(),
                ));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Parameter, gradient and optimizer bytes this rank holds between
    /// steps (gathered units and activations are transient and not counted;
    /// see [`largest_unit_bytes`](Self::largest_unit_bytes)).
    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |ts: &[Tensor]| -> u64 {
            ts.iter()
                .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum()
        };
        let (mut trained, mut frozen) = (Vec::new(), Vec::new());
        for (u, p) in self.params.iter().enumerate() {
            let side = if self.trains(u) {
                &mut trained
            } else {
                &mut frozen
            };
            side.push(p.shallow_clone());
        }
        StateBytes {
            params: bytes(&trained),
            grads: bytes(&self.grads),
            optimizer: bytes(&self.opt.exp_avg) + bytes(&self.opt.exp_avg_sq),
            // Units are cast to the compute dtype as they are gathered.
            compute_copy: 0,
            // One unit's gradient at a time, before its reduce-scatter.
            backward: self.largest_unit_bytes() / 4 * self.kind.elt_size_in_bytes() as u64,
            // The transient gather buffer of the largest unit.
            boundary: self.largest_unit_bytes(),
            frozen: bytes(&frozen),
        }
    }

    /// The float32 bytes of the largest unit: the transient all-gather
    /// buffer a forward or backward holds on top of [`state_bytes`](Self::state_bytes).
    pub fn largest_unit_bytes(&self) -> u64 {
        self.layouts
            .iter()
            .map(|l| l.numel as u64 * 4)
            .max()
            .unwrap_or(0)
    }

    /// The optimizer's step count.
    pub fn optimizer_steps(&self) -> u64 {
        self.opt.step
    }

    /// Overrides `runtime.loss_chunk_tokens`.
    pub fn set_loss_chunk_tokens(&mut self, n: usize) {
        self.loss_chunk_tokens = n;
    }

    // ---- collectives ------------------------------------------------------

    /// The unit's full flat float32 parameters.
    fn gather(&mut self, u: usize) -> anyhow::Result<Tensor> {
        let shard = self.params[u].shallow_clone();
        self.gather_shard(u, &shard)
    }

    /// All-gathers a per-unit shard (parameters or a moment).
    fn gather_shard(&mut self, u: usize, shard: &Tensor) -> anyhow::Result<Tensor> {
        let layout = &self.layouts[u];
        let r = shard_range(layout.numel, self.coll.world_size(), self.coll.rank());
        let mut full = Tensor::zeros([layout.numel as i64], (Kind::Float, self.device));
        full.narrow(0, r.start as i64, r.len() as i64).copy_(shard);
        self.coll
            .all_gather(&mut full)
            .with_context(|| format!("fsdp: all_gather of {}", layout.name))?;
        Ok(full)
    }

    /// Reduce-scatters a unit's flat gradient and adds this rank's part to
    /// its accumulating shard.
    fn scatter_grad(&mut self, u: usize, mut flat: Tensor) -> anyhow::Result<()> {
        let layout = &self.layouts[u];
        self.coll
            .reduce_scatter_sum(&mut flat)
            .with_context(|| format!("fsdp: reduce_scatter of {}", layout.name))?;
        let r = shard_range(layout.numel, self.coll.world_size(), self.coll.rank());
        let _ = self.grads[u].g_add_(&flat.narrow(0, r.start as i64, r.len() as i64));
        Ok(())
    }

    /// All-reduces small per-rank counters so every rank takes the same
    /// branch of microbatch `index`.
    fn agree<const N: usize>(
        &mut self,
        index: usize,
        what: &str,
        local: [f32; N],
    ) -> anyhow::Result<[f32; N]> {
        self.agree_f32(what, local)
            .with_context(|| format!("microbatch {index}"))
    }

    fn agree_f32<const N: usize>(
        &mut self,
        what: &str,
        local: [f32; N],
    ) -> anyhow::Result<[f32; N]> {
        let mut t = Tensor::from_slice(&local).to_device(self.device);
        self.coll
            .all_reduce_sum(&mut t)
            .with_context(|| format!("fsdp: all_reduce of {what}"))?;
        let v = Vec::<f32>::try_from(&t.to_device(Device::Cpu))?;
        v.try_into()
            .map_err(|_| anyhow!("fsdp: all_reduce of {what} changed the length"))
    }

    /// A gathered float32 buffer in the compute dtype.
    fn compute(&self, flat: &Tensor) -> Tensor {
        if self.kind == Kind::Float {
            flat.shallow_clone()
        } else {
            flat.to_kind(self.kind)
        }
    }
}

impl Checkpointing for FsdpTrainer {
    /// Copies what this rank writes of a checkpoint to CPU memory (a
    /// collective): every unit and its moments are gathered, unit by unit,
    /// and the whole tensors [`checkpoint::assign_tensors`] gives this rank
    /// are kept. Nothing is written here.
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        if self.lora.is_some() {
            return self.adapter_snapshot();
        }
        let elt = self.param_kind.elt_size_in_bytes();
        let sizes: Vec<(String, usize)> = self
            .layouts
            .iter()
            .flat_map(|l| l.slots.iter().map(|s| (s.name.clone(), s.numel * elt)))
            .collect();
        let (rank, world) = (self.rank(), self.world_size());
        let assignment = checkpoint::assign_tensors(&sizes, world);
        let mut mine = Vec::new();
        for u in 0..self.layouts.len() {
            let p = self.gather_shard(u, &self.params[u].shallow_clone())?;
            let m = self.gather_shard(u, &self.opt.exp_avg[u].shallow_clone())?;
            let v = self.gather_shard(u, &self.opt.exp_avg_sq[u].shallow_clone())?;
            for s in &self.layouts[u].slots {
                if assignment.get(&s.name) == Some(&rank) {
                    mine.push(ShardEntry {
                        name: s.name.clone(),
                        param: s.view(&p).to_kind(self.param_kind).copy(),
                        exp_avg: s.view(&m).copy(),
                        exp_avg_sq: s.view(&v).copy(),
                    });
                }
            }
        }
        let snap = checkpoint::Snapshot::new(
            rank,
            world,
            &self.raw_config,
            self.param_kind,
            self.opt.step,
            sizes,
            mine,
        );
        Ok(Box::new(move |dir| snap.write(dir)))
    }
}

impl Trainer for FsdpTrainer {
    /// A collective; the gradient shards are zeroed whatever the outcome.
    fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let result = self.boundary(lr);
        self.zero_grad();
        result
    }

    /// A collective: the full parameters are gathered for the round.
    fn policy(&mut self, ready: bool) -> anyhow::Result<Policy<'_>> {
        Ok(Policy::Gathered(Box::new(self.gather_policy(ready)?)))
    }

    fn device(&self) -> tch::Device {
        self.device
    }
}

impl FsdpTrainer {
    /// A LoRA job's checkpoint (a collective): every rank gathers the
    /// adapter units with their moments (and a random base's units, which
    /// exist nowhere else); rank 0 writes them as
    /// `checkpoint::AdapterSnapshot`, the other ranks nothing.
    fn adapter_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let Some(lora) = &self.lora else {
            bail!("an adapter checkpoint of a job without [lora]");
        };
        let (config, base_dir) = (lora.config.clone(), lora.base_dir.clone());
        let mut entries = Vec::new();
        let mut base = Vec::new();
        let mut modules = Vec::new();
        for u in 0..self.layouts.len() {
            if self.trains(u) {
                let p = self.gather(u)?;
                let m = self.gather_shard(u, &self.opt.exp_avg[u].shallow_clone())?;
                let v = self.gather_shard(u, &self.opt.exp_avg_sq[u].shallow_clone())?;
                for s in &self.layouts[u].slots {
                    if let Some(module) = s.name.strip_suffix(".lora_A.weight") {
                        modules.push(module.to_string());
                    }
                    entries.push(ShardEntry {
                        name: s.name.clone(),
                        param: s.view(&p).copy(),
                        exp_avg: s.view(&m).copy(),
                        exp_avg_sq: s.view(&v).copy(),
                    });
                }
            } else if base_dir.is_none() {
                let p = self.gather(u)?;
                for s in &self.layouts[u].slots {
                    base.push((s.name.clone(), s.view(&p).to_kind(self.kind).copy()));
                }
            }
        }
        if self.rank() != 0 {
            return Ok(Box::new(|_| Ok(Vec::new())));
        }
        base.sort_by(|a, b| a.0.cmp(&b.0));
        let adapter_config = crate::model::lora::adapter_config_of(&config, &modules, "");
        let snap = checkpoint::AdapterSnapshot::from_parts(
            &self.raw_config,
            adapter_config,
            base_dir,
            base,
            self.opt.step,
            entries,
        );
        Ok(Box::new(move |dir| snap.write(dir)))
    }

    /// The accumulation boundary (see `Trainer::optimizer_step`): the
    /// global norm over every rank's shards, clip, AdamW on this rank's
    /// shards (a collective). A non-finite norm or learning rate is an
    /// error on every rank; nothing is applied.
    fn boundary(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let local = optim::sum_of_squares(&self.grads);
        let [total] = self.agree_f32("gradient norm", [local as f32])?;
        let norm = (total as f64).sqrt();
        if !norm.is_finite() {
            return Err(StepError::non_finite(format!(
                "gradient norm {norm}; parameters left unchanged"
            )));
        }
        if !lr.is_finite() {
            return Err(StepError::invalid(format!(
                "non-finite learning rate {lr}; parameters left unchanged"
            )));
        }
        let scale = optim::clip_coefficient(norm, self.grad_clip).unwrap_or(1.0);
        self.opt
            .update(&self.params, &self.grads, &self.segments, lr, scale);
        if self.param_kind != Kind::Float && self.lora.is_none() {
            // Pure bfloat16: the replicated trainer keeps its parameters in
            // that dtype; round the master shards the same way.
            tch::no_grad(|| {
                for p in &mut self.params {
                    let rounded = p.to_kind(self.param_kind).to_kind(Kind::Float);
                    p.copy_(&rounded);
                }
            });
        }
        Ok(StepStats { grad_norm: norm })
    }
}
