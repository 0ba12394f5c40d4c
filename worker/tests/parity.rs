//! Parity with `transformers`: the worker's packed forward over several
//! documents gives the per-document logits, loss and gradients of
//! transformers run on each document separately (fp32). Tolerances: logits
//! max abs 1e-4, loss sum 1e-6 relative, gradients per tensor
//! ‖a−b‖ ≤ 1e-5·‖b‖ (measured: ~1e-6 everywhere).

mod common;

use accrue_worker::train::ReplicatedTrainer;
use tch::Tensor;

fn check_parity(variant: &str) {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let reference = common::make_reference(dir.path(), variant);
    let docs = common::documents(&reference);
    let total = i64::try_from(&reference["total_loss_tokens"]).unwrap() as u64;
    let model_dir = dir.path().join("model");
    if variant == "sharded" {
        let shards = std::fs::read_dir(&model_dir)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                let name = name.to_string_lossy();
                name.starts_with("model-") && name.ends_with(".safetensors")
            })
            .count();
        assert!(shards >= 2, "expected several shards, found {shards}");
        assert!(model_dir.join("model.safetensors.index.json").is_file());
    }
    // Small loss chunks so several chunks (and a ragged last one) are exercised.
    let cfg = common::job_config(
        model_dir.to_str().unwrap(),
        "[runtime]\nloss_chunk_tokens = 16\n",
    );
    let mut trainer = ReplicatedTrainer::single(&cfg, None).unwrap();
    let batch = common::batch(&docs);
    assert_eq!(batch.loss_tokens(), total);

    // Logits, per document, from one packed forward.
    let logits = tch::no_grad(|| trainer.model().logits(&batch.input_ids, &batch.cu_seq_lens));
    let mut worst_logit = 0.0f64;
    for (i, w) in batch.cu_seq_lens.windows(2).enumerate() {
        let ours = logits.narrow(0, w[0], w[1] - w[0]);
        let theirs = &reference[&format!("doc{i}.logits")];
        worst_logit = worst_logit.max(common::max_abs_diff(&ours, theirs));
    }
    println!("{variant}: logits max abs diff {worst_logit:e}");
    assert!(
        worst_logit <= 1e-4,
        "{variant}: logits differ by {worst_logit}"
    );

    // Loss and gradients, from one packed microbatch.
    let sums = trainer.microbatch(0, &batch, total).unwrap();
    let expected_loss: f64 = (0..docs.len())
        .map(|i| f64::try_from(&reference[&format!("doc{i}.loss_sum")]).unwrap())
        .sum();
    let rel = (sums.loss_sum - expected_loss).abs() / expected_loss;
    println!(
        "{variant}: loss sum {} vs {expected_loss} (rel {rel:e})",
        sums.loss_sum
    );
    assert!(
        rel <= 1e-6,
        "{variant}: loss sum {} vs {expected_loss}",
        sums.loss_sum
    );
    assert_eq!(sums.loss_tokens, total);
    assert_eq!(sums.tokens, batch.tokens() as u64);

    let grads = trainer.named_grads();
    let expected_params = reference.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(grads.len(), expected_params, "{variant}: parameter count");
    let mut worst = (0.0, String::new());
    for (name, g) in &grads {
        let theirs: &Tensor = reference
            .get(&format!("grad.{name}"))
            .unwrap_or_else(|| panic!("{variant}: no reference gradient for {name}"));
        let (d, n) = common::diff_norms(g, theirs);
        assert!(n > 0.0, "{variant}: reference gradient of {name} is zero");
        if d / n > worst.0 {
            worst = (d / n, name.clone());
        }
    }
    println!(
        "{variant}: worst gradient rel diff {:e} ({})",
        worst.0, worst.1
    );
    assert!(
        worst.0 <= 1e-5,
        "{variant}: gradient of {} differs by {}",
        worst.1,
        worst.0
    );
}

#[test]
fn parity_llama_gqa_untied_llama3_rope() {
    check_parity("llama");
}

#[test]
fn parity_qwen2_with_qkv_biases() {
    check_parity("qwen2");
}

#[test]
fn parity_llama_tied_embeddings() {
    check_parity("tied");
}

/// A checkpoint transformers saved in several shards with an index loads
/// with the same logits, loss and gradients.
#[test]
fn parity_llama_from_a_sharded_hf_checkpoint() {
    check_parity("sharded");
}

/// Qwen3: per-head q/k RMSNorm before RoPE, head_dim (24) apart from
/// hidden_size / heads (16).
#[test]
fn parity_qwen3_qk_norm_and_head_dim() {
    check_parity("qwen3");
}

/// OLMo 2: post-norm blocks, q/k RMSNorm over the whole projection.
#[test]
fn parity_olmo2_post_norm() {
    check_parity("olmo2");
}

/// Mistral with its sliding window (8 tokens; documents up to 33).
#[test]
fn parity_mistral_sliding_window() {
    check_parity("mistral");
}

/// Gemma 3 text: a sliding (window 8, local RoPE) and a global layer
/// (linear-scaled RoPE), (1 + w) norms before and after attention and
/// MLP, per-head q/k norm, √hidden embedding scale, GELU-tanh,
/// query_pre_attn_scalar 24 ≠ head_dim 16, tied embeddings.
#[test]
fn parity_gemma3_text() {
    check_parity("gemma3");
}

/// Qwen3-MoE: a dense layer (`mlp_only_layers`) and a sparse one (8
/// experts, top-2, `norm_topk_prob`), loaded from the hub layout
/// `save_pretrained` writes (one linear per expert); every expert's
/// gradient checked.
#[test]
fn parity_qwen3_moe() {
    check_parity("qwen3_moe");
}

/// Gemma 3 with the final-logit soft-cap configured (1: every logit
/// bent), through the chunked loss's hand-written gradient.
#[test]
fn parity_gemma3_soft_capping() {
    check_parity("gemma3_softcap");
}
