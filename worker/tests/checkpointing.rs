//! Activation checkpointing per decoder layer (issue 15, item 4,
//! `runtime.activation_checkpointing`): the same update with and without
//! it at ddp and zero2 (fsdp always recomputes per layer, see `fsdp.rs`),
//! and less activation memory.
//!
//! Memory is the peak RSS growth of one microbatch's forward + backward
//! (hidden 256, 8 layers, 4096 tokens), each setting in its own child
//! process of this test binary (the high-water mark is per process).

mod common;

use std::process::Command;

use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::Collective;
use accrue_worker::train::{ReplicatedTrainer, Trainer};

/// Two steps of uneven microbatches on `world` ranks; rank 0's parameters.
fn train(sharding: &str, world: usize, checkpointing: bool) -> Vec<(String, tch::Tensor)> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(
        dir.path(),
        &format!(
            "[optimizer]\nweight_decay = 0.1\n[parallel]\nsharding = \"{sharding}\"\n\
             [runtime]\nloss_chunk_tokens = 32\nactivation_checkpointing = {checkpointing}\n"
        ),
    );
    let steps = [
        common::synthetic_documents(&[37, 5, 61, 12, 2, 28], 11),
        common::synthetic_documents(&[50, 3, 17, 8], 12),
    ];
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .map(|coll| {
            let cfg = cfg.clone();
            let steps = steps.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let rank = coll.rank();
                let mut t = ReplicatedTrainer::new(&cfg, None, Box::new(coll)).unwrap();
                for docs in &steps {
                    let total = common::batch(docs).loss_tokens();
                    let mine: Vec<_> = docs
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| i % world == rank)
                        .map(|(_, d)| d.clone())
                        .collect();
                    // Two microbatches per rank.
                    let (a, b) = mine.split_at(mine.len() / 2);
                    for (i, part) in [a, b].iter().enumerate() {
                        t.microbatch(i, &common::batch(part), total).unwrap();
                    }
                    t.optimizer_step(1e-3).unwrap();
                }
                common::snapshot(&t.named_parameters())
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .next()
        .unwrap()
}

#[test]
fn checkpointing_gives_the_same_update_at_ddp_and_zero2() {
    for (sharding, world) in [("ddp", 1), ("ddp", 2), ("zero2", 2)] {
        let plain = train(sharding, world, false);
        let recomputed = train(sharding, world, true);
        let (w, n) = common::worst_rel(&recomputed, &plain);
        println!(
            "{sharding} × {world}: checkpointed vs plain worst relative difference {w:e} ({n})"
        );
        assert!(w <= 1e-6, "{sharding} × {world}: {n} differs by {w:e}");
    }
}

/// (current RSS, high-water RSS) in bytes, from /proc/self/status.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

const CHILD_MODE: &str = "ACCRUE_TEST_CHECKPOINTING_CHILD";

/// The child: one microbatch, prints the peak RSS growth it caused.
#[test]
#[ignore = "run by activation_checkpointing_cuts_activation_memory in a child process"]
fn checkpointing_memory_child() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
      "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
      "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
      "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
      "tie_word_embeddings": false, "hidden_act": "silu"
    }"#;
    let path = dir.path().join("config.json");
    std::fs::write(&path, config).unwrap();
    let cfg = common::job_config(
        "random",
        &format!(
            "config = \"{}\"\n[runtime]\nactivation_checkpointing = {}\n",
            path.display(),
            mode == "on"
        ),
    );
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let docs = common::synthetic_documents(&[1024, 1024, 1024, 1024], 3);
    let b = common::batch(&docs);
    let (base, _) = rss();
    t.microbatch(0, &b, b.loss_tokens()).unwrap();
    let (_, peak) = rss();
    println!("PEAK_EXTRA {}", peak.saturating_sub(base));
}

fn child_peak(on: bool) -> u64 {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "checkpointing_memory_child",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_MODE, if on { "on" } else { "off" })
        // A fixed mmap threshold: every large tensor is its own mapping,
        // returned at free, so the high-water mark follows live tensors
        // rather than glibc's adaptive heap (which made the peak vary by
        // a third from run to run).
        .env("MALLOC_MMAP_THRESHOLD_", "131072")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.strip_prefix("PEAK_EXTRA "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no PEAK_EXTRA in child output:\n{text}"))
}

#[test]
fn activation_checkpointing_cuts_activation_memory() {
    let off = child_peak(false);
    let on = child_peak(true);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("| activation checkpointing | peak RSS growth of one microbatch (MiB) |");
    println!("|---|---|");
    println!("| off | {:.0} |", mib(off));
    println!("| on | {:.0} |", mib(on));
    assert!(
        (on as f64) < 0.6 * off as f64,
        "checkpointing should cut the peak: {} vs {} MiB",
        mib(on),
        mib(off)
    );
}
