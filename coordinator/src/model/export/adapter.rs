//! `accrue export` of a LoRA checkpoint (`adapter_model.safetensors` +
//! `adapter_config.json`, PEFT's layout, written by the workers): the
//! adapter folder `PeftModel.from_pretrained` loads, or with `--merge` the
//! full model with every adapter folded into its base weight,
//! `W + s · B A` with `s = lora_alpha / r` (`/ √r` with `use_rslora`), as
//! PEFT's `merge_and_unload` computes it (the product in float32, then
//! added to the weight in float32 and cast to the export dtype).
//!
//! The base is the one `base_model_name_or_path` names: the checkpoint
//! itself when it carries the weights (a random-init base), else the
//! job's `model.init` folder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::weights::{
    bad, convert, copy_tokenizer_files, io, read_file, read_weights, Dtype, ExportError,
    ExportReport, Tensor,
};

pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's key prefix (`PeftModel` wraps the model as `base_model.model`).
const PEFT_PREFIX: &str = "base_model.model.";

pub fn is_adapter_checkpoint(ckpt: &Path) -> bool {
    ckpt.join(ADAPTER_FILE).is_file()
}

fn read_config(ckpt: &Path) -> Result<Value, ExportError> {
    let path = ckpt.join(ADAPTER_CONFIG);
    serde_json::from_slice(&std::fs::read(&path).map_err(io(&path))?)
        .map_err(|e| bad(&path, format!("invalid json: {e}")))
}

/// The adapter folder: `adapter_model.safetensors` (in `dtype`, else as
/// trained: float32), `adapter_config.json` and the tokenizer files.
pub fn export_adapter(
    ckpt: &Path,
    out: &Path,
    dtype: Option<Dtype>,
) -> Result<ExportReport, ExportError> {
    let config = read_config(ckpt)?;
    let tensors = read_file(&ckpt.join(ADAPTER_FILE), dtype)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let views = tensors
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| bad(ckpt, format!("{}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let path = out.join(ADAPTER_FILE);
    safetensors::tensor::serialize_to_file(views, Some(meta), &path)
        .map_err(|e| bad(&path, e.to_string()))?;
    let path = out.join(ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).expect("json")).map_err(io(&path))?;
    let missing = copy_tokenizer_files(ckpt, out)?;
    Ok(ExportReport {
        tensors: tensors.len(),
        bytes: tensors.iter().map(|t| t.data.len() as u64).sum(),
        shards: vec![ADAPTER_FILE.into()],
        missing_tokenizer_files: missing,
    })
}

/// The base's folder: `base_model_name_or_path`, or the checkpoint when
/// it names nothing usable but holds the weights itself.
fn base_dir(ckpt: &Path, config: &Value) -> Result<PathBuf, ExportError> {
    let named = config["base_model_name_or_path"].as_str().unwrap_or("");
    let own = ckpt.join("model.safetensors").is_file()
        || ckpt.join("model.safetensors.index.json").is_file();
    if own && (named.is_empty() || Path::new(named) == ckpt) {
        return Ok(ckpt.to_path_buf());
    }
    let dir = PathBuf::from(named);
    if named.is_empty() || !dir.join("config.json").is_file() {
        if own {
            return Ok(ckpt.to_path_buf());
        }
        return Err(bad(
            &ckpt.join(ADAPTER_CONFIG),
            format!(
                "base_model_name_or_path {named:?} is no model folder here: --merge needs the base weights"
            ),
        ));
    }
    Ok(dir)
}

/// The scale PEFT multiplies `B A` by.
fn scaling(config: &Value, path: &Path) -> Result<f64, ExportError> {
    let r = config["r"]
        .as_f64()
        .filter(|r| *r > 0.0)
        .ok_or_else(|| bad(path, "r is missing or not positive"))?;
    let alpha = config["lora_alpha"]
        .as_f64()
        .ok_or_else(|| bad(path, "lora_alpha is missing"))?;
    Ok(if config["use_rslora"].as_bool() == Some(true) {
        alpha / r.sqrt()
    } else {
        alpha / r
    })
}

fn to_f32(t: &Tensor, path: &Path) -> Result<Vec<f32>, ExportError> {
    let from = Dtype::of(t.dtype).ok_or_else(|| {
        bad(
            path,
            format!("{}: {:?} is not a float dtype", t.name, t.dtype),
        )
    })?;
    Ok(convert(&t.data, from, Dtype::Float32)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The base's tensors with every adapter merged, in `dtype` (else the
/// base's own).
pub fn merged(ckpt: &Path, dtype: Option<Dtype>) -> Result<Vec<Tensor>, ExportError> {
    let config = read_config(ckpt)?;
    let config_path = ckpt.join(ADAPTER_CONFIG);
    let scale = scaling(&config, &config_path)? as f32;
    let adapter_path = ckpt.join(ADAPTER_FILE);
    let mut adapters: HashMap<String, Tensor> = read_file(&adapter_path, None)?
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let mut base = read_weights(&base_dir(ckpt, &config)?, None)?;
    for t in &mut base {
        let Some(module) = t.name.strip_suffix(".weight") else {
            continue;
        };
        let key = |m: &str| format!("{PEFT_PREFIX}{module}.{m}.weight");
        let (Some(a), Some(b)) = (
            adapters.remove(&key("lora_A")),
            adapters.remove(&key("lora_B")),
        ) else {
            continue;
        };
        let (out_f, in_f) = match t.shape.as_slice() {
            [o, i] => (*o, *i),
            _ => return Err(bad(&adapter_path, format!("{}: not a 2-D weight", t.name))),
        };
        let r = a.shape.first().copied().unwrap_or(0);
        if a.shape != [r, in_f] || b.shape != [out_f, r] {
            return Err(bad(
                &adapter_path,
                format!(
                    "{module}: lora_A {:?} and lora_B {:?} do not fit the weight {:?}",
                    a.shape, b.shape, t.shape
                ),
            ));
        }
        let (av, bv) = (to_f32(&a, &adapter_path)?, to_f32(&b, &adapter_path)?);
        let mut w = to_f32(t, &adapter_path)?;
        for o in 0..out_f {
            let row = &mut w[o * in_f..(o + 1) * in_f];
            let mut delta = vec![0f32; in_f];
            for k in 0..r {
                let bk = bv[o * r + k];
                for (d, &x) in delta.iter_mut().zip(&av[k * in_f..(k + 1) * in_f]) {
                    *d += bk * x;
                }
            }
            for (x, d) in row.iter_mut().zip(delta) {
                *x += d * scale;
            }
        }
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let to = dtype.or(Dtype::of(t.dtype)).unwrap_or(Dtype::Float32);
        t.data = convert(&bytes, Dtype::Float32, to);
        t.dtype = to.st();
    }
    if let Some(left) = adapters.keys().min() {
        return Err(bad(
            &adapter_path,
            format!("{left}: no base weight of that name to merge into"),
        ));
    }
    if let Some(to) = dtype {
        for t in &mut base {
            if let Some(from) = Dtype::of(t.dtype).filter(|f| *f != to) {
                t.data = convert(&t.data, from, to);
                t.dtype = to.st();
            }
        }
    }
    Ok(base)
}
