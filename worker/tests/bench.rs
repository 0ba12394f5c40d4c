//! Benchmarks (ignored by default; `scripts/bench_worker.sh` runs them in
//! release next to the PyTorch reference):
//! - `bench_train_step`: tokens/s of a training step (hidden 256, 4 layers,
//!   4 heads, intermediate 688, vocab 32000, 4096 packed tokens in 16
//!   documents, fp32, 2 threads), with both packed-attention implementations.
//!   Reads `$ACCRUE_BENCH_DIR/{config.json,batch.safetensors}`.
//! - `bench_loss_memory_{chunked,naive}`: peak RSS growth of the LM head +
//!   cross-entropy forward/backward for T = `$ACCRUE_BENCH_LOSS_T` (8192),
//!   H = 256, V = 152064. Run each in its own process (the high-water mark
//!   is per process).

mod common;

use std::path::PathBuf;
use std::time::Instant;

use accrue_worker::batch::PackedBatch;
use accrue_worker::model::{loss, PackedAttention};
use accrue_worker::train::{Engine, Trainer};
use tch::{Kind, Tensor};

fn bench_dir() -> PathBuf {
    PathBuf::from(
        std::env::var("ACCRUE_BENCH_DIR").expect("ACCRUE_BENCH_DIR (see scripts/bench_worker.sh)"),
    )
}

#[test]
#[ignore]
fn bench_train_step() {
    tch::set_num_threads(2);
    let dir = bench_dir();
    let b = common::read(&dir.join("batch.safetensors"));
    let batch = PackedBatch {
        input_ids: Vec::<i64>::try_from(&b["input_ids"]).unwrap(),
        labels: Vec::<i64>::try_from(&b["labels"]).unwrap(),
        cu_seq_lens: Vec::<i64>::try_from(&b["cu_seq_lens"]).unwrap(),
    };
    batch.validate().unwrap();
    let steps: usize = std::env::var("ACCRUE_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let cfg = common::job_config(
        "random",
        &format!("config = \"{}\"\n", dir.join("config.json").display()),
    );
    for mode in [PackedAttention::PerDocument, PackedAttention::BlockMask] {
        let mut t = Trainer::single(&cfg, None).unwrap();
        t.model_mut().attention = mode;
        let total = batch.loss_tokens();
        let step = |t: &mut Trainer| {
            t.microbatch(0, &batch, total).unwrap();
            t.optimizer_step(1e-4).unwrap();
        };
        step(&mut t); // warm-up
        let start = Instant::now();
        for _ in 0..steps {
            step(&mut t);
        }
        let dt = start.elapsed().as_secs_f64() / steps as f64;
        println!(
            "{{\"impl\": \"accrue-{mode:?}\", \"tokens\": {}, \"step_s\": {dt:.4}, \"tokens_per_s\": {:.1}}}",
            batch.tokens(),
            batch.tokens() as f64 / dt
        );
    }
}

/// Time split of one training step (forward to hidden states, chunked LM
/// head + cross-entropy with its backward, backward through the decoder,
/// optimizer), averaged over `ACCRUE_BENCH_STEPS` steps after a warm-up.
#[test]
#[ignore]
fn bench_profile_step() {
    tch::set_num_threads(2);
    let dir = bench_dir();
    let b = common::read(&dir.join("batch.safetensors"));
    let batch = PackedBatch {
        input_ids: Vec::<i64>::try_from(&b["input_ids"]).unwrap(),
        labels: Vec::<i64>::try_from(&b["labels"]).unwrap(),
        cu_seq_lens: Vec::<i64>::try_from(&b["cu_seq_lens"]).unwrap(),
    };
    let steps: usize = std::env::var("ACCRUE_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let chunk: usize = std::env::var("ACCRUE_BENCH_LOSS_CHUNK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let cfg = common::job_config(
        "random",
        &format!("config = \"{}\"\n", dir.join("config.json").display()),
    );
    let mut t = Trainer::single(&cfg, None).unwrap();
    let total = batch.loss_tokens();
    let targets = loss::shifted_targets(&batch.labels, &batch.cu_seq_lens);
    let mut split = [0.0f64; 4];
    for i in 0..=steps {
        let mut lap = Instant::now();
        let mut mark = |k: usize, lap: &mut Instant| {
            if i > 0 {
                split[k] += lap.elapsed().as_secs_f64();
            }
            *lap = Instant::now();
        };
        let model = t.model();
        let hidden = model.hidden(&batch.input_ids, &batch.cu_seq_lens);
        mark(0, &mut lap);
        let head = model.lm_head_weight();
        let out = loss::chunked_nll(&hidden, head, &targets, chunk, 1.0 / total as f64).unwrap();
        mark(1, &mut lap);
        loss::backward_into_model(&hidden, head, &out);
        mark(2, &mut lap);
        t.optimizer_step(1e-4).unwrap();
        mark(3, &mut lap);
    }
    let n = steps as f64;
    let [fwd, head, bwd, opt] = split.map(|s| s / n);
    println!(
        "{{\"profile\": \"accrue\", \"chunk\": {chunk}, \"forward_s\": {fwd:.3}, \"loss_head_s\": {head:.3}, \"backward_s\": {bwd:.3}, \"optimizer_s\": {opt:.3}, \"step_s\": {:.3}}}",
        fwd + head + bwd + opt
    );
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

fn loss_memory(chunked: bool) {
    tch::set_num_threads(2);
    tch::manual_seed(0);
    let t: i64 = std::env::var("ACCRUE_BENCH_LOSS_T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8192);
    let chunk: usize = std::env::var("ACCRUE_BENCH_LOSS_CHUNK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let (h, v) = (256i64, 152064i64);
    let hidden =
        (Tensor::randn([t, h], (Kind::Float, tch::Device::Cpu)) * 0.1).set_requires_grad(true);
    let weight =
        (Tensor::randn([v, h], (Kind::Float, tch::Device::Cpu)) * 0.02).set_requires_grad(true);
    let targets: Vec<i64> = (0..t).map(|i| (i * 7919) % v).collect();
    let (base, _) = rss();
    let start = Instant::now();
    let loss_sum = if chunked {
        let out = loss::chunked_nll(&hidden, &weight, &targets, chunk, 1.0 / t as f64).unwrap();
        loss::backward_into_model(&hidden, &weight, &out);
        out.loss_sum
    } else {
        let tgt = Tensor::from_slice(&targets);
        let logits = hidden.matmul(&weight.tr());
        let nll = logits.cross_entropy_loss::<Tensor>(&tgt, None, tch::Reduction::Sum, -100, 0.0);
        let value = f64::try_from(&nll).unwrap();
        (nll / t as f64).backward();
        value
    };
    let secs = start.elapsed().as_secs_f64();
    let (_, peak) = rss();
    println!(
        "{{\"loss\": \"{}\", \"T\": {t}, \"H\": {h}, \"V\": {v}, \"chunk\": {}, \"peak_extra_mib\": {:.0}, \"seconds\": {secs:.2}, \"mean_nll\": {:.5}}}",
        if chunked { "chunked" } else { "naive" },
        if chunked { chunk } else { t as usize },
        (peak.saturating_sub(base)) as f64 / (1 << 20) as f64,
        loss_sum / t as f64
    );
}

#[test]
#[ignore]
fn bench_loss_memory_chunked() {
    loss_memory(true);
}

#[test]
#[ignore]
fn bench_loss_memory_naive() {
    loss_memory(false);
}
