//! The optimizer step against `torch.optim.AdamW` (issue 15, items 4 and
//! 5): three training steps of the tiny HF model, transformers + torch's
//! AdamW with two parameter groups (no decay on biases and norm weights)
//! and `clip_grad_norm_` on one side (`scripts/reference/adamw_groups.py`),
//! the worker's trainer (one pass over flat buffers, decay group first) on
//! the other. Per tensor ‖a−b‖ ≤ 2e-5·‖b‖ after every step (gradients
//! already agree to ~1e-6, see `parity.rs`), except Qwen2's k_proj bias
//! (2e-4): adding a constant to every key shifts each query's logits
//! uniformly, so its true gradient is zero and what both sides compute is
//! rounding noise, which Adam normalises to lr-sized steps. Decaying every
//! parameter instead misses the reference by far more.
//!
//! Both sides run with `eps = 1e-6`, not AdamW's default 1e-8: at step 1
//! an element's update is lr·g/(|g| + eps), so for gradients within a few
//! eps of zero the update follows the last bits of g, and those depend on
//! the CPU's matmul kernels. With 1e-8 the check failed on one machine and
//! passed on another, the same code and the same PyTorch (Qwen2's layer-1
//! `up_proj.weight` 1.68× its tolerance, also at the commit before); with
//! 1e-6 the worst tensor is 0.28× (qwen2) and 0.55× (llama) there, and
//! decaying every parameter still misses by 150×.

mod common;

use std::collections::HashMap;
use std::path::Path;

use accrue_worker::train::{ReplicatedTrainer, Trainer};
use tch::Tensor;

const TOL: f64 = 2e-5;
const STEPS: usize = 3;
const LR: f64 = 1e-2;
/// AdamW's eps on both sides (see the module docs).
const EPS: &str = "1e-6";

/// Qwen3-MoE's eps: the router's share of layer 0's gradient leaves a few
/// k_proj elements near 1e-7, where step 1's update follows the last bits
/// of the gradient (torch alone, float32 against float64, already moves
/// that tensor by 6.4e-6 of its norm; ours against torch 2.07e-5 with
/// 1e-6). With 1e-5 the slope of the update in g is 10× smaller.
fn eps(variant: &str) -> &'static str {
    if variant.starts_with("qwen3_moe") {
        "1e-5"
    } else {
        EPS
    }
}

fn torch_steps(dir: &Path, foreach: bool, eps: &str) -> HashMap<String, Tensor> {
    let out = dir.join("torch_adamw.safetensors");
    let model = dir.join("model");
    let reference = dir.join("reference.safetensors");
    let mut args = vec![
        model.to_str().unwrap(),
        reference.to_str().unwrap(),
        out.to_str().unwrap(),
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--wd",
        "0.1",
        "--betas",
        "0.9",
        "0.95",
        "--clip",
        "1.0",
        "--eps",
        eps,
    ];
    if foreach {
        args.push("--foreach");
    }
    common::python("adamw_groups.py", &args);
    common::read(&out)
}

/// The tolerance for parameter `name` (see the module docs).
fn tolerance(name: &str) -> f64 {
    if name.ends_with("k_proj.bias") {
        10.0 * TOL
    } else {
        TOL
    }
}

/// Per step, the worst per-tensor difference relative to its tolerance
/// (≤ 1 passes) and the tensor.
fn ours_vs_torch(
    dir: &Path,
    torch: &HashMap<String, Tensor>,
    no_decay: &str,
    eps: &str,
) -> Vec<(f64, String)> {
    let reference = common::read(&dir.join("reference.safetensors"));
    let docs = common::documents(&reference);
    let cfg = common::job_config(
        dir.join("model").to_str().unwrap(),
        &format!(
            "[optimizer]\nweight_decay = 0.1\nbetas = [0.9, 0.95]\neps = {eps}\ngrad_clip = 1.0\n\
             no_decay = {no_decay}\n[runtime]\nloss_chunk_tokens = 16\n"
        ),
    );
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let batch = common::batch(&docs);
    let total = batch.loss_tokens();
    (1..=STEPS)
        .map(|step| {
            t.microbatch(0, &batch, total).unwrap();
            t.optimizer_step(LR).unwrap();
            t.named_parameters()
                .iter()
                .map(|(n, p)| {
                    let (d, norm) = common::diff_norms(p, &torch[&format!("step{step}.{n}")]);
                    (d / norm.max(1e-30) / tolerance(n), n.clone())
                })
                .fold((0.0, String::new()), |a, b| if b.0 > a.0 { b } else { a })
        })
        .collect()
}

fn check(variant: &str, foreach: bool) {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    common::make_reference(dir.path(), variant);
    let eps = eps(variant);
    let torch = torch_steps(dir.path(), foreach, eps);
    let groups = ours_vs_torch(dir.path(), &torch, "[\"bias\", \"norm\"]", eps);
    println!("{variant} (foreach {foreach}): worst per-step diff / tolerance {groups:?}");
    for (step, (w, n)) in groups.iter().enumerate() {
        assert!(
            *w <= 1.0,
            "{variant} step {}: {n} differs by {w:.2} × its tolerance",
            step + 1
        );
    }
    // Decay on every parameter is a different optimizer: the check sees it.
    let all = ours_vs_torch(dir.path(), &torch, "[]", eps);
    let (w, n) = all.last().unwrap();
    println!("{variant}: decaying every parameter misses by {w:.1} × the tolerance ({n})");
    assert!(
        *w > 20.0,
        "{variant}: decay groups made no difference ({w})"
    );
}

#[test]
fn adamw_decay_groups_match_torch_llama() {
    check("llama", false);
}

/// Qwen2's q/k/v biases are in the no-decay group; torch's foreach path.
#[test]
fn adamw_decay_groups_match_torch_foreach_qwen2_biases() {
    check("qwen2", true);
}

/// The families (issue 34): 3 steps of transformers + torch AdamW.
#[test]
fn adamw_matches_torch_qwen3() {
    check("qwen3", false);
}

#[test]
fn adamw_matches_torch_olmo2() {
    check("olmo2", false);
}

#[test]
fn adamw_matches_torch_mistral_sliding_window() {
    check("mistral", true);
}

#[test]
fn adamw_matches_torch_gemma3() {
    check("gemma3", false);
}

/// Qwen3-MoE (a dense and a sparse layer): transformers holds the experts
/// fused, one AdamW parameter per layer; ours are one per expert —
/// elementwise the same optimizer.
#[test]
fn adamw_matches_torch_qwen3_moe() {
    check("qwen3_moe", false);
}
