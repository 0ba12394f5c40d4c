//! Hugging Face safetensors I/O: `model.safetensors`, or sharded
//! `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, with
//! the HF parameter names. Files are written with `{"format": "pt"}`
//! metadata so `transformers` accepts them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tch::{Kind, Tensor};

/// The safetensors files of a HF checkpoint directory.
pub fn checkpoint_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no weight_map object", index.display()))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    bail!(
        "{}: neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    )
}

/// Reads named tensors from safetensors files.
pub fn read_tensors(files: &[PathBuf]) -> anyhow::Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for f in files {
        let named =
            Tensor::read_safetensors(f).with_context(|| format!("reading {}", f.display()))?;
        out.extend(named);
    }
    Ok(out)
}

/// Copies `tensors` into `vars` (by name, shape-checked, cast to the
/// variable's dtype). Every variable must be present; a file tensor that is
/// no variable is an error too, except the ones HF itself skips
/// (`rotary_emb.inv_freq`, and `lm_head.weight` of a tied model).
pub fn copy_into(
    vars: &HashMap<String, Tensor>,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for (name, var) in vars {
        match tensors.get(name) {
            Some(t) => {
                if t.size() != var.size() {
                    bail!(
                        "{}: tensor {name} has shape {:?}, the model expects {:?}",
                        source.display(),
                        t.size(),
                        var.size()
                    );
                }
                tch::no_grad(|| {
                    let mut v = var.shallow_clone();
                    v.copy_(&t.to_kind(var.kind()));
                });
            }
            None => missing.push(name.clone()),
        }
    }
    if !missing.is_empty() {
        missing.sort();
        bail!(
            "{}: missing tensors {}",
            source.display(),
            missing.join(", ")
        );
    }
    let mut unexpected: Vec<&String> = tensors
        .keys()
        .filter(|k| !vars.contains_key(*k))
        .filter(|k| !k.ends_with("rotary_emb.inv_freq") && k.as_str() != "lm_head.weight")
        .collect();
    if !unexpected.is_empty() {
        unexpected.sort();
        bail!(
            "{}: tensors the model does not have: {}",
            source.display(),
            unexpected
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

fn st_dtype(kind: Kind) -> anyhow::Result<safetensors::Dtype> {
    Ok(match kind {
        Kind::Float => safetensors::Dtype::F32,
        Kind::BFloat16 => safetensors::Dtype::BF16,
        Kind::Half => safetensors::Dtype::F16,
        Kind::Double => safetensors::Dtype::F64,
        Kind::Int64 => safetensors::Dtype::I64,
        other => bail!("cannot write dtype {other:?} to safetensors"),
    })
}

/// Writes named tensors (CPU copies, contiguous) to one safetensors file,
/// with `{"format": "pt"}` metadata and extra `metadata`.
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let mut data = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.detach().to_device(tch::Device::Cpu).contiguous();
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)
            .with_context(|| format!("copying tensor {name}"))?;
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        data.push((name.clone(), st_dtype(t.kind())?, shape, bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, dt, shape, bytes)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let mut meta: HashMap<String, String> = metadata.into_iter().collect();
    meta.insert("format".into(), "pt".into());
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::tensor::serialize_to_file(views, Some(meta), &tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}
