//! Training FLOPs of the tokens a microbatch actually processed, for MFU.
//!
//! Counted as in the PaLM paper's appendix B (and Megatron's MFU): a matmul
//! of `[m, k] × [k, n]` is `2·m·k·n` FLOPs forward and twice that backward,
//! so training costs 3× the forward. Elementwise work (norms, RoPE, SiLU,
//! softmax) is not counted. Per microbatch:
//!
//! - decoder matmuls: `6 · N_layer · tokens`, with `N_layer` the q/k/v/o and
//!   gate/up/down weights of every layer (GQA shrinks k/v); a sparse
//!   (mixture-of-experts) layer counts the weights a token goes through:
//!   its `top_k` experts and the router;
//! - LM head: `6 · V · H · head_rows`, only the rows that have a target go
//!   through the head (see `loss`);
//! - attention scores and the weighted sum of values: causal and per
//!   document, so `l(l+1)/2` query–key pairs in a document of length `l`;
//!   each pair costs `2·d` FLOPs in `QKᵀ` and `2·d` in `PV` forward, with
//!   `d = heads · head_dim`: `3 · 4 · d · Σ l(l+1)/2 = 6 · d · Σ l(l+1)` per
//!   layer for training.

use super::config::ModelConfig;

/// Weights of one dense decoder layer that go through matmuls.
pub fn layer_matmul_params(cfg: &ModelConfig) -> f64 {
    let h = cfg.hidden_size as f64;
    let q = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    let kv = (cfg.kv_heads() * cfg.head_dim()) as f64;
    let i = cfg.intermediate_size as f64;
    h * q + 2.0 * h * kv + q * h + 3.0 * h * i
}

/// Weights every token goes through in matmuls, over all the decoder's
/// layers (a sparse layer: its `top_k` experts and the router, not every
/// expert).
pub fn decoder_matmul_params(cfg: &ModelConfig) -> f64 {
    let dense = layer_matmul_params(cfg);
    let Ok(arch) = cfg.arch() else {
        return cfg.num_hidden_layers as f64 * dense;
    };
    let h = cfg.hidden_size as f64;
    let mlp = 3.0 * h * cfg.intermediate_size as f64;
    arch.layers
        .iter()
        .map(|l| match arch.moe {
            Some(m) if l.sparse.is_some() => {
                let experts = 3.0 * h * (m.intermediate * m.top_k) as f64;
                dense - mlp + experts + h * m.experts as f64
            }
            _ => dense,
        })
        .sum()
}

/// Training FLOPs (forward + backward) of one packed microbatch with
/// document boundaries `cu_seq_lens` of which `head_rows` tokens have a
/// target (go through the LM head).
pub fn training_flops(cfg: &ModelConfig, cu_seq_lens: &[i64], head_rows: u64) -> f64 {
    let tokens = cu_seq_lens.last().copied().unwrap_or(0).max(0) as f64;
    let layers = cfg.num_hidden_layers as f64;
    let d = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    let pairs2: f64 = cu_seq_lens
        .windows(2)
        .map(|w| {
            let l = (w[1] - w[0]).max(0) as f64;
            l * (l + 1.0)
        })
        .sum();
    let dense = 6.0 * decoder_matmul_params(cfg) * tokens;
    let head = 6.0 * (cfg.vocab_size * cfg.hidden_size) as f64 * head_rows as f64;
    let attention = 6.0 * layers * d * pairs2;
    dense + head + attention
}

/// [`training_flops`] of a LoRA job: the frozen base's matmuls and head
/// run forward and backward to their inputs only (4 FLOPs per weight and
/// token, not 6: no weight gradient), and each adapter's `adapter_params`
/// (`r · (in + out)` of every adapted linear, summed) train in full.
pub fn lora_training_flops(
    cfg: &ModelConfig,
    cu_seq_lens: &[i64],
    head_rows: u64,
    adapter_params: f64,
) -> f64 {
    let tokens = cu_seq_lens.last().copied().unwrap_or(0).max(0) as f64;
    let weight_grads = 2.0 * decoder_matmul_params(cfg) * tokens
        + 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64 * head_rows as f64;
    training_flops(cfg, cu_seq_lens, head_rows) - weight_grads + 6.0 * adapter_params * tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        serde_json::from_value(serde_json::json!({
            "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        }))
        .unwrap()
    }

    #[test]
    fn counts_matmuls_head_rows_and_causal_attention_per_document() {
        let c = cfg();
        // head_dim 4: q 8·8, k/v 8·4 each, o 8·8, mlp 3·8·16.
        assert_eq!(layer_matmul_params(&c), 64.0 + 64.0 + 64.0 + 384.0);
        // Two documents of 3 and 1 tokens, 2 rows with a target.
        let f = training_flops(&c, &[0, 3, 4], 2);
        let dense = 6.0 * 2.0 * 576.0 * 4.0;
        let head = 6.0 * 800.0 * 2.0;
        let attention = 6.0 * 2.0 * 8.0 * (3.0 * 4.0 + 1.0 * 2.0);
        assert_eq!(f, dense + head + attention);
        // Packing never makes attention cross documents: one document of 4
        // costs more than 3 + 1.
        assert!(training_flops(&c, &[0, 4], 2) > f);
        assert_eq!(training_flops(&c, &[0], 0), 0.0);
    }

    /// A sparse layer counts the experts a token goes through (top_k of
    /// them) and the router, not all of them.
    #[test]
    fn a_frozen_base_counts_no_weight_gradient() {
        let c = cfg();
        let full = training_flops(&c, &[0, 3, 4], 2);
        let lora = lora_training_flops(&c, &[0, 3, 4], 2, 10.0);
        let saved = 2.0 * 2.0 * 576.0 * 4.0 + 2.0 * 800.0 * 2.0;
        assert_eq!(lora, full - saved + 6.0 * 10.0 * 4.0);
    }

    #[test]
    fn a_sparse_layer_counts_its_active_experts() {
        let c: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4, "mlp_only_layers": [0],
        }))
        .unwrap();
        // Layer 0 dense (576); layer 1: attention 192, experts 2·3·8·4, router 8·4.
        assert_eq!(decoder_matmul_params(&c), 576.0 + 192.0 + 192.0 + 32.0);
    }
}
