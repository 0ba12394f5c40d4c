//! Checkpoint files the trainer writes and restores from:
//! `config.json` + `model.safetensors` (HF layout, loadable by
//! `transformers.AutoModelForCausalLM.from_pretrained`),
//! `optimizer.safetensors` (`{param}.exp_avg`, `{param}.exp_avg_sq`) and
//! `trainer.json` (optimizer step count, dtype). The caller writes the
//! manifest (step, data cursor) next to them.
//!
//! With several ranks ([`save_shard`]) every rank writes, in parallel, the
//! whole tensors [`assign_tensors`] gives it as one file of a Hugging Face
//! sharded checkpoint (`model-0000i-of-0000n.safetensors`, rank 0 adds
//! `model.safetensors.index.json`), and their AdamW moments as
//! `optimizer-0000i-of-0000n.safetensors`. Moments are stored per whole
//! parameter whatever the sharding level, so a checkpoint restores at any
//! world size and level ([`load_optimizer_tensors`]).
//!
//! Writing is split for asynchronous checkpoints (issue 6): a trainer's
//! `checkpoint_snapshot` copies what its rank writes into CPU memory (a
//! [`Snapshot`], gathering through collectives where needed), and
//! [`Snapshot::write`] writes it later on a background thread, without
//! collectives. `accrue_checkpoint` makes a directory's completeness checkable.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::model::weights;

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

/// Which rank writes each tensor: largest first onto the least-loaded rank
/// (bytes), ties broken by name, so every rank computes the same answer.
pub fn assign_tensors(sizes: &[(String, usize)], world: usize) -> BTreeMap<String, usize> {
    let mut order: Vec<&(String, usize)> = sizes.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut load = vec![0usize; world.max(1)];
    let mut out = BTreeMap::new();
    for (name, bytes) in order {
        let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[rank] += bytes;
        out.insert(name.clone(), rank);
    }
    out
}

/// `model-0000{rank+1}-of-0000{world}.safetensors` (HF's shard naming).
pub fn model_file(rank: usize, world: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", rank + 1, world)
}

/// `optimizer-0000{rank+1}-of-0000{world}.safetensors`.
pub fn optimizer_file(rank: usize, world: usize) -> String {
    format!("optimizer-{:05}-of-{:05}.safetensors", rank + 1, world)
}

/// One whole parameter a rank writes: HF name, value, AdamW moments.
pub struct ShardEntry {
    pub name: String,
    pub param: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
}

/// What one rank writes of a checkpoint, held in CPU memory until
/// [`Snapshot::write`] (see [`save_shard`] for the arguments' meaning).
pub struct Snapshot {
    pub rank: usize,
    pub world: usize,
    pub raw_config: serde_json::Value,
    pub kind: Kind,
    pub optimizer_step: u64,
    pub all_sizes: Vec<(String, usize)>,
    /// This rank's tensors, deep-copied to the CPU.
    pub mine: Vec<ShardEntry>,
}

impl Snapshot {
    /// Builds a snapshot, deep-copying `mine` to the CPU (training may
    /// change the originals as soon as this returns).
    pub fn new(
        rank: usize,
        world: usize,
        raw_config: &serde_json::Value,
        kind: Kind,
        optimizer_step: u64,
        all_sizes: Vec<(String, usize)>,
        mine: Vec<ShardEntry>,
    ) -> Snapshot {
        let cpu = |t: &Tensor| t.detach().to_device(tch::Device::Cpu).copy();
        let mine = mine
            .into_iter()
            .map(|e| ShardEntry {
                name: e.name,
                param: cpu(&e.param),
                exp_avg: cpu(&e.exp_avg),
                exp_avg_sq: cpu(&e.exp_avg_sq),
            })
            .collect();
        Snapshot {
            rank,
            world,
            raw_config: raw_config.clone(),
            kind,
            optimizer_step,
            all_sizes,
            mine,
        }
    }

    /// Writes the files ([`save_shard`]); returns their names in `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<Vec<String>> {
        save_shard(
            dir,
            self.rank,
            self.world,
            &self.raw_config,
            self.kind,
            self.optimizer_step,
            &self.all_sizes,
            &self.mine,
        )
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        self.mine
            .iter()
            .flat_map(|e| [&e.param, &e.exp_avg, &e.exp_avg_sq])
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }
}

/// A LoRA job's checkpoint, written whole by rank 0: the adapter folder
/// PEFT loads (`adapter_model.safetensors`, `adapter_config.json`), the
/// adapters' AdamW moments (`optimizer.safetensors`), `trainer.json`, the
/// base's `config.json`, and — when the base is a random init, which
/// exists nowhere else — the base weights (`model.safetensors`), so that
/// the folder is both the base model transformers loads and its adapter.
/// `adapter_config.json` names the base (`base_model_name_or_path`): the
/// job's `model.init`, or this folder.
pub struct AdapterSnapshot {
    raw_config: serde_json::Value,
    adapter_config: serde_json::Value,
    /// `model.init` of a pretrained base; `None`: a random one, written here.
    base_dir: Option<std::path::PathBuf>,
    base: Vec<(String, Tensor)>,
    optimizer_step: u64,
    entries: Vec<ShardEntry>,
}

impl AdapterSnapshot {
    /// Copies `entries` (the adapters and their moments) and, for a random
    /// base, the base weights to the CPU.
    pub fn new(
        model: &crate::model::Llama,
        cfg: &crate::config::JobConfig,
        optimizer_step: u64,
        entries: Vec<ShardEntry>,
    ) -> anyhow::Result<AdapterSnapshot> {
        let Some(adapters) = &model.adapters else {
            bail!("an adapter checkpoint of a model without adapters");
        };
        let base_dir = match &cfg.model {
            crate::config::ModelSource::Checkpoint(dir) => Some(dir.clone()),
            crate::config::ModelSource::Random { .. } => None,
        };
        let base = if base_dir.is_none() {
            let mut v: Vec<(String, Tensor)> = model
                .vs
                .variables()
                .into_iter()
                .filter(|(n, _)| !crate::model::lora::is_adapter(n))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        } else {
            Vec::new()
        };
        Ok(AdapterSnapshot::from_parts(
            &model.raw_config,
            crate::model::lora::adapter_config(adapters, ""),
            base_dir,
            base,
            optimizer_step,
            entries,
        ))
    }

    /// A snapshot of these parts (copied to the CPU): the base's config,
    /// the adapter config, where the base lives (`None`: `base`, the
    /// random init's weights, goes into the checkpoint), the adapters and
    /// their moments.
    pub fn from_parts(
        raw_config: &serde_json::Value,
        adapter_config: serde_json::Value,
        base_dir: Option<std::path::PathBuf>,
        base: Vec<(String, Tensor)>,
        optimizer_step: u64,
        entries: Vec<ShardEntry>,
    ) -> AdapterSnapshot {
        let cpu = |t: &Tensor| t.detach().to_device(tch::Device::Cpu).copy();
        AdapterSnapshot {
            raw_config: raw_config.clone(),
            adapter_config,
            base_dir,
            base: base.into_iter().map(|(n, t)| (n, cpu(&t))).collect(),
            optimizer_step,
            entries: entries
                .into_iter()
                .map(|e| ShardEntry {
                    name: e.name,
                    param: cpu(&e.param),
                    exp_avg: cpu(&e.exp_avg),
                    exp_avg_sq: cpu(&e.exp_avg_sq),
                })
                .collect(),
        }
    }

    /// Writes the files (see the type's docs); returns their names.
    pub fn write(&self, dir: &Path) -> anyhow::Result<Vec<String>> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut config = self.adapter_config.clone();
        let base = self.base_dir.as_deref().unwrap_or(dir);
        config["base_model_name_or_path"] = base.display().to_string().into();
        let adapters: Vec<(String, Tensor)> = self
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.param.shallow_clone()))
            .collect();
        let mut files = crate::model::lora::write_adapter_folder(dir, &adapters, &config)?;
        write_moments(
            dir,
            "optimizer.safetensors",
            &self.entries,
            self.optimizer_step,
        )?;
        write_trainer_state(dir, self.optimizer_step, Kind::Float)?;
        files.extend(["optimizer.safetensors".into(), "trainer.json".into()]);
        if !self.base.is_empty() {
            weights::write_tensors(&dir.join("model.safetensors"), &self.base, BTreeMap::new())?;
            files.push("model.safetensors".into());
        }
        write_config(
            dir,
            &self.raw_config,
            self.base.first().map(|(_, t)| t.kind()),
        )?;
        files.push("config.json".into());
        Ok(files)
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        let nbytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.entries
            .iter()
            .flat_map(|e| [&e.param, &e.exp_avg, &e.exp_avg_sq])
            .map(nbytes)
            .sum::<u64>()
            + self.base.iter().map(|(_, t)| nbytes(t)).sum::<u64>()
    }
}

/// Writes `entries`' AdamW moments (`{param}.exp_avg`, `.exp_avg_sq`) as
/// `dir/opt_name`, the step in its metadata.
fn write_moments(
    dir: &Path,
    opt_name: &str,
    entries: &[ShardEntry],
    optimizer_step: u64,
) -> anyhow::Result<()> {
    let mut state = Vec::with_capacity(2 * entries.len());
    for e in entries {
        state.push((format!("{}.exp_avg", e.name), e.exp_avg.shallow_clone()));
        state.push((
            format!("{}.exp_avg_sq", e.name),
            e.exp_avg_sq.shallow_clone(),
        ));
    }
    let meta = BTreeMap::from([("step".to_string(), optimizer_step.to_string())]);
    weights::write_tensors(&dir.join(opt_name), &state, meta)
}

/// Writes `trainer.json`.
fn write_trainer_state(dir: &Path, optimizer_step: u64, kind: Kind) -> anyhow::Result<()> {
    let ts = TrainerState {
        format: 1,
        optimizer_step,
        dtype: dtype_name(kind).into(),
    };
    write_atomic(
        &dir.join("trainer.json"),
        serde_json::to_string_pretty(&ts)?.as_bytes(),
    )
}

/// Writes `config.json`: `raw`, its dtype fields set to `kind`'s when
/// given.
fn write_config(dir: &Path, raw: &serde_json::Value, kind: Option<Kind>) -> anyhow::Result<()> {
    let mut config = raw.clone();
    if let (Some(obj), Some(kind)) = (config.as_object_mut(), kind) {
        let dt = dtype_name(kind);
        obj.insert("torch_dtype".into(), dt.into());
        obj.insert("dtype".into(), dt.into());
    }
    write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )
}

/// Writes this rank's part of a sharded checkpoint: its assigned tensors
/// (see [`assign_tensors`] over `all_sizes`, `(name, bytes)` of every
/// parameter) and their moments. Rank 0 also writes `config.json`, the
/// index and `trainer.json`. With `world == 1` this is `save`'s layout.
/// Returns the names of the files written.
#[allow(clippy::too_many_arguments)]
pub fn save_shard(
    dir: &Path,
    rank: usize,
    world: usize,
    raw_config: &serde_json::Value,
    kind: Kind,
    optimizer_step: u64,
    all_sizes: &[(String, usize)],
    mine: &[ShardEntry],
) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (model_name, opt_name) = if world == 1 {
        (
            "model.safetensors".to_string(),
            "optimizer.safetensors".to_string(),
        )
    } else {
        (model_file(rank, world), optimizer_file(rank, world))
    };
    let named: Vec<(String, Tensor)> = mine
        .iter()
        .map(|e| (e.name.clone(), e.param.shallow_clone()))
        .collect();
    weights::write_tensors(&dir.join(&model_name), &named, BTreeMap::new())?;
    write_moments(dir, &opt_name, mine, optimizer_step)?;
    let mut files = vec![model_name, opt_name];
    if rank != 0 {
        return Ok(files);
    }
    write_config(dir, raw_config, Some(kind))?;
    files.push("config.json".into());
    if world > 1 {
        let assignment = assign_tensors(all_sizes, world);
        let weight_map: BTreeMap<&String, String> = assignment
            .iter()
            .map(|(name, &r)| (name, model_file(r, world)))
            .collect();
        let total: usize = all_sizes.iter().map(|(_, b)| b).sum();
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        write_atomic(
            &dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?.as_bytes(),
        )?;
        files.push("model.safetensors.index.json".into());
    }
    write_trainer_state(dir, optimizer_step, kind)?;
    files.push("trainer.json".into());
    Ok(files)
}

/// The optimizer step count and every `{param}.exp_avg` / `.exp_avg_sq`
/// moment of a checkpoint, whichever world size wrote it.
pub fn load_optimizer_tensors(dir: &Path) -> anyhow::Result<(u64, HashMap<String, Tensor>)> {
    let ts_path = dir.join("trainer.json");
    let ts: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(&ts_path)
            .with_context(|| format!("reading {}", ts_path.display()))?,
    )
    .with_context(|| format!("parsing {}", ts_path.display()))?;
    let single = dir.join("optimizer.safetensors");
    let files: Vec<std::path::PathBuf> = if single.exists() {
        vec![single]
    } else {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("optimizer-") && n.ends_with(".safetensors"))
            })
            .collect();
        v.sort();
        if v.is_empty() {
            bail!(
                "{}: no optimizer state (optimizer*.safetensors)",
                dir.display()
            );
        }
        v
    };
    Ok((ts.optimizer_step, weights::read_tensors(&files)?))
}

/// Takes `{name}.exp_avg` / `.exp_avg_sq` for every parameter out of a
/// checkpoint's optimizer tensors (from [`load_optimizer_tensors`]), as f32
/// tensors shaped like `params`. A missing, extra or misshapen moment is an
/// error naming it.
pub fn take_moments(
    saved: &mut HashMap<String, Tensor>,
    names: &[String],
    params: &[Tensor],
    dir: &Path,
) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
    if saved.len() != 2 * names.len() {
        bail!(
            "{}: {} optimizer tensors, expected {} (exp_avg and exp_avg_sq for {} parameters)",
            dir.display(),
            saved.len(),
            2 * names.len(),
            names.len()
        );
    }
    let mut take = |key: String, want: &Tensor| -> anyhow::Result<Tensor> {
        let t = saved
            .remove(&key)
            .with_context(|| format!("{}: missing optimizer tensor {key}", dir.display()))?;
        if t.size() != want.size() {
            bail!(
                "{}: optimizer tensor {key} has shape {:?}, expected {:?}",
                dir.display(),
                t.size(),
                want.size()
            );
        }
        Ok(t.to_kind(Kind::Float).to_device(want.device()))
    };
    let mut avg = Vec::with_capacity(names.len());
    let mut avg_sq = Vec::with_capacity(names.len());
    for (n, p) in names.iter().zip(params) {
        avg.push(take(format!("{n}.exp_avg"), p)?);
        avg_sq.push(take(format!("{n}.exp_avg_sq"), p)?);
    }
    Ok((avg, avg_sq))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignment_balances_bytes_and_is_deterministic() {
        let sizes: Vec<(String, usize)> = [("a", 100), ("b", 60), ("c", 50), ("d", 40), ("e", 10)]
            .iter()
            .map(|(n, b)| (n.to_string(), *b))
            .collect();
        let a = assign_tensors(&sizes, 2);
        assert_eq!(a, assign_tensors(&sizes, 2));
        let load = |r| {
            sizes
                .iter()
                .filter(|(n, _)| a[n] == r)
                .map(|(_, b)| b)
                .sum::<usize>()
        };
        assert_eq!(load(0) + load(1), 260);
        assert!(
            load(0).abs_diff(load(1)) <= 20,
            "{} vs {}",
            load(0),
            load(1)
        );
        assert!(assign_tensors(&sizes, 1).values().all(|&r| r == 0));
    }

    #[test]
    fn shard_names_follow_hf() {
        assert_eq!(model_file(0, 2), "model-00001-of-00002.safetensors");
        assert_eq!(optimizer_file(1, 2), "optimizer-00002-of-00002.safetensors");
    }
}
