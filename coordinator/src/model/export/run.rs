//! `accrue export`: which folder a checkpoint becomes — a full model
//! ([`super::weights`]), a LoRA checkpoint's adapter folder, or with
//! `--merge` its merged model ([`super::adapter`]).

use std::path::Path;

use serde_json::Value;

use super::adapter;
use super::weights::{
    bad, io, read_weights, write_folder, ExportError, ExportOptions, ExportReport,
};

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
    if adapter::is_adapter_checkpoint(ckpt) {
        return if opts.merge {
            let tensors = adapter::merged(ckpt, opts.dtype)?;
            write_folder(ckpt, out, tensors, config, opts)
        } else {
            adapter::export_adapter(ckpt, out, opts.dtype)
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

#[cfg(test)]
mod tests {
    use super::super::folder::TOKENIZER_FILES;
    use super::super::weights::*;
    use super::*;
    use half::bf16;
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype as StDtype, SafeTensors};
    use serde_json::json;

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
