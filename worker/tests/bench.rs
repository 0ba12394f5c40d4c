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
//! - `bench_optimizer_phase`: the optimizer phase of a step (global norm,
//!   clip, AdamW) on the bench model, today's one pass over flat buffers
//!   beside the per-parameter path it replaced, interleaved in one process
//!   (`scripts/bench_optimizer.sh` runs it beside torch's foreach AdamW).
//! - `bench_attention`: one attention layer's forward + backward over one
//!   document of T = `$ACCRUE_BENCH_ATTN_T` tokens (4 query heads over 1
//!   kv head of 64, fp32, 2 threads): seconds and peak RSS growth, one T
//!   per process (`scripts/bench_attention.sh` runs it beside torch SDPA).

mod common;

use std::path::PathBuf;
use std::time::Instant;

use accrue_worker::batch::PackedBatch;
use accrue_worker::model::{loss, PackedAttention};
use accrue_worker::train::{Passes, ReplicatedTrainer, Trainer};
use tch::{Device, Kind, Tensor};

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
        ..Default::default()
    };
    batch.validate().unwrap();
    let steps: usize = std::env::var("ACCRUE_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    // `ACCRUE_BENCH_DEVICE=cuda` and `ACCRUE_BENCH_PRECISION=bf16-mixed`
    // (scripts/gpu-check.sh): the same step on the GPU, with MFU.
    let device = match std::env::var("ACCRUE_BENCH_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        _ => Device::Cpu,
    };
    let precision = std::env::var("ACCRUE_BENCH_PRECISION").unwrap_or_else(|_| "fp32".into());
    let mixed = if precision == "bf16-mixed" {
        "[precision]\ncompute = \"bfloat16\"\n"
    } else {
        ""
    };
    let mut cfg = common::job_config(
        "random",
        &format!(
            "config = \"{}\"\n{mixed}",
            dir.join("config.json").display()
        ),
    );
    cfg.device = device;
    let peak = accrue_worker::session::peak_flops(None, &accrue_worker::device::describe(device));
    let modes = if device.is_cuda() {
        [PackedAttention::Bucketed, PackedAttention::PerDocument]
    } else {
        [PackedAttention::PerDocument, PackedAttention::BlockMask]
    };
    // `ACCRUE_BENCH_STEP_ONLY`: the default implementation only (the
    // masked one is T² per layer: minutes on a large model).
    let only_first = std::env::var("ACCRUE_BENCH_STEP_ONLY").is_ok();
    for mode in modes.into_iter().take(if only_first { 1 } else { 2 }) {
        let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
        t.set_attention(mode);
        let total = batch.loss_tokens();
        let step = |t: &mut ReplicatedTrainer| {
            t.microbatch(0, &batch, total).unwrap();
            t.optimizer_step(1e-4).unwrap();
        };
        step(&mut t); // warm-up
        if let Device::Cuda(n) = device {
            tch::Cuda::synchronize(n as i64);
        }
        let start = Instant::now();
        for _ in 0..steps {
            step(&mut t);
        }
        if let Device::Cuda(n) = device {
            tch::Cuda::synchronize(n as i64);
        }
        let dt = start.elapsed().as_secs_f64() / steps as f64;
        let flops = t.model_flops(&batch.cu_seq_lens, total);
        let mfu = if peak > 0.0 { flops / dt / peak } else { 0.0 };
        let name = if device.is_cuda() {
            format!("accrue-{mode:?}-{precision}-cuda")
        } else {
            format!("accrue-{mode:?}")
        };
        println!(
            "{{\"impl\": \"{name}\", \"tokens\": {}, \"step_s\": {dt:.4}, \"tokens_per_s\": {:.1}, \"model_flops\": {flops:.4e}, \"peak_flops\": {peak:.4e}, \"mfu\": {mfu:.4}}}",
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
        ..Default::default()
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
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
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
        let model = t.compute_model();
        let fwd = model.forward_train(
            &batch.input_ids,
            &batch.cu_seq_lens,
            false,
            &accrue_worker::model::Routes::default(),
        );
        mark(0, &mut lap);
        let head = model.lm_head_weight();
        let out = loss::chunked_nll(&fwd.hidden, head, &targets, chunk, 1.0 / total as f64, None)
            .unwrap();
        mark(1, &mut lap);
        t.backward(fwd, &out.grad_hidden, &out.grad_weight).unwrap();
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
        let out =
            loss::chunked_nll(&hidden, &weight, &targets, chunk, 1.0 / t as f64, None).unwrap();
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

/// The optimizer phase before issue 15, kept here to measure against: the
/// gradients flattened into a new buffer, the norm from an f64 copy, the
/// clip as its own pass, then per parameter the single-tensor AdamW as
/// ATen operations with their temporaries.
fn legacy_optimizer_phase(
    params: &[Tensor],
    grads: &[Tensor],
    m: &mut [Tensor],
    v: &mut [Tensor],
    step: i32,
    lr: f64,
) {
    let (beta1, beta2, eps) = (0.9f64, 0.999f64, 1e-8);
    tch::no_grad(|| {
        let parts: Vec<Tensor> = grads
            .iter()
            .map(|g| g.reshape([-1]).to_kind(Kind::Float))
            .collect();
        let mut flat = Tensor::cat(&parts, 0);
        let sq = f64::try_from(flat.to_kind(Kind::Double).square().sum(Kind::Double)).unwrap();
        let coef = (1.0 / (sq.sqrt() + 1e-6)).min(1.0);
        let _ = flat.g_mul_scalar_(coef);
        let mut offset = 0;
        let bias1 = 1.0 - beta1.powi(step);
        let bias2_sqrt = (1.0 - beta2.powi(step)).sqrt();
        let step_size = lr / bias1;
        for (i, p) in params.iter().enumerate() {
            let n = p.numel() as i64;
            let g = flat.narrow(0, offset, n).view(p.size().as_slice());
            offset += n;
            let mut p32 = p.to_kind(Kind::Float);
            let _ = m[i].lerp_(&g, 1.0 - beta1);
            let _ = v[i].g_mul_scalar_(beta2);
            let _ = v[i].addcmul_(&(&g * (1.0 - beta2)), &g);
            let denom = v[i].sqrt() / bias2_sqrt + eps;
            let _ = p32.addcdiv_(&(&m[i] * -step_size), &denom);
        }
    });
}

/// Seconds of the optimizer phase (norm, clip, AdamW) of the bench model
/// at world 1, per round: each round trains one microbatch (not timed),
/// then times the per-parameter path on copies of the state and the
/// trainer's own step, in alternating order.
#[test]
#[ignore]
fn bench_optimizer_phase() {
    tch::set_num_threads(2);
    let dir = bench_dir();
    let b = common::read(&dir.join("batch.safetensors"));
    let batch = PackedBatch {
        input_ids: Vec::<i64>::try_from(&b["input_ids"]).unwrap(),
        labels: Vec::<i64>::try_from(&b["labels"]).unwrap(),
        cu_seq_lens: Vec::<i64>::try_from(&b["cu_seq_lens"]).unwrap(),
        ..Default::default()
    };
    let rounds: usize = std::env::var("ACCRUE_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let cfg = common::job_config(
        "random",
        &format!(
            "config = \"{}\"\n[optimizer]\nweight_decay = 0.0\n",
            dir.join("config.json").display()
        ),
    );
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let total = batch.loss_tokens();
    let params: Vec<Tensor> = t.named_parameters().iter().map(|(_, p)| p.copy()).collect();
    let zeros = || -> Vec<Tensor> {
        params
            .iter()
            .map(|p| Tensor::zeros(p.size(), (Kind::Float, Device::Cpu)))
            .collect()
    };
    let (mut m, mut v) = (zeros(), zeros());
    let numel: usize = params.iter().map(Tensor::numel).sum();
    for round in 0..=rounds {
        t.microbatch(0, &batch, total).unwrap();
        let grads: Vec<Tensor> = t.named_grads().iter().map(|(_, g)| g.copy()).collect();
        let mut time_new = || {
            let start = Instant::now();
            t.optimizer_step(1e-4).unwrap();
            start.elapsed().as_secs_f64()
        };
        let mut time_old = || {
            let start = Instant::now();
            legacy_optimizer_phase(&params, &grads, &mut m, &mut v, round as i32 + 1, 1e-4);
            start.elapsed().as_secs_f64()
        };
        let (new, old) = if round % 2 == 0 {
            let n = time_new();
            (n, time_old())
        } else {
            let o = time_old();
            (time_new(), o)
        };
        if round > 0 {
            // Round 0 warms up allocators and caches.
            println!(
                "{{\"phase\": \"optimizer\", \"params\": {numel}, \"round\": {round}, \"flat_s\": {new:.4}, \"per_parameter_s\": {old:.4}}}"
            );
        }
    }
}

/// One attention layer's forward and backward over one document of T
/// tokens (`scripts/bench_attention.sh`): what the packed path does per
/// document (causal SDPA, grouped-query attention without repeated k/v on
/// the CPU), timed, with the RSS it adds (q/k/v, the output, their
/// gradients and whatever the kernel keeps).
#[test]
#[ignore]
fn bench_attention() {
    use accrue_worker::model::attention::Attention;
    use accrue_worker::model::ModelConfig;
    tch::set_num_threads(2);
    tch::manual_seed(0);
    let t: i64 = std::env::var("ACCRUE_BENCH_ATTN_T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let (heads, kv, d) = (4i64, 1i64, 64i64);
    let cfg = ModelConfig::from_json(&serde_json::json!({
        "model_type": "llama", "vocab_size": 320, "hidden_size": heads * d,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": t, "rms_norm_eps": 1e-6
    }))
    .unwrap();
    let arch = cfg.arch().unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let attn = Attention::new(vs.root(), &cfg, &arch, &arch.layers[0]);
    let make =
        |h: i64| Tensor::randn([h, t, d], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (q, k, v) = (make(heads), make(kv), make(kv));
    let grad_out = Tensor::randn([heads, t, d], (Kind::Float, Device::Cpu));
    let (base, _) = rss();
    let start = Instant::now();
    let out = attn.attend(&q, &k, &v, &[0, t], PackedAttention::PerDocument);
    let fwd = start.elapsed().as_secs_f64();
    let grads = Tensor::run_backward(
        &[(&out * &grad_out).sum(Kind::Float)],
        &[&q, &k, &v],
        false,
        false,
    );
    let secs = start.elapsed().as_secs_f64();
    let (_, peak) = rss();
    let checksum = f64::try_from(grads[1].abs().sum(Kind::Double)).unwrap();
    println!(
        "{{\"attention\": \"accrue\", \"T\": {t}, \"heads\": {heads}, \"kv_heads\": {kv}, \"head_dim\": {d}, \"forward_s\": {fwd:.3}, \"seconds\": {secs:.3}, \"peak_extra_mib\": {:.1}, \"dk_abs_sum\": {checksum:.4e}}}",
        (peak.saturating_sub(base)) as f64 / (1 << 20) as f64,
    );
}

/// Context parallelism's memory (issue 37): one training forward +
/// backward of one document of `$ACCRUE_BENCH_CP_T` tokens as this
/// process's share under `$ACCRUE_BENCH_CP_RANKS` ranks (rank
/// `$ACCRUE_BENCH_CP_RANK`; the ranks meet over the TCP ring through port
/// files in `$ACCRUE_BENCH_CP_DIR`), or with the ordinary per-layer
/// recomputation when there is one rank. A Llama of hidden 256 (8 query
/// heads over 2 kv heads of 32), 2 layers, intermediate 688, vocab 8192,
/// fp32, one thread. Prints seconds and peak RSS growth over the built
/// model (`scripts/bench_context.sh` runs the ranks together).
#[test]
#[ignore]
fn bench_context_rank() {
    use accrue_worker::collective::{tcp, Collective};
    use accrue_worker::model::context::RowShard;
    use accrue_worker::model::recompute::VarGroups;
    use accrue_worker::model::{Init, Llama, ModelConfig, Routes};
    tch::set_num_threads(1);
    let var = |name: &str| -> i64 { std::env::var(name).unwrap().parse().unwrap() };
    let (t, ranks, rank) = (
        var("ACCRUE_BENCH_CP_T"),
        var("ACCRUE_BENCH_CP_RANKS"),
        var("ACCRUE_BENCH_CP_RANK"),
    );
    let raw = serde_json::json!({
        "model_type": "llama", "vocab_size": 8192, "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": t, "rms_norm_eps": 1e-6
    });
    let cfg = ModelConfig::from_json(&raw).unwrap();
    let model = Llama::new(cfg, raw, Kind::Float, Device::Cpu, Init::Seeded(1)).unwrap();
    let mut named: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let vars: Vec<Tensor> = named.into_iter().map(|(_, v)| v).collect();
    let groups = VarGroups::new(&names, 2, false);
    let ids: Vec<i64> = (0..t).map(|i| (i * 7919 + 13) % 8192).collect();
    let targets: Vec<i64> = (0..t)
        .map(|i| {
            if i + 1 < t {
                ids[(i + 1) as usize]
            } else {
                -100
            }
        })
        .collect();
    let cu = [0, t];
    let mut ring: Option<Box<dyn Collective>> = None;
    if ranks > 1 {
        let dir = PathBuf::from(std::env::var("ACCRUE_BENCH_CP_DIR").unwrap());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().to_string();
        std::fs::write(dir.join(format!("tmp-{rank}")), &port).unwrap();
        std::fs::rename(
            dir.join(format!("tmp-{rank}")),
            dir.join(format!("port-{rank}")),
        )
        .unwrap();
        let peers: Vec<String> = (0..ranks)
            .map(|r| loop {
                if let Ok(p) = std::fs::read_to_string(dir.join(format!("port-{r}"))) {
                    break p;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            })
            .collect();
        let link = accrue_collective::LinkKey::new(&[7u8; 32], false).unwrap();
        let r = tcp::connect_cpu(
            &listener,
            rank as usize,
            ranks as usize,
            &peers,
            1,
            std::time::Duration::from_secs(600),
            link,
        )
        .unwrap();
        ring = Some(Box::new(r));
    }
    let (base, _) = rss();
    let start = Instant::now();
    let routes = Routes::default();
    let head = |hidden: &Tensor, targets: &[i64]| {
        loss::chunked_nll_with(
            hidden,
            model.lm_head_weight(),
            targets,
            1024,
            1.0 / t as f64,
            None,
            true,
        )
        .unwrap()
    };
    let (grads, loss_sum) = match ring.as_mut() {
        None => {
            let f = model.forward_train(&ids, &cu, true, &routes);
            let l = head(&f.hidden, &targets);
            let g = model.backward_train(f, &l.grad_hidden, &l.grad_weight, &vars, &groups);
            (g, l.loss_sum)
        }
        Some(coll) => {
            let shard = RowShard::new(&cu, ranks, rank);
            let f = model
                .forward_train_context(&shard.take(&ids), &shard, coll.as_mut(), &routes)
                .unwrap();
            let l = head(&f.hidden, &shard.take(&targets));
            let g = model
                .backward_train_context(
                    f,
                    &l.grad_hidden,
                    &l.grad_weight,
                    &vars,
                    &groups,
                    coll.as_mut(),
                )
                .unwrap();
            (g, l.loss_sum)
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let (_, peak) = rss();
    let norm: f64 = grads
        .iter()
        .filter(|g| g.defined())
        .map(|g| f64::try_from(g.square().sum(Kind::Double)).unwrap())
        .sum();
    println!(
        "{{\"context\": {ranks}, \"rank\": {rank}, \"T\": {t}, \"tokens_here\": {}, \"seconds\": {secs:.2}, \"peak_extra_mib\": {:.1}, \"loss_sum\": {loss_sum:.6}, \"grad_sq_sum\": {norm:.6e}}}",
        RowShard::new(&cu, ranks, rank).held.len(),
        (peak.saturating_sub(base)) as f64 / (1 << 20) as f64,
    );
}
