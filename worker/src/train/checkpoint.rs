//! Checkpoint files the trainer writes and restores from:
//! `config.json` + `model.safetensors` (HF layout, loadable by
//! `transformers.AutoModelForCausalLM.from_pretrained`),
//! `optimizer.safetensors` (`{param}.exp_avg`, `{param}.exp_avg_sq`) and
//! `trainer.json` (optimizer step count, dtype). The caller writes the
//! manifest (step, data cursor) next to them.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::model::weights;
use crate::model::Llama;

use super::optim::AdamW;

/// `trainer.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub format: u32,
    /// Optimizer updates taken (AdamW bias correction count).
    pub optimizer_step: u64,
    pub dtype: String,
}

pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Writes the model and optimizer to `dir` (created if missing).
pub fn save(
    dir: &Path,
    model: &Llama,
    names: &[String],
    params: &[Tensor],
    opt: &AdamW,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut config = model.raw_config.clone();
    if let Some(obj) = config.as_object_mut() {
        let dt = dtype_name(model.kind());
        obj.insert("torch_dtype".into(), dt.into());
        obj.insert("dtype".into(), dt.into());
    }
    let text = serde_json::to_string_pretty(&config)?;
    write_atomic(&dir.join("config.json"), text.as_bytes())?;
    let named: Vec<(String, Tensor)> = names
        .iter()
        .cloned()
        .zip(params.iter().map(|p| p.shallow_clone()))
        .collect();
    weights::write_tensors(&dir.join("model.safetensors"), &named, BTreeMap::new())?;
    let mut state = Vec::with_capacity(2 * names.len());
    for (i, n) in names.iter().enumerate() {
        state.push((format!("{n}.exp_avg"), opt.exp_avg[i].shallow_clone()));
        state.push((format!("{n}.exp_avg_sq"), opt.exp_avg_sq[i].shallow_clone()));
    }
    let meta = BTreeMap::from([("step".to_string(), opt.step.to_string())]);
    weights::write_tensors(&dir.join("optimizer.safetensors"), &state, meta)?;
    let ts = TrainerState {
        format: 1,
        optimizer_step: opt.step,
        dtype: dtype_name(model.kind()).into(),
    };
    write_atomic(
        &dir.join("trainer.json"),
        serde_json::to_string_pretty(&ts)?.as_bytes(),
    )?;
    Ok(())
}

/// Restores optimizer moments and step count from `dir` into `opt`.
pub fn load_optimizer(dir: &Path, names: &[String], opt: &mut AdamW) -> anyhow::Result<()> {
    let ts_path = dir.join("trainer.json");
    let ts: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(&ts_path)
            .with_context(|| format!("reading {}", ts_path.display()))?,
    )
    .with_context(|| format!("parsing {}", ts_path.display()))?;
    let path = dir.join("optimizer.safetensors");
    let tensors = weights::read_tensors(std::slice::from_ref(&path))?;
    if tensors.len() != 2 * names.len() {
        bail!(
            "{}: {} tensors, expected {} (exp_avg and exp_avg_sq for {} parameters)",
            path.display(),
            tensors.len(),
            2 * names.len(),
            names.len()
        );
    }
    for (i, n) in names.iter().enumerate() {
        for (key, dst) in [
            (format!("{n}.exp_avg"), &mut opt.exp_avg[i]),
            (format!("{n}.exp_avg_sq"), &mut opt.exp_avg_sq[i]),
        ] {
            let t = tensors
                .get(&key)
                .with_context(|| format!("{}: missing tensor {key}", path.display()))?;
            if t.size() != dst.size() {
                bail!(
                    "{}: tensor {key} has shape {:?}, expected {:?}",
                    path.display(),
                    t.size(),
                    dst.size()
                );
            }
            tch::no_grad(|| dst.copy_(&t.to_kind(Kind::Float)));
        }
    }
    opt.step = ts.optimizer_step;
    Ok(())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}
