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

/// Exports the checkpoint at `ckpt` into `out` (created; must be empty).
/// A LoRA checkpoint (`adapter_model.safetensors`) exports its adapter
/// folder, or with `opts.merge` the merged model (`super::adapter`).
pub fn export(ckpt: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportReport, ExportError> {
    let config_path = ckpt.join("config.json");
    let config: Value =
        serde_json::from_slice(&std::fs::read(&config_path).map_err(io(&config_path))?)
            .map_err(|e| bad(&config_path, format!("invalid json: {e}")))?;
    if out.exists() && std::fs::read_dir(out).map_err(io(out))?.next().is_some() {
        return Err(ExportError::OutNotEmpty(out.to_path_buf()));
    }
    if super::adapter::is_adapter_checkpoint(ckpt) {
        return if opts.merge {
            let tensors = super::adapter::merged(ckpt, opts.dtype)?;
            write_folder(ckpt, out, tensors, config, opts)
        } else {
            super::adapter::export_adapter(ckpt, out, opts.dtype)
        };
    }
    if opts.merge {
        return Err(bad(
            ckpt,
            "--merge needs a LoRA checkpoint (adapter_model.safetensors); this one holds the whole model",
        ));
    }
    let tensors = read_weights(ckpt, opts.dtype)?;
    write_folder(ckpt, out, tensors, config, opts)
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
fn write_folder(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("64kb"), Ok(64_000));
        assert_eq!(parse_size("1234"), Ok(1234));
        assert!(parse_size("5XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("0MB").is_err());
        assert!(parse_size("GB").is_err());
    }

    #[test]
    fn bf16_conversion_rounds_to_nearest_even_like_torch() {
        // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7):
        // ties go to the even mantissa, 1.0; just above goes up.
        let halfway = 1.0f32 + 2f32.powi(-8);
        let above = f32::from_bits(halfway.to_bits() + 1);
        let bytes: Vec<u8> = [halfway, above, -3.5, 1e-3]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let out = convert(&bytes, Dtype::Float32, Dtype::BFloat16);
        let back: Vec<f32> = out
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], 1.0 + 2f32.powi(-7));
        assert_eq!(back[2], -3.5);
        assert!((back[3] - 1e-3).abs() < 1e-5);
    }

    fn write_ckpt(dir: &Path, tensors: &[(&str, Vec<f32>)], sharded: bool) {
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type":"llama","torch_dtype":"float32"}"#,
        )
        .unwrap();
        let data: Vec<(String, Vec<u8>, usize)> = tensors
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    v.len(),
                )
            })
            .collect();
        let mut groups: Vec<(String, Vec<usize>)> = if sharded {
            (0..data.len())
                .map(|i| (format!("model-rank{i}.safetensors"), vec![i]))
                .collect()
        } else {
            vec![("model.safetensors".into(), (0..data.len()).collect())]
        };
        let mut map = serde_json::Map::new();
        for (file, idx) in groups.drain(..) {
            let views: Vec<(String, TensorView<'_>)> = idx
                .iter()
                .map(|&i| {
                    map.insert(data[i].0.clone(), file.clone().into());
                    (
                        data[i].0.clone(),
                        TensorView::new(StDtype::F32, vec![data[i].2], &data[i].1).unwrap(),
                    )
                })
                .collect();
            safetensors::tensor::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        }
        if sharded {
            std::fs::write(
                dir.join("model.safetensors.index.json"),
                json!({"metadata": {}, "weight_map": map}).to_string(),
            )
            .unwrap();
        }
        std::fs::write(dir.join("optimizer.safetensors"), b"not exported").unwrap();
        std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    }

    /// Issue 33 (11): `accrue export` trusted the index's file names; one
    /// naming a path out of the checkpoint is refused, naming it.
    #[test]
    fn an_index_naming_files_outside_the_checkpoint_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("secret.safetensors"), b"x").unwrap();
        let ck = tmp.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        for name in [
            "../secret.safetensors",
            "/etc/passwd",
            "sub/x.safetensors",
            "notes.txt",
            "",
        ] {
            std::fs::write(
                ck.join("model.safetensors.index.json"),
                json!({"metadata": {}, "weight_map": {"a.weight": name}}).to_string(),
            )
            .unwrap();
            let e = weight_files(&ck).unwrap_err().to_string();
            assert!(e.contains("weight_map names"), "{name}: {e}");
        }
        std::fs::write(
            ck.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": {"a.weight": "model-1.safetensors"}}).to_string(),
        )
        .unwrap();
        assert_eq!(
            weight_files(&ck).unwrap(),
            vec![ck.join("model-1.safetensors")]
        );
    }

    #[test]
    fn a_rank_sharded_checkpoint_exports_size_bounded_shards_without_optimizer_state() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        let tensors: Vec<(&str, Vec<f32>)> = vec![
            ("a.weight", (0..100).map(|i| i as f32 * 0.5).collect()),
            ("b.weight", (0..300).map(|i| -(i as f32)).collect()),
            ("c.weight", vec![1.5; 50]),
            ("d.weight", vec![-2.0; 10]),
        ];
        write_ckpt(&ck, &tensors, true);
        let out = tmp.path().join("out");
        let r = export(
            &ck,
            &out,
            &ExportOptions {
                merge: false,
                dtype: Some(Dtype::BFloat16),
                shard_bytes: 400,
            },
        )
        .unwrap();
        // bf16 sizes: a 200, b 600 (alone, over the limit), c 100 + d 20.
        assert_eq!(r.shards.len(), 3, "{r:?}");
        assert_eq!(r.bytes, 2 * 460);
        assert_eq!(r.missing_tokenizer_files.len(), TOKENIZER_FILES.len() - 1);
        assert!(!out.join("optimizer.safetensors").exists());
        assert!(out.join("tokenizer.json").is_file());
        let index: Value = serde_json::from_slice(
            &std::fs::read(out.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["metadata"]["total_size"], 920);
        assert_eq!(
            index["weight_map"]["b.weight"],
            "model-00002-of-00003.safetensors"
        );
        let config: Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["torch_dtype"], "bfloat16");
        for (name, values) in &tensors {
            let file = index["weight_map"][name].as_str().unwrap();
            let bytes = std::fs::read(out.join(file)).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let v = st.tensor(name).unwrap();
            assert_eq!(v.dtype(), StDtype::BF16);
            let got: Vec<f32> = v
                .data()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            let want: Vec<f32> = values.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            assert_eq!(got, want, "{name}");
        }
        // A second export into the same folder is refused, not merged.
        let again = export(
            &ck,
            &out,
            &ExportOptions {
                merge: false,
                dtype: None,
                shard_bytes: 1 << 30,
            },
        );
        assert!(matches!(again, Err(ExportError::OutNotEmpty(_))));
    }

    #[test]
    fn one_file_when_everything_fits_and_dtype_kept_by_default() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("ck");
        std::fs::create_dir(&ck).unwrap();
        write_ckpt(&ck, &[("w", vec![0.25; 8])], false);
        let out = tmp.path().join("out");
        let r = export(
            &ck,
            &out,
            &ExportOptions {
                merge: false,
                dtype: None,
                shard_bytes: 1 << 20,
            },
        )
        .unwrap();
        assert_eq!(r.shards, ["model.safetensors"]);
        assert!(!out.join("model.safetensors.index.json").exists());
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().dtype(), StDtype::F32);
    }

    #[test]
    fn a_directory_without_weights_is_not_a_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), "{}").unwrap();
        let e = export(
            tmp.path(),
            &tmp.path().join("o"),
            &ExportOptions {
                merge: false,
                dtype: None,
                shard_bytes: 1,
            },
        )
        .unwrap_err();
        assert!(matches!(e, ExportError::NotACheckpoint(_)), "{e}");
    }
}
