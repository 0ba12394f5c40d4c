//! Where a replica's model comes from: the job's init (a seeded random
//! init, or a Hugging Face directory) or a checkpoint of ours; and the
//! frozen copy of the initial model that reference log-probs are taken on.
//! Both trainers build from here.

use std::path::Path;

use anyhow::Context;
use tch::{Device, Kind};

use crate::config::{JobConfig, ModelSource};
use crate::model::{weights, Init, Llama, ModelConfig};

/// Builds the model from a HF checkpoint directory (config.json + safetensors).
pub fn load_model(dir: &Path, kind: Kind, device: Device) -> anyhow::Result<Llama> {
    let (cfg, raw) = ModelConfig::from_file(&dir.join("config.json"))?;
    let model = Llama::new(cfg, raw, kind, device, Init::Empty)?;
    let files = weights::checkpoint_files(dir)?;
    let tensors = weights::read_tensors(&files)?;
    weights::copy_into(&model.vs.variables(), &tensors, dir)?;
    Ok(model)
}

/// The model of `cfg.model` (seeded random init or a HF directory), or the
/// one saved in `restore_from`. A LoRA job's base always comes from
/// `cfg.model`, in the compute dtype, with its adapters from
/// `restore_from`, else `lora.init`, else PEFT's initialisation.
pub fn build_model(cfg: &JobConfig, restore_from: Option<&Path>) -> anyhow::Result<Llama> {
    if let Some(lora) = &cfg.lora {
        let mut model = base_model(cfg, cfg.precision.compute)?;
        crate::model::lora::attach(&mut model, lora, cfg.seed)?;
        if let Some(dir) = restore_from {
            crate::model::lora::load_adapter(&model, dir)
                .with_context(|| format!("restoring adapters from {}", dir.display()))?;
        }
        return Ok(model);
    }
    match restore_from {
        Some(dir) => load_model(dir, cfg.dtype, cfg.device)
            .with_context(|| format!("restoring model from {}", dir.display())),
        None => base_model(cfg, cfg.dtype),
    }
}

/// The job's initial model (`cfg.model`) in `kind`.
fn base_model(cfg: &JobConfig, kind: Kind) -> anyhow::Result<Llama> {
    let device = cfg.device;
    match &cfg.model {
        ModelSource::Random { config } => {
            let (mcfg, raw) = ModelConfig::from_file(config)?;
            // Every rank draws the same init from the same seed, from its
            // own generator (see `model::init`).
            Llama::new(mcfg, raw, kind, device, Init::Seeded(cfg.seed))
        }
        ModelSource::Checkpoint(dir) => load_model(dir, kind, device)
            .with_context(|| format!("model.init: loading {}", dir.display())),
    }
}

/// Freezes a model used only for reference log-probs.
pub(super) fn frozen(model: Llama) -> Llama {
    for (_, t) in model.vs.variables() {
        let _ = t.set_requires_grad(false);
    }
    model
}
