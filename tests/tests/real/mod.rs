//! Shared by the real-process tests that run the worker (local.rs,
//! faults.rs): the built binaries and the tiny model's config.
#![allow(dead_code)]

pub mod cluster;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;

static BUILD: Once = Once::new();

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// target/<profile>, after building the coordinator, CLI and worker binaries;
/// or `$ACCRUE_TEST_BINS` when set, a directory already holding them
/// (scripts/chaos.sh sets it to a snapshot, so a build from elsewhere into a
/// shared target directory cannot swap the binaries under a long run).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ACCRUE_TEST_BINS") {
        return PathBuf::from(dir);
    }
    BUILD.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "-q",
                "-p",
                "accrue-coordinator",
                "-p",
                "accrue-cli",
                "-p",
                "accrue-worker",
                "--bins",
            ])
            .current_dir(root())
            .status()
            .expect("running cargo build");
        assert!(
            status.success(),
            "building the binaries failed (run through scripts/test.sh, which sources scripts/env.sh)"
        );
    });
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// A tiny Llama (hidden 64, 2 layers, GQA) for the byte tokenizer; a tiny
/// Qwen3 of the same size with `ACCRUE_TEST_FAMILY=qwen3` (the chaos soak
/// with another family: `ACCRUE_TEST_FAMILY=qwen3 scripts/chaos.sh`).
/// The Qwen3 is untied: tied, this tiny model spikes around step 34 of the
/// soak's job at lr 3e-3, and the spike amplifies the last-bit differences
/// between world sizes (1e-8 per step before it) to 1e-5..3e-4 by step 48
/// with no fault at all — the soak's exact comparison would then measure
/// the spike, not the fault paths.
pub fn write_tiny_config(d: &Path) {
    if std::env::var("ACCRUE_TEST_FAMILY").as_deref() == Ok("qwen3") {
        std::fs::write(
            d.join("tiny.json"),
            r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,
"intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":24,
"num_hidden_layers":2,"vocab_size":320,"max_position_embeddings":512,"rms_norm_eps":1e-6,
"rope_parameters":{"rope_type":"default","rope_theta":1000000.0},"initializer_range":0.02,
"tie_word_embeddings":false,"bos_token_id":256,"eos_token_id":257}"#,
        )
        .unwrap();
        return;
    }
    std::fs::write(
        d.join("tiny.json"),
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,
"intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
"vocab_size":320,"max_position_embeddings":512,"rms_norm_eps":1e-5,"rope_theta":10000.0,
"initializer_range":0.02,"tie_word_embeddings":false,"bos_token_id":256,"eos_token_id":257}"#,
    )
    .unwrap();
}

/// Runs `accrue ARGS` in `dir` and returns its output; a failure panics
/// with the command, its status, stdout, stderr and `context()` (e.g. the
/// workers' logs).
pub fn accrue_in(
    dir: &Path,
    args: &[&str],
    context: impl FnOnce() -> String,
) -> std::process::Output {
    let out = Command::new(bin_dir().join("accrue"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running accrue");
    assert!(
        out.status.success(),
        "accrue {args:?} failed ({:?}):\n{}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        context()
    );
    out
}

/// `accrue --coordinator URL ARGS` in `dir`: its stdout.
pub fn accrue_at(url: &str, dir: &Path, args: &[&str], context: impl FnOnce() -> String) -> String {
    let args = [&["--coordinator", url][..], args].concat();
    String::from_utf8_lossy(&accrue_in(dir, &args, context).stdout).into_owned()
}
