//! What the coordinator reads of a job's model before admitting it: the
//! `vocab_size` of the config the workers build the model from (every
//! token id the data stream produces must be below it), and, when
//! `model.init` is a checkpoint directory, that the directory is whole.
//!
//! The architecture is checked as the workers will build it
//! (`accrue_arch`: the family and its variants), so a config Accrue cannot
//! train exactly is refused naming the field.
//!
//! Workers load the weights; a job whose model cannot start used to be
//! admitted and fail on the workers with a cause only their logs named.
//! Checking here makes `accrue validate` and `submit` refuse it naming the
//! file and what is wrong with it.
//!
//! A checkpoint is checked the way workers check it before a restore: the
//! weights (`model.safetensors`, or the shards of
//! `model.safetensors.index.json`) have well-formed headers whose tensors
//! fill the file exactly (the safetensors format), and a checkpoint of ours
//! (with `manifest.json`) is complete and intact as `accrue_checkpoint`
//! defines it (the workers run the same check).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::job::input::{self, InputError, MAX_CONFIG_BYTES};
use crate::job::model::ModelSection;
use crate::job::section::SpecProblem;

/// The largest safetensors header the format allows.
const MAX_SAFETENSORS_HEADER: u64 = 100 << 20;

/// The part of a model's `config.json` the coordinator uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The spec field it comes from: `model.config` or `model.init`.
    pub field: &'static str,
    pub path: PathBuf,
    /// Rows of the embedding: every token id must be below it.
    pub vocab_size: u32,
    /// A mixture-of-experts model: expert ids per token its routing
    /// records (sparse layers × top_k); `None` for a dense model.
    pub routing_width: Option<u32>,
    /// The architecture the workers build (`[lora]` modules are checked
    /// against it).
    pub arch: accrue_arch::Arch,
}

/// Why a model config or checkpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("no config: model.config is required when model.init = \"random\"")]
    NoConfig,
    #[error("{}: invalid json: {message}", path.display())]
    Json { path: PathBuf, message: String },
    #[error("{}: vocab_size {problem}", path.display())]
    VocabSize { path: PathBuf, problem: String },
    /// An architecture the workers cannot build exactly (the field named).
    #[error("{}: {problem}", path.display())]
    Arch { path: PathBuf, problem: String },
    #[error("{}: missing, the checkpoint is incomplete", .0.display())]
    Missing(PathBuf),
    #[error("{}: neither model.safetensors nor model.safetensors.index.json", .0.display())]
    NoWeights(PathBuf),
    #[error("{}: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
}

impl ModelError {
    fn corrupt(path: &Path, what: impl Into<String>) -> ModelError {
        ModelError::Corrupt {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }

    /// What the checkpoint's own check found, in this error's words.
    fn of_checkpoint(e: accrue_checkpoint::VerifyError) -> ModelError {
        use accrue_checkpoint::VerifyError as V;
        match e {
            V::Missing(path) => ModelError::Missing(path),
            V::Json { path, message } => ModelError::Json { path, message },
            V::Bad { path, what } => ModelError::Corrupt { path, what },
        }
    }

    /// A missing file is "missing" (a checkpoint is incomplete); anything
    /// else about it keeps its own cause.
    fn of_checkpoint_file(e: InputError) -> ModelError {
        match e {
            InputError::NotFound { path } => ModelError::Missing(path),
            other => ModelError::Input(other),
        }
    }
}

/// The config workers build the model from, with its spec field:
/// `model.config` for a random init, else `config.json` in `model.init`.
pub fn config_path(model: &ModelSection) -> Option<(&'static str, PathBuf)> {
    if model.is_random() {
        model.config.clone().map(|c| ("model.config", c))
    } else {
        Some(("model.init", Path::new(&model.init).join("config.json")))
    }
}

/// Reads the model's config (see [`config_path`]).
pub fn read_config(model: &ModelSection) -> Result<ModelConfig, ModelError> {
    let (field, path) = config_path(model).ok_or(ModelError::NoConfig)?;
    let (vocab_size, arch) = read_vocab_size(&path)?;
    Ok(ModelConfig {
        field,
        path,
        vocab_size,
        routing_width: arch.routing_width().map(|w| w as u32),
        arch,
    })
}

/// The config's `vocab_size` and architecture (see [`ModelConfig`]).
fn read_vocab_size(path: &Path) -> Result<(u32, accrue_arch::Arch), ModelError> {
    let bytes = input::read(path, MAX_CONFIG_BYTES, "model config")?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let problem = |problem: String| ModelError::VocabSize {
        path: path.to_path_buf(),
        problem,
    };
    let vocab = match json.get("vocab_size") {
        None => Err(problem(
            "is missing: the model's vocabulary size is required".into(),
        )),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| problem(format!("must be a positive integer below 2^32, got {v}"))),
    }?;
    // The architecture, as the workers will build it: an unsupported
    // family or layer variant is refused here, naming the field.
    let arch = accrue_arch::ModelConfig::from_json(&json)
        .and_then(|c| c.arch())
        .map_err(|e| ModelError::Arch {
            path: path.to_path_buf(),
            problem: format!("{e:#}"),
        })?;
    Ok((vocab, arch))
}

/// Checks that `dir` holds usable weights and, for a checkpoint of ours,
/// that it is complete and intact (see the module docs).
pub fn verify_checkpoint(dir: &Path) -> Result<(), ModelError> {
    for file in weight_files(dir)? {
        check_safetensors(&file)?;
    }
    if !dir.join(accrue_checkpoint::MANIFEST).exists() {
        return Ok(());
    }
    accrue_checkpoint::verify(dir).map_err(ModelError::of_checkpoint)?;
    Ok(())
}

/// The safetensors files of a HF checkpoint directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(ModelError::NoWeights(dir.to_path_buf()));
    }
    let json = read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| ModelError::corrupt(&index, "no \"weight_map\" object"))?;
    let mut files: Vec<PathBuf> = map
        .values()
        .filter_map(serde_json::Value::as_str)
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

fn read_json(path: &Path) -> Result<serde_json::Value, ModelError> {
    let bytes = input::read(path, MAX_CONFIG_BYTES, "checkpoint json file")
        .map_err(ModelError::of_checkpoint_file)?;
    serde_json::from_slice(&bytes).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// A safetensors file: an 8-byte little-endian header length, a JSON
/// header naming every tensor's byte range, then exactly those bytes.
fn check_safetensors(path: &Path) -> Result<(), ModelError> {
    let size = input::check(path).map_err(ModelError::of_checkpoint_file)?;
    let bad = |what: String| ModelError::corrupt(path, format!("not a safetensors file: {what}"));
    if size < 8 {
        return Err(bad(format!("{size} bytes, shorter than its header length")));
    }
    let mut f = std::fs::File::open(path).map_err(|source| InputError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut len = [0u8; 8];
    let io = |source| {
        ModelError::Input(InputError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    f.read_exact(&mut len).map_err(io)?;
    let header_len = u64::from_le_bytes(len);
    if header_len > MAX_SAFETENSORS_HEADER || 8 + header_len > size {
        return Err(bad(format!(
            "its first 8 bytes give a header of {header_len} bytes, the file has {size}"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let mut data_end = 0u64;
    for (name, t) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        let end = t
            .get("data_offsets")
            .and_then(serde_json::Value::as_array)
            .and_then(|o| o.get(1))
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad(format!("tensor {name} has no data_offsets")))?;
        data_end = data_end.max(end);
    }
    let expected = 8 + header_len + data_end;
    if size != expected {
        return Err(ModelError::corrupt(
            path,
            format!(
                "{size} bytes, its safetensors header describes {expected}{}",
                if size < expected { " (truncated)" } else { "" }
            ),
        ));
    }
    Ok(())
}

/// The model's config, checked, and its checkpoint when `model.init` is
/// one; every problem with the spec field it belongs to.
pub fn check(model: &ModelSection) -> Result<ModelConfig, Vec<SpecProblem>> {
    let mut problems = Vec::new();
    let config = match read_config(model) {
        Ok(c) => Some(c),
        Err(e) => {
            let field = config_path(model).map_or("model.config", |(f, _)| f);
            problems.push(SpecProblem::new(field, e.to_string()));
            None
        }
    };
    if !model.is_random() {
        if let Err(e) = verify_checkpoint(Path::new(&model.init)) {
            problems.push(SpecProblem::new("model.init", e.to_string()));
        }
    }
    match config {
        Some(c) if problems.is_empty() => Ok(c),
        _ => Err(problems),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A valid safetensors file of one f32 tensor of `n` elements.
    pub(crate) fn safetensors(n: usize) -> Vec<u8> {
        let header = format!(
            r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
            4 * n
        );
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend(std::iter::repeat_n(0u8, 4 * n));
        out
    }

    fn section(init: &str, config: Option<&Path>) -> ModelSection {
        ModelSection {
            init: init.into(),
            config: config.map(Path::to_path_buf),
            dtype: Default::default(),
            resume: true,
        }
    }

    /// A tiny Llama config with `vocab` rows.
    pub(crate) fn tiny(vocab: u32) -> String {
        format!(
            r#"{{"model_type": "llama", "vocab_size": {vocab}, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}"#
        )
    }

    /// A mixture-of-experts config's routing width (sparse layers ×
    /// top_k), what `rl.routing_replay` needs; none for a dense model.
    #[test]
    fn routing_width_of_a_sparse_model() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("c.json");
        std::fs::write(&c, tiny(320)).unwrap();
        assert_eq!(
            read_config(&section("random", Some(&c)))
                .unwrap()
                .routing_width,
            None
        );
        std::fs::write(
            &c,
            r#"{"model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1]}"#,
        )
        .unwrap();
        assert_eq!(
            read_config(&section("random", Some(&c)))
                .unwrap()
                .routing_width,
            Some(4)
        );
    }

    #[test]
    fn vocab_size_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("c.json");
        std::fs::write(&c, tiny(320)).unwrap();
        let cfg = read_config(&section("random", Some(&c))).unwrap();
        assert_eq!((cfg.field, cfg.vocab_size), ("model.config", 320));
        // An architecture the workers cannot build is refused, naming the
        // field.
        let phi = tiny(320).replace("\"llama\"", "\"phi3\"");
        std::fs::write(&c, phi).unwrap();
        let e = read_config(&section("random", Some(&c))).unwrap_err();
        assert!(e.to_string().contains("model_type: phi3"), "{e}");
        for (text, want) in [
            ("{}", "vocab_size is missing"),
            (
                r#"{"vocab_size": 0}"#,
                "vocab_size must be a positive integer",
            ),
            (
                r#"{"vocab_size": "big"}"#,
                "vocab_size must be a positive integer",
            ),
            ("{", "invalid json"),
        ] {
            std::fs::write(&c, text).unwrap();
            let e = read_config(&section("random", Some(&c))).unwrap_err();
            assert!(e.to_string().contains(want), "{text}: {e}");
            assert!(e.to_string().contains("c.json"), "{e}");
        }
    }

    /// A checkpoint of ours: weights, manifest and a rank marker.
    fn checkpoint(dir: &Path) {
        std::fs::write(dir.join("config.json"), tiny(320)).unwrap();
        let weights = safetensors(4);
        std::fs::write(dir.join("model.safetensors"), &weights).unwrap();
        std::fs::write(
            dir.join("manifest.json"),
            r#"{"job":"j","step":2,"cursor":{"epoch":0,"position":4,"overflow":[]},"world_size":1,"generation":1}"#,
        )
        .unwrap();
        let marker = serde_json::json!({"rank": 0, "world_size": 1, "files": [
            {"name": "model.safetensors", "bytes": weights.len(), "crc32": crc32fast::hash(&weights)}
        ]});
        std::fs::write(dir.join("rank-0.json"), marker.to_string()).unwrap();
    }

    #[test]
    fn a_whole_checkpoint_passes_and_each_corruption_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        checkpoint(d);
        let init = d.display().to_string();
        assert_eq!(check(&section(&init, None)).unwrap().vocab_size, 320);

        let weights = d.join("model.safetensors");
        let good = std::fs::read(&weights).unwrap();
        // Same size, one byte flipped: only the checksum sees it.
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        std::fs::write(&weights, &flipped).unwrap();
        let e = verify_checkpoint(d).unwrap_err().to_string();
        assert!(
            e.starts_with(&weights.display().to_string()) && e.contains("the file is corrupt"),
            "{e}"
        );
        // Truncated.
        std::fs::write(&weights, &good[..good.len() - 3]).unwrap();
        let e = verify_checkpoint(d).unwrap_err().to_string();
        assert!(e.contains("(truncated)"), "{e}");
        // Not safetensors at all.
        std::fs::write(&weights, b"garbage, not a model").unwrap();
        let e = verify_checkpoint(d).unwrap_err().to_string();
        assert!(e.contains("not a safetensors file"), "{e}");
        // Gone.
        std::fs::remove_file(&weights).unwrap();
        let e = verify_checkpoint(d).unwrap_err().to_string();
        assert!(e.contains("neither model.safetensors"), "{e}");
        std::fs::write(&weights, &good).unwrap();
        // A marker that does not parse.
        std::fs::write(d.join("rank-0.json"), "{").unwrap();
        let p = check(&section(&init, None)).unwrap_err();
        assert_eq!(p[0].field, "model.init");
        assert!(p[0].message.contains("rank-0.json: invalid json"), "{p:?}");
        // A directory where the config should be.
        std::fs::remove_file(d.join("config.json")).unwrap();
        std::fs::create_dir(d.join("config.json")).unwrap();
        let p = check(&section(&init, None)).unwrap_err();
        assert!(p[0].message.contains("is a directory"), "{p:?}");
    }
}
