//! `accrue export`: a checkpoint's weights as a clean Hugging Face folder.
//!
//! Reads every tensor of the checkpoint (one `model.safetensors`, or the
//! per-rank files its `model.safetensors.index.json` names), converts it to
//! the chosen dtype, and writes shards of at most `--shard-size` bytes
//! (`model-00001-of-0000N.safetensors` plus the index, or one
//! `model.safetensors` when everything fits), `config.json` with the dtype,
//! and the tokenizer files the checkpoint carries. Optimizer state,
//! `trainer.json`, `manifest.json` and the rank markers stay behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::{json, Value};

use super::folder::{OPTIONAL_TOKENIZER_FILES, TOKENIZER_FILES};
use crate::stream::data::template::{named_template_files, CHAT_TEMPLATE_DIR};

/// A floating-point dtype of exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Float32,
    BFloat16,
    Float16,
}

impl Dtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "float32" | "fp32" => Ok(Dtype::Float32),
            "bfloat16" | "bf16" => Ok(Dtype::BFloat16),
            "float16" | "fp16" => Ok(Dtype::Float16),
            _ => Err(format!(
                "unknown dtype {s:?}: one of float32, bfloat16, float16"
            )),
        }
    }

    /// The name `config.json` uses.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::BFloat16 => "bfloat16",
            Dtype::Float16 => "float16",
        }
    }

    pub(super) fn st(self) -> StDtype {
        match self {
            Dtype::Float32 => StDtype::F32,
            Dtype::BFloat16 => StDtype::BF16,
            Dtype::Float16 => StDtype::F16,
        }
    }

    pub(super) fn of(st: StDtype) -> Option<Self> {
        match st {
            StDtype::F32 => Some(Dtype::Float32),
            StDtype::BF16 => Some(Dtype::BFloat16),
            StDtype::F16 => Some(Dtype::Float16),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::Float32 => 4,
            Dtype::BFloat16 | Dtype::Float16 => 2,
        }
    }
}

/// Parses `5GB`, `500MB`, `2GiB`, `64KB` or a byte count (decimal units
/// are powers of 1000, `i` units of 1024, as `transformers` reads them).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a size like 5GB, 500MB or 2GiB"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let bytes = (n * mult as f64) as u64;
    if bytes == 0 {
        return Err(format!("{s:?}: the shard size must be positive"));
    }
    Ok(bytes)
}

#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// None: keep each tensor's dtype.
    pub dtype: Option<Dtype>,
    pub shard_bytes: u64,
    /// A LoRA checkpoint: write the full model with the adapters merged
    /// into its weights instead of the adapter folder.
    pub merge: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    pub tensors: usize,
    pub bytes: u64,
    pub shards: Vec<String>,
    /// Tokenizer files the checkpoint did not have (an older checkpoint):
    /// the folder then loads as a model but not with `AutoTokenizer`.
    pub missing_tokenizer_files: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Bad { path: PathBuf, message: String },
    #[error("{}: not a checkpoint (no model.safetensors or model.safetensors.index.json)", .0.display())]
    NotACheckpoint(PathBuf),
    #[error("{} exists and is not empty (export into a new directory)", .0.display())]
    OutNotEmpty(PathBuf),
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ExportError + '_ {
    move |source| ExportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn bad(path: &Path, message: impl Into<String>) -> ExportError {
    ExportError::Bad {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The weight files of a checkpoint: one file, or those its index names.
pub(super) fn weight_files(ckpt: &Path) -> Result<Vec<PathBuf>, ExportError> {
    let single = ckpt.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = ckpt.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(ExportError::NotACheckpoint(ckpt.to_path_buf()));
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&index).map_err(io(&index))?)
        .map_err(|e| bad(&index, format!("invalid json: {e}")))?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| bad(&index, "no weight_map object"))?;
    let mut files: Vec<String> = map
        .values()
        .map(|f| {
            let name = f
                .as_str()
                .ok_or_else(|| bad(&index, "a weight_map value is not a file name"))?;
            // A file of this checkpoint, never a path out of it (issue 33:
            // `../../etc/x` or `/abs` would be read, and its bytes exported).
            let plain = std::path::Path::new(name)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
                && !name.is_empty()
                && !name.contains('/')
                && !name.contains('\\');
            if !plain || !name.ends_with(".safetensors") {
                return Err(bad(
                    &index,
                    format!(
                        "weight_map names {name:?}, not a .safetensors file of this checkpoint"
                    ),
                ));
            }
            Ok(name.to_string())
        })
        .collect::<Result<_, _>>()?;
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| ckpt.join(f)).collect())
}

/// `bytes` (little-endian `from`) as little-endian `to`; floats round to
/// nearest even, as torch's `.to(dtype)` does.
pub(super) fn convert(bytes: &[u8], from: Dtype, to: Dtype) -> Vec<u8> {
    if from == to {
        return bytes.to_vec();
    }
    let values = bytes.chunks_exact(from.size()).map(|c| match from {
        Dtype::Float32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::BFloat16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        Dtype::Float16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
    });
    let mut out = Vec::with_capacity(bytes.len() / from.size() * to.size());
    for v in values {
        match to {
            Dtype::Float32 => out.extend_from_slice(&v.to_le_bytes()),
            Dtype::BFloat16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            Dtype::Float16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

pub(super) struct Tensor {
    pub(super) name: String,
    pub(super) dtype: StDtype,
    pub(super) shape: Vec<usize>,
    pub(super) data: Vec<u8>,
}

/// Every tensor of the checkpoint's weight files, converted to `dtype`
/// (kept when `None`), sorted by name; a name in two files is an error.
pub(super) fn read_weights(ckpt: &Path, dtype: Option<Dtype>) -> Result<Vec<Tensor>, ExportError> {
    let files = weight_files(ckpt)?;
    let mut tensors = Vec::new();
    for f in &files {
        tensors.extend(read_file(f, dtype)?);
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(bad(
            ckpt,
            format!("tensor {} is in two weight files", w[0].name),
        ));
    }
    Ok(tensors)
}

/// The tensors of one safetensors file, converted to `dtype` (kept when
/// `None`).
pub(super) fn read_file(f: &Path, dtype: Option<Dtype>) -> Result<Vec<Tensor>, ExportError> {
    let mut tensors = Vec::new();
    {
        let bytes = std::fs::read(f).map_err(io(f))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(f, e.to_string()))?;
        let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names.sort();
        for name in names {
            let view = st.tensor(&name).map_err(|e| bad(f, e.to_string()))?;
            let (dtype, data) = match (Dtype::of(view.dtype()), dtype) {
                (Some(from), Some(to)) => (to.st(), convert(view.data(), from, to)),
                (_, None) => (view.dtype(), view.data().to_vec()),
                (None, Some(_)) => {
                    return Err(bad(
                        f,
                        format!("{name}: {:?} is not a float dtype", view.dtype()),
                    ))
                }
            };
            tensors.push(Tensor {
                name,
                dtype,
                shape: view.shape().to_vec(),
                data,
            });
        }
    }
    Ok(tensors)
}

/// Writes `tensors` as a Hugging Face model folder in `out` (shards of
/// `opts.shard_bytes`, `config.json` with their dtype, the checkpoint's
/// tokenizer files).
pub(super) fn write_folder(
    ckpt: &Path,
    out: &Path,
    tensors: Vec<Tensor>,
    mut config: Value,
    opts: &ExportOptions,
) -> Result<ExportReport, ExportError> {
    let out_dtype = tensors.iter().rev().find_map(|t| Dtype::of(t.dtype));
    // Greedy shards in name order, as transformers' save_pretrained packs
    // them: a tensor larger than the limit gets a shard of its own.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let size = t.data.len() as u64;
        if used > 0 && used + size > opts.shard_bytes {
            shards.push(Vec::new());
            used = 0;
        }
        shards.last_mut().expect("one shard").push(i);
        used += size;
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let n = shards.len();
    let names: Vec<String> = if n == 1 {
        vec!["model.safetensors".into()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let mut weight_map = BTreeMap::new();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    for (shard, file) in shards.iter().zip(&names) {
        let views: Vec<(String, TensorView<'_>)> = shard
            .iter()
            .map(|&i| {
                let t = &tensors[i];
                weight_map.insert(t.name.clone(), file.clone());
                TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| bad(ckpt, format!("{}: {e}", t.name)))
            })
            .collect::<Result<_, _>>()?;
        let path = out.join(file);
        safetensors::tensor::serialize_to_file(views, Some(meta.clone()), &path)
            .map_err(|e| bad(&path, e.to_string()))?;
    }
    let total: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = out.join("model.safetensors.index.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&index).expect("json"))
            .map_err(io(&path))?;
    }
    if let (Some(obj), Some(dt)) = (config.as_object_mut(), out_dtype) {
        obj.insert("torch_dtype".into(), dt.name().into());
        obj.insert("dtype".into(), dt.name().into());
    }
    let path = out.join("config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config).expect("json")).map_err(io(&path))?;
    let missing = copy_tokenizer_files(ckpt, out)?;
    Ok(ExportReport {
        tensors: tensors.len(),
        bytes: total,
        shards: names,
        missing_tokenizer_files: missing,
    })
}

/// Copies the checkpoint's tokenizer files into `out`; returns the
/// required ones it lacks.
pub(super) fn copy_tokenizer_files(ckpt: &Path, out: &Path) -> Result<Vec<String>, ExportError> {
    let mut missing = Vec::new();
    for f in TOKENIZER_FILES {
        let from = ckpt.join(f);
        if from.is_file() {
            std::fs::copy(&from, out.join(f)).map_err(io(&from))?;
        } else {
            missing.push(f.to_string());
        }
    }
    // The model's chat template file and named templates, where the
    // checkpoint has them.
    for f in OPTIONAL_TOKENIZER_FILES {
        let from = ckpt.join(f);
        if from.is_file() {
            std::fs::copy(&from, out.join(f)).map_err(io(&from))?;
        }
    }
    let named = named_template_files(ckpt).map_err(io(&ckpt.join(CHAT_TEMPLATE_DIR)))?;
    if !named.is_empty() {
        let to = out.join(CHAT_TEMPLATE_DIR);
        std::fs::create_dir_all(&to).map_err(io(&to))?;
        for from in named {
            std::fs::copy(&from, to.join(from.file_name().unwrap_or_default()))
                .map_err(io(&from))?;
        }
    }
    Ok(missing)
}
