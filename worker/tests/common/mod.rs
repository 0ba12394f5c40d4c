//! Shared helpers of the worker's integration tests: running the Python
//! references (installed into the repo's `.venv` by the scripts), building
//! job configs, comparing tensors.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use accrue_worker::batch::PackedBatch;
use accrue_worker::config::JobConfig;
use tch::{Kind, Tensor};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `scripts/reference/<script>` with the repo venv's python.
pub fn python(script: &str, args: &[&str]) {
    python_output(script, args);
}

/// Runs `scripts/reference/<script>` like [`python`] and returns its stdout.
pub fn python_output(script: &str, args: &[&str]) -> String {
    let root = repo_root();
    let py = root.join(".venv/bin/python");
    assert!(
        py.exists(),
        "python venv not found at {} (run scripts/setup.sh)",
        py.display()
    );
    let out = Command::new(&py)
        .arg(root.join("scripts/reference").join(script))
        .args(args)
        .output()
        .expect("running python reference");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("python output is not UTF-8")
}

/// Builds the tiny HF reference model + expectations in `dir`.
pub fn make_reference(dir: &Path, variant: &str) -> HashMap<String, Tensor> {
    python(
        "make_tiny_llama.py",
        &[dir.to_str().unwrap(), "--variant", variant],
    );
    read(&dir.join("reference.safetensors"))
}

pub fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// The reference documents as `(input_ids, labels)`, in order.
pub fn documents(reference: &HashMap<String, Tensor>) -> Vec<(Vec<i64>, Vec<i64>)> {
    (0..)
        .map_while(|i| {
            let ids = reference.get(&format!("doc{i}.input_ids"))?;
            let labels = &reference[&format!("doc{i}.labels")];
            Some((
                Vec::<i64>::try_from(ids).unwrap(),
                Vec::<i64>::try_from(labels).unwrap(),
            ))
        })
        .collect()
}

/// A job config as the coordinator resolves it and the worker receives it:
/// `extra` (lines continuing `[model]`, then any sections) completed into a
/// valid spec, parsed and validated by the coordinator, sent through the
/// typed job message (`Configure.job`) and converted by the worker.
pub fn job_config(init: &str, extra: &str) -> JobConfig {
    accrue_worker::convert::job_config(&job_definition(init, extra)).unwrap()
}

/// The typed job message of [`job_config`].
pub fn job_definition(init: &str, extra: &str) -> accrue_worker::wire::JobDefinition {
    let text = format!(
        "[job]\nname = \"t\"\nseed = 7\noutput_dir = \"/tmp/unused\"\n[model]\ninit = \"{init}\"\n{extra}"
    );
    let mut spec: toml::Table = text.parse().unwrap();
    let job = spec["job"].as_table_mut().unwrap();
    if !job.contains_key("steps") && !job.contains_key("epochs") {
        job.insert("steps".into(), 1.into());
    }
    let kind = spec
        .get("objective")
        .and_then(|o| o.get("kind"))
        .and_then(|k| k.as_str())
        .unwrap_or("sft");
    let format = match kind {
        "dpo" => "dpo",
        "pg" => "rollouts",
        _ => "sft",
    };
    // The coordinator checks that data files exist; none is read here.
    let data_file = std::env::temp_dir().join("accrue-worker-tests-unread.jsonl");
    std::fs::write(&data_file, "").unwrap();
    let data = spec
        .entry("data")
        .or_insert_with(|| toml::Table::new().into())
        .as_table_mut()
        .unwrap();
    data.entry("train")
        .or_insert_with(|| vec![data_file.display().to_string()].into());
    data.entry("format").or_insert_with(|| format.into());
    spec.entry("batch")
        .or_insert_with(|| toml::toml! { docs_per_step = 1 }.into());
    let text = toml::to_string(&spec).unwrap();
    let spec = accrue_coordinator::job::spec::JobSpec::parse(&text, Path::new("/"))
        .unwrap_or_else(|p| panic!("test spec is invalid: {p:?}\n{text}"));
    accrue_coordinator::shell::service::convert::job_definition(&spec)
}

/// `(‖a − b‖, ‖b‖)` in f64.
pub fn diff_norms(a: &Tensor, b: &Tensor) -> (f64, f64) {
    let a = a.to_kind(Kind::Double);
    let b = b.to_kind(Kind::Double);
    (
        f64::try_from((&a - &b).norm()).unwrap(),
        f64::try_from(b.norm()).unwrap(),
    )
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from(
        (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
            .abs()
            .max(),
    )
    .unwrap()
}

/// Deep copies of all parameters.
pub fn snapshot(params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    params
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect()
}

/// Largest relative per-tensor difference `‖a−b‖/‖b‖` and its name.
pub fn worst_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0, String::new());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let (d, n) = diff_norms(ta, tb);
        let rel = d / n.max(1e-30);
        if rel > worst.0 {
            worst = (rel, na.clone());
        }
    }
    worst
}

pub fn batch(docs: &[(Vec<i64>, Vec<i64>)]) -> PackedBatch {
    PackedBatch::from_documents(docs)
}

/// A tiny Llama config.json (GQA, untied) for tests that need no Python.
pub const TINY_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.05,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "tie_word_embeddings": false, "hidden_act": "silu"
}"#;

/// A job config with `init = "random"` and [`TINY_CONFIG`] written in `dir`.
pub fn random_job(dir: &Path, extra: &str) -> JobConfig {
    random_job_of(dir, TINY_CONFIG, extra)
}

/// A job config with `init = "random"` and `config` written in `dir`.
pub fn random_job_of(dir: &Path, config: &str, extra: &str) -> JobConfig {
    let path = dir.join("config.json");
    std::fs::write(&path, config).unwrap();
    job_config(
        "random",
        &format!("config = \"{}\"\n{extra}", path.display()),
    )
}

/// The families beside Llama, as tiny configs of the same size as
/// [`TINY_CONFIG`] (Mistral and Gemma 3 with windows shorter than the
/// test documents; Gemma 3 with a sliding and a global layer).
pub const FAMILY_CONFIGS: [(&str, &str); 5] = [
    (
        "qwen3",
        r#"{"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
            "rms_norm_eps": 1e-6, "initializer_range": 0.05, "tie_word_embeddings": false}"#,
    ),
    (
        "qwen3_moe",
        r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": true, "mlp_only_layers": [0],
            "rms_norm_eps": 1e-6, "initializer_range": 0.05, "tie_word_embeddings": false}"#,
    ),
    (
        "olmo2",
        r#"{"model_type": "olmo2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "initializer_range": 0.05, "tie_word_embeddings": false}"#,
    ),
    (
        "mistral",
        r#"{"model_type": "mistral", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 8,
            "rms_norm_eps": 1e-6, "initializer_range": 0.05, "tie_word_embeddings": false}"#,
    ),
    (
        "gemma3",
        r#"{"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "query_pre_attn_scalar": 24, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "initializer_range": 0.05,
            "tie_word_embeddings": true, "pad_token_id": 0}"#,
    ),
];

/// Deterministic pseudo-random documents `(ids, labels)` of the given
/// lengths; the first `len / 4` labels of each are masked (a prompt).
pub fn synthetic_documents(lengths: &[usize], seed: u64) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % 300) as i64
    };
    lengths
        .iter()
        .map(|&n| {
            let ids: Vec<i64> = (0..n).map(|_| next()).collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(i, &t)| if i < n / 4 { -100 } else { t })
                .collect();
            (ids, labels)
        })
        .collect()
}

/// `docs` as one wire microbatch (document ids `d:0`, `d:1`, …); empty
/// for no document (a padding microbatch).
pub fn to_wire(docs: &[(Vec<i64>, Vec<i64>)]) -> accrue_worker::wire::Microbatch {
    use accrue_worker::wire;
    if docs.is_empty() {
        return wire::Microbatch::default();
    }
    let b = PackedBatch::from_documents(docs);
    let ids: Vec<u32> = b.input_ids.iter().map(|&t| t as u32).collect();
    let labels: Vec<i32> = b.labels.iter().map(|&t| t as i32).collect();
    wire::Microbatch {
        token_ids: accrue_proto::pack_u32(&ids),
        labels: accrue_proto::pack_i32(&labels),
        cu_seq_lens: b.cu_seq_lens.iter().map(|&c| c as u32).collect(),
        sequences: (0..docs.len())
            .map(|i| wire::PackedSequence {
                doc_id: format!("d:{i}"),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Checks that transformers, loading the checkpoint `ckpt`, gives
/// `model`'s logits for each of `docs` (packed as one row).
pub fn assert_transformers_logits(
    dir: &Path,
    ckpt: &Path,
    model: &accrue_worker::model::Llama,
    docs: &[(Vec<i64>, Vec<i64>)],
) {
    let batch = PackedBatch::from_documents(docs);
    let inputs: Vec<(String, Tensor)> = docs
        .iter()
        .enumerate()
        .map(|(i, (ids, _))| (format!("doc{i}.input_ids"), Tensor::from_slice(ids)))
        .collect();
    let inputs_path = dir.join("inputs.safetensors");
    Tensor::write_safetensors(&inputs, &inputs_path).unwrap();
    let out = dir.join("hf.safetensors");
    python(
        "hf_logits.py",
        &[
            ckpt.to_str().unwrap(),
            inputs_path.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    let theirs = read(&out);
    let ours = tch::no_grad(|| model.logits(&batch.input_ids, &batch.cu_seq_lens));
    for (i, w) in batch.cu_seq_lens.windows(2).enumerate() {
        let d = max_abs_diff(
            &ours.narrow(0, w[0], w[1] - w[0]),
            &theirs[&format!("doc{i}.logits")],
        );
        assert!(d <= 1e-4, "doc {i}: transformers logits differ by {d}");
    }
}
