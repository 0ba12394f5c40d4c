//! The FSDP unit layout: which HF parameters form each unit, where each one
//! sits in the unit's flat float32 buffer, and which slice of that buffer a
//! rank owns ([`shard_range`]). Pure bookkeeping: no collectives here.
//!
//! Units, in order: the embedding (`model.embed_tokens.weight`), one unit
//! per decoder layer (`model.layers.{i}.*`), and the head
//! (`model.norm.weight`, plus `lm_head.weight` when untied). A tied LM head
//! is the embedding unit's tensor; its gradient is reduce-scattered into the
//! embedding unit's shard.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use anyhow::{bail, Context};
use tch::{Device, Kind, Tensor};

use crate::collective::shard_range;
use crate::model::ModelConfig;
use crate::train::optim::{self, Segment};

/// One parameter inside a unit's flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// HF name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    pub shape: Vec<i64>,
    /// Offset in elements inside the unit's flat buffer.
    pub offset: usize,
    pub numel: usize,
}

impl Slot {
    /// This parameter as a view of the unit's flat buffer `flat`.
    pub fn view(&self, flat: &Tensor) -> Tensor {
        flat.narrow(0, self.offset as i64, self.numel as i64)
            .view(self.shape.as_slice())
    }
}

/// One unit: its parameters (sorted by name) laid out back to back.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitLayout {
    /// `model.embed_tokens`, `model.layers.{i}`, or `head`.
    pub name: String,
    pub slots: Vec<Slot>,
    pub numel: usize,
}

impl UnitLayout {
    /// Lays out `names` (sorted here) with the shapes in `shapes`.
    pub fn new(name: &str, mut names: Vec<String>, shapes: &HashMap<String, Vec<i64>>) -> Self {
        names.sort();
        let mut offset = 0;
        let slots = names
            .into_iter()
            .map(|n| {
                let shape = shapes[&n].clone();
                let numel = shape.iter().product::<i64>() as usize;
                let slot = Slot {
                    name: n,
                    shape,
                    offset,
                    numel,
                };
                offset += numel;
                slot
            })
            .collect();
        UnitLayout {
            name: name.into(),
            slots,
            numel: offset,
        }
    }

    /// The elements of the flat buffer that `rank` of `world` owns.
    pub fn shard(&self, world: usize, rank: usize) -> Range<usize> {
        shard_range(self.numel, world, rank)
    }

    /// Concatenates per-slot tensors (any dtype, slot shapes) into one flat
    /// float32 buffer in slot order.
    pub fn flatten(&self, parts: &[Tensor]) -> Tensor {
        assert_eq!(parts.len(), self.slots.len(), "one tensor per slot");
        // Undefined: a parameter the loss did not reach (an expert no
        // token chose), whose gradient is zero.
        let device = parts
            .iter()
            .find(|t| t.defined())
            .map_or(Device::Cpu, |t| t.device());
        let flat: Vec<Tensor> = parts
            .iter()
            .zip(&self.slots)
            .map(|(t, s)| {
                if t.defined() {
                    t.reshape([-1]).to_kind(Kind::Float)
                } else {
                    Tensor::zeros([s.numel as i64], (Kind::Float, device))
                }
            })
            .collect();
        Tensor::cat(&flat, 0)
    }

    /// Like [`flatten`](Self::flatten), looking each slot up by name in
    /// `tensors` (checkpoint restore).
    pub fn flatten_named(
        &self,
        tensors: &HashMap<String, Tensor>,
        suffix: &str,
        source: &str,
    ) -> anyhow::Result<Tensor> {
        let parts = self
            .slots
            .iter()
            .map(|s| {
                let key = format!("{}{suffix}", s.name);
                let t = tensors
                    .get(&key)
                    .with_context(|| format!("{source}: missing tensor {key}"))?;
                if t.size() != s.shape {
                    bail!(
                        "{source}: tensor {key} has shape {:?}, expected {:?}",
                        t.size(),
                        s.shape
                    );
                }
                Ok(t.shallow_clone())
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(self.flatten(&parts))
    }

    /// The shard of `rank`, copied out of a full flat buffer.
    pub fn take_shard(&self, flat: &Tensor, world: usize, rank: usize) -> Tensor {
        let r = self.shard(world, rank);
        flat.narrow(0, r.start as i64, r.len() as i64).copy()
    }

    /// The weight-decay runs of `rank`'s shard of this unit (relative to
    /// the shard's start) under `no_decay` (see `optim::decays`).
    pub fn segments(&self, world: usize, rank: usize, no_decay: &[String]) -> Vec<Segment> {
        let runs: Vec<Segment> = self
            .slots
            .iter()
            .map(|s| Segment {
                range: s.offset..s.offset + s.numel,
                decay: optim::decays(&s.name, no_decay),
            })
            .collect();
        optim::segments_within(&runs, self.shard(world, rank))
    }

    /// A zero flat buffer of this unit (a rank with nothing to contribute).
    pub fn zeros(&self, device: Device) -> Tensor {
        Tensor::zeros([self.numel as i64], (Kind::Float, device))
    }
}

/// Index of the embedding unit.
pub const EMBED: usize = 0;

/// Index of layer `i`'s unit.
pub fn layer_unit(i: usize) -> usize {
    1 + i
}

/// Index of the head unit (final norm, untied LM head).
pub fn head_unit(layers: usize) -> usize {
    1 + layers
}

/// The HF name of the embedding (also the tied LM head).
pub const EMBED_NAME: &str = "model.embed_tokens.weight";
pub const NORM_NAME: &str = "model.norm.weight";
pub const LM_HEAD_NAME: &str = "lm_head.weight";

/// Per decoder layer, the unit of its LoRA adapters: after the head, one
/// unit per layer that has adapters (`adapter_names[i]` non-empty).
pub fn adapter_units(adapter_names: &[Vec<String>]) -> Vec<Option<usize>> {
    let first = head_unit(adapter_names.len()) + 1;
    let mut next = first;
    adapter_names
        .iter()
        .map(|names| {
            (!names.is_empty()).then(|| {
                next += 1;
                next - 1
            })
        })
        .collect()
}

/// The unit layouts of a model: `layer_names[i]` are the parameter names of
/// decoder layer i, `adapter_names[i]` its LoRA adapters' (their units
/// follow the head, see [`adapter_units`]); shapes come from `tensors` (the
/// full model, or a checkpoint) and are checked against `cfg`. Every
/// tensor of `tensors` must be used, except those HF itself skips
/// (`rotary_emb.inv_freq`, and `lm_head.weight` of a tied model).
pub fn build_layouts(
    cfg: &ModelConfig,
    layer_names: &[Vec<String>],
    adapter_names: &[Vec<String>],
    tensors: &HashMap<String, Tensor>,
    source: &str,
) -> anyhow::Result<Vec<UnitLayout>> {
    let mut groups: Vec<(String, Vec<String>)> =
        vec![("model.embed_tokens".into(), vec![EMBED_NAME.into()])];
    for (i, names) in layer_names.iter().enumerate() {
        groups.push((format!("model.layers.{i}"), names.clone()));
    }
    let mut head = vec![NORM_NAME.to_string()];
    if !cfg.tie_word_embeddings {
        head.push(LM_HEAD_NAME.into());
    }
    groups.push(("head".into(), head));
    for (i, names) in adapter_names.iter().enumerate() {
        if !names.is_empty() {
            groups.push((format!("model.layers.{i} adapters"), names.clone()));
        }
    }

    let mut shapes = HashMap::new();
    let mut missing = Vec::new();
    for name in groups.iter().flat_map(|(_, n)| n) {
        match tensors.get(name) {
            Some(t) => {
                let want = expected_shape(name, cfg);
                if want.as_ref().is_some_and(|w| *w != t.size()) {
                    bail!(
                        "{source}: tensor {name} has shape {:?}, the model config expects {:?}",
                        t.size(),
                        want.unwrap_or_default()
                    );
                }
                shapes.insert(name.clone(), t.size());
            }
            None => missing.push(name.clone()),
        }
    }
    if !missing.is_empty() {
        missing.sort();
        bail!("{source}: missing tensors {}", missing.join(", "));
    }
    let used: HashSet<&String> = groups.iter().flat_map(|(_, n)| n).collect();
    let mut unexpected: Vec<&String> = tensors
        .keys()
        .filter(|k| !used.contains(k))
        .filter(|k| !k.ends_with("rotary_emb.inv_freq") && k.as_str() != LM_HEAD_NAME)
        .collect();
    if !unexpected.is_empty() {
        unexpected.sort();
        let list: Vec<&str> = unexpected.iter().map(|s| s.as_str()).collect();
        bail!(
            "{source}: tensors the model does not have: {}",
            list.join(", ")
        );
    }
    Ok(groups
        .into_iter()
        .map(|(unit, names)| UnitLayout::new(&unit, names, &shapes))
        .collect())
}

/// The shape `cfg` implies for a HF parameter name (`None`: not known here,
/// the checkpoint's shape is taken as is).
pub fn expected_shape(name: &str, cfg: &ModelConfig) -> Option<Vec<i64>> {
    let h = cfg.hidden_size as i64;
    let v = cfg.vocab_size as i64;
    let moe = cfg.arch().ok().and_then(|a| a.moe);
    // A MoE expert's own intermediate size.
    let i = match moe {
        Some(m) if name.contains(".mlp.experts.") => m.intermediate as i64,
        _ => cfg.intermediate_size as i64,
    };
    let q = (cfg.num_attention_heads * cfg.head_dim()) as i64;
    let kv = (cfg.kv_heads() * cfg.head_dim()) as i64;
    let (module, kind) = name.rsplit_once('.')?;
    let proj = module.rsplit('.').next()?;
    let (out, inp) = match proj {
        "embed_tokens" | "lm_head" => (v, h),
        "norm"
        | "input_layernorm"
        | "post_attention_layernorm"
        | "pre_feedforward_layernorm"
        | "post_feedforward_layernorm" => return Some(vec![h]),
        "q_norm" | "k_norm" => {
            let full = cfg.arch().ok()?.qk_norm == crate::model::config::QkNorm::Full;
            let hd = cfg.head_dim() as i64;
            return Some(vec![match (proj, full) {
                (_, false) => hd,
                ("q_norm", true) => q,
                _ => kv,
            }]);
        }
        "q_proj" => (q, h),
        "k_proj" | "v_proj" => (kv, h),
        "o_proj" => (h, q),
        "gate_proj" | "up_proj" => (i, h),
        // The MoE router.
        "gate" => (moe?.experts as i64, h),
        "down_proj" => (h, i),
        _ => return None,
    };
    match kind {
        "weight" => Some(vec![out, inp]),
        "bias" => Some(vec![out]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_sorted_back_to_back_and_shards_cover_the_unit() {
        let shapes = HashMap::from([("b".to_string(), vec![2, 3]), ("a".to_string(), vec![5])]);
        let u = UnitLayout::new("u", vec!["b".into(), "a".into()], &shapes);
        assert_eq!(u.numel, 11);
        assert_eq!((u.slots[0].name.as_str(), u.slots[0].offset), ("a", 0));
        assert_eq!((u.slots[1].name.as_str(), u.slots[1].offset), ("b", 5));
        let covered: usize = (0..3).map(|r| u.shard(3, r).len()).sum();
        assert_eq!(covered, 11);
        let flat = Tensor::arange(11, (Kind::Float, Device::Cpu));
        let b = u.slots[1].view(&flat);
        assert_eq!(b.size(), vec![2, 3]);
        assert_eq!(f64::try_from(b.get(1).get(2)).unwrap(), 10.0);
        let parts = [u.slots[0].view(&flat), b];
        assert_eq!(
            Vec::<f32>::try_from(&u.flatten(&parts)).unwrap(),
            Vec::<f32>::try_from(&flat).unwrap()
        );
    }
}
