//! Per-rank training-state memory (parameters + gradients + AdamW moments)
//! at ddp and zero2 for world sizes 1, 2 and 4, on the issue's 4-layer,
//! hidden-256 Llama (vocab 32000). Ranks are threads joined by
//! `LocalGroup`; the numbers are the trainers' own `state_bytes()`.
//! Ignored by default (it builds 7 models of 24M parameters):
//! `cargo test -p accrue-worker --test memory_table -- --ignored --nocapture`.

mod common;

use accrue_worker::collective::local::LocalGroup;
use accrue_worker::train::{ReplicatedTrainer, StateBytes};

const CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
  "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "tie_word_embeddings": false, "hidden_act": "silu"
}"#;

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn measure(sharding: &str, world: usize) -> Vec<StateBytes> {
    measure_with(sharding, world, "")
}

/// [`measure`] with more spec sections (`extra`).
fn measure_with(sharding: &str, world: usize, extra: &str) -> Vec<StateBytes> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, CONFIG).unwrap();
    let cfg = common::job_config(
        "random",
        &format!(
            "config = \"{}\"\n[parallel]\nsharding = \"{sharding}\"\n{extra}",
            path.display()
        ),
    );
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .map(|coll| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                ReplicatedTrainer::new(&cfg, None, Box::new(coll))
                    .unwrap()
                    .state_bytes()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// What the trainer before issue 15 held (its `state_bytes()`, the same
/// layout): whole `.grad` tensors through the step at ddp and zero2, and a
/// flat float32 copy of the whole gradient at the boundary.
fn before(sharding: &str, world: u64, params: u64) -> (u64, u64, u64) {
    let optimizer = if sharding == "ddp" {
        2 * params
    } else {
        2 * params.div_ceil(world * 4) * 4
    };
    (params, optimizer, params)
}

#[test]
#[ignore = "builds 7 models of 24M parameters; run with --ignored --nocapture"]
fn memory_per_rank_ddp_and_zero2() {
    println!("| sharding | world | params MiB | grads MiB before → after | optimizer MiB | boundary buffer MiB before → after | backward transient MiB | total MiB/rank before → after |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut ddp_total = 0;
    for sharding in ["ddp", "zero2"] {
        for world in [1, 2, 4] {
            let ranks = measure(sharding, world);
            // The largest rank (zero2 shards differ by at most one element).
            let b = *ranks.iter().max_by_key(|b| b.total()).unwrap();
            let (grads0, opt0, boundary0) = before(sharding, world as u64, b.params);
            println!(
                "| {sharding} | {world} | {:.1} | {:.1} → {:.1} | {:.1} | {:.1} → {:.1} | {:.1} | {:.1} → {:.1} |",
                mib(b.params),
                mib(grads0),
                mib(b.grads),
                mib(b.optimizer),
                mib(boundary0),
                mib(b.boundary),
                mib(b.backward),
                mib(b.params + grads0 + opt0),
                mib(b.total())
            );
            assert_eq!(b.optimizer, opt0, "the moments are as before");
            if sharding == "ddp" {
                ddp_total = b.total();
                assert_eq!(b.optimizer, 2 * b.params, "fp32: two moments per parameter");
                assert_eq!(b.grads, b.params, "ddp keeps the whole fp32 gradient");
            } else {
                // Gradients and moments shrink with the world size; the
                // parameters (replicated at ZeRO-2) do not.
                let full = 2 * b.params;
                assert!(b.optimizer <= full / world as u64 + 8, "{world}: {b:?}");
                assert!(b.grads <= b.params / world as u64 + 4, "{world}: {b:?}");
                assert!(b.total() <= ddp_total);
            }
        }
    }
}

/// Full fine-tuning against LoRA (issue 35) on the same model: rank 16 on
/// every linear, the base frozen in the compute dtype (float32, or
/// bfloat16 with `precision.compute`), adapters and their gradients and
/// moments in float32. The LoRA rows hold no master copy, gradient or
/// moment of the base.
#[test]
#[ignore = "builds 12 models of 24M parameters; run with --ignored --nocapture"]
fn memory_per_rank_full_vs_lora() {
    const LORA: &str = "[lora]\nrank = 16\nalpha = 32\n";
    const BF16: &str = "[precision]\ncompute = \"bfloat16\"\n";
    println!("| training | sharding | world | trained params MiB | frozen base MiB | compute copy MiB | grads MiB | optimizer MiB | total MiB/rank |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (what, extra) in [
        ("full, fp32", String::new()),
        ("full, bf16 compute", BF16.to_string()),
        ("LoRA r16, fp32 base", LORA.to_string()),
        ("LoRA r16, bf16 base", format!("{BF16}{LORA}")),
    ] {
        for (sharding, world) in [("ddp", 1), ("zero2", 2), ("zero2", 4)] {
            let ranks = measure_with(sharding, world, &extra);
            let b = *ranks.iter().max_by_key(|b| b.total()).unwrap();
            println!(
                "| {what} | {sharding} | {world} | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} |",
                mib(b.params),
                mib(b.frozen),
                mib(b.compute_copy),
                mib(b.grads),
                mib(b.optimizer),
                mib(b.total())
            );
            if what.starts_with("LoRA") {
                assert!(b.params < b.frozen / 20, "{what}: {b:?}");
                assert_eq!(b.compute_copy, 0, "{what}: no compute copy");
            } else {
                assert_eq!(b.frozen, 0, "{what}: nothing frozen");
            }
        }
    }
}
