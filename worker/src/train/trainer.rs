//! The SFT trainer: forward + backward of packed microbatches with exact
//! accumulation, then one AdamW step.
//!
//! The math (DESIGN.md, "The math"): each microbatch backpropagates
//! `(1/T) Σ_{t∈mb} ℓ_t` with T the step's global loss-token count from the
//! plan; gradients are summed in place across microbatches and consumed once
//! by `optimizer_step`. Never divide by the number of microbatches: a short
//! microbatch must weigh less than a long one.

use std::path::Path;

use anyhow::{anyhow, bail, Context};
use tch::{Device, Kind, Tensor};

use crate::config::JobConfig;
use crate::model::{loss, weights, Llama, LlamaConfig};

use super::batch::PackedBatch;
use super::checkpoint;
use super::optim::{self, AdamW, AdamWConfig};

/// Metric sums of one microbatch (turned into means by the coordinator).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MicrobatchSums {
    /// Σ per-token NLL (unscaled).
    pub loss_sum: f64,
    pub loss_tokens: u64,
    pub tokens: u64,
    pub documents: u64,
}

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global L2 norm before clipping.
    pub grad_norm: f64,
}

/// Serialises seeded random init (see [`Trainer::new`]).
static SEEDED_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Model + optimizer of one worker.
pub struct Trainer {
    model: Llama,
    names: Vec<String>,
    params: Vec<Tensor>,
    opt: AdamW,
    grad_clip: f64,
    loss_chunk_tokens: usize,
}

fn parse_kind(dtype: &str) -> anyhow::Result<Kind> {
    match dtype {
        "float32" | "fp32" | "f32" => Ok(Kind::Float),
        "bfloat16" | "bf16" => Ok(Kind::BFloat16),
        other => bail!("model.dtype: expected float32 or bfloat16, got {other}"),
    }
}

/// Builds the model from a HF checkpoint directory (config.json + safetensors).
pub fn load_model(dir: &Path, kind: Kind, device: Device) -> anyhow::Result<Llama> {
    let (cfg, raw) = LlamaConfig::from_file(&dir.join("config.json"))?;
    let model = Llama::new(cfg, raw, kind, device)?;
    let files = weights::checkpoint_files(dir)?;
    let tensors = weights::read_tensors(&files)?;
    weights::copy_into(&model.vs.variables(), &tensors, dir)?;
    Ok(model)
}

impl Trainer {
    /// Builds the model from `cfg.model` (`init = "random"` with the HF
    /// config.json at `cfg.model.config`, seeded by `cfg.job.seed`; or a HF
    /// checkpoint dir), or restores model + optimizer from a checkpoint dir
    /// written by [`Trainer::save_checkpoint`].
    pub fn new(cfg: &JobConfig, restore_from: Option<&Path>) -> anyhow::Result<Trainer> {
        let kind = parse_kind(&cfg.model.dtype)?;
        let device = Device::cuda_if_available();
        let model = match restore_from {
            Some(dir) => load_model(dir, kind, device)
                .with_context(|| format!("restoring model from {}", dir.display()))?,
            None if cfg.model.init == "random" => {
                let path = cfg
                    .model
                    .config
                    .as_ref()
                    .context("model.config: required when model.init = \"random\"")?;
                let (mcfg, raw) = LlamaConfig::from_file(path)?;
                // libtorch's generator is process-global: two trainers built
                // at once (threads, tests) would interleave its draws and
                // break the seed's reproducibility, so seeding + init is one
                // critical section.
                let _init = SEEDED_INIT.lock().unwrap_or_else(|p| p.into_inner());
                tch::manual_seed(cfg.job.seed as i64);
                Llama::new(mcfg, raw, kind, device)?
            }
            None => {
                let dir = Path::new(&cfg.model.init);
                load_model(dir, kind, device)
                    .with_context(|| format!("model.init: loading {}", dir.display()))?
            }
        };
        let [beta1, beta2] = cfg.optimizer.betas;
        let adam = AdamWConfig {
            beta1,
            beta2,
            eps: cfg.optimizer.eps,
            weight_decay: cfg.optimizer.weight_decay,
        };
        let mut vars: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let (names, params): (Vec<String>, Vec<Tensor>) = vars.into_iter().unzip();
        let mut opt = AdamW::new(adam, &params);
        if let Some(dir) = restore_from {
            checkpoint::load_optimizer(dir, &names, &mut opt)
                .with_context(|| format!("restoring optimizer from {}", dir.display()))?;
        }
        Ok(Trainer {
            model,
            names,
            params,
            opt,
            grad_clip: cfg.optimizer.grad_clip,
            loss_chunk_tokens: cfg.runtime.loss_chunk_tokens,
        })
    }

    /// Forward + backward of one microbatch; the loss is scaled by
    /// `1/global_loss_tokens` and gradients ACCUMULATE (never zeroed here).
    /// A non-finite loss is an error naming the microbatch; nothing is
    /// applied to the gradients then.
    pub fn microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchSums> {
        let mut sums = MicrobatchSums {
            tokens: mb.tokens() as u64,
            documents: mb.documents() as u64,
            ..Default::default()
        };
        if mb.is_empty() {
            return Ok(sums);
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        if targets.iter().all(|&t| t == -100) {
            // No loss token: zero gradient, skip the forward.
            return Ok(sums);
        }
        if global_loss_tokens == 0 {
            bail!(
                "microbatch {index}: has loss tokens but the step's global loss-token count is 0"
            );
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
        .map_err(|e| anyhow!("microbatch {index}: {e:#}"))?;
        loss::backward_into_model(&hidden, head, &chunked);
        sums.loss_sum = chunked.loss_sum;
        sums.loss_tokens = chunked.loss_tokens;
        Ok(sums)
    }

    /// Global-norm clip, AdamW step at `lr`, then zero grads. A non-finite
    /// gradient norm is an error; the parameters stay untouched and the
    /// gradients are discarded.
    pub fn optimizer_step(&mut self, lr: f64) -> anyhow::Result<StepStats> {
        let norm = optim::grad_norm(&self.params);
        if !norm.is_finite() {
            self.zero_grad();
            bail!("non-finite gradient norm {norm}; parameters left unchanged");
        }
        if !lr.is_finite() {
            self.zero_grad();
            bail!("non-finite learning rate {lr}; parameters left unchanged");
        }
        if self.grad_clip > 0.0 {
            optim::clip_grads(&self.params, norm, self.grad_clip);
        }
        self.opt.step(&self.params, lr);
        self.zero_grad();
        Ok(StepStats { grad_norm: norm })
    }

    /// Discards accumulated gradients (aborted step).
    pub fn zero_grad(&mut self) {
        for p in &self.params {
            p.shallow_clone().zero_grad();
        }
    }

    /// Writes config.json, model.safetensors, optimizer.safetensors and
    /// trainer.json to `dir`.
    pub fn save_checkpoint(&self, dir: &Path) -> anyhow::Result<()> {
        checkpoint::save(dir, &self.model, &self.names, &self.params, &self.opt)
    }

    /// HF names → shallow clones of the parameters (sorted by name).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    /// HF names → the parameters' accumulated gradients (tests).
    pub fn named_grads(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.params.iter().map(|p| p.grad()))
            .collect()
    }

    /// HF names → AdamW `(exp_avg, exp_avg_sq)` (tests).
    pub fn optimizer_state(&self) -> (u64, Vec<(String, Tensor, Tensor)>) {
        let state = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (
                    n.clone(),
                    self.opt.exp_avg[i].shallow_clone(),
                    self.opt.exp_avg_sq[i].shallow_clone(),
                )
            })
            .collect();
        (self.opt.step, state)
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut Llama {
        &mut self.model
    }

    /// Overrides `runtime.loss_chunk_tokens`.
    pub fn set_loss_chunk_tokens(&mut self, n: usize) {
        self.loss_chunk_tokens = n;
    }
}
