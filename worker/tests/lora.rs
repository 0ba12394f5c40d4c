//! LoRA against PEFT (issue 35): the tiny transformers models of
//! `make_tiny_llama.py` wrapped by `peft.get_peft_model` and trained with
//! torch's AdamW (`scripts/reference/lora_peft.py`), starting from one
//! PEFT adapter with a non-zero B (every LoRA weight gets a gradient at
//! step 1), which the Accrue job loads as `lora.init`. Three steps of SFT
//! and of DPO (reference: the base with the adapters off), on 1 rank and
//! on 2 ranks at ddp and zero2 with uneven microbatches and padding:
//! every adapter weight after every step equals PEFT's (per tensor
//! ‖a−b‖ ≤ 1e-5·‖b‖), and the base weights stay bit-identical to the
//! checkpoint they were loaded from.
//!
//! AdamW's eps is 1e-6 on both sides (see `optimizer.rs`: at step 1 an
//! element's update follows the last bits of a near-zero gradient).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use accrue_worker::batch::{MicrobatchMeta, PackedBatch, SeqMeta, StepNorms};
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::model::lora::is_adapter;
use accrue_worker::train::{FsdpTrainer, Passes, ReplicatedTrainer, Trainer};
use tch::Tensor;

const TOL: f64 = 1e-5;
const STEPS: usize = 3;
const EPS: &str = "1e-6";
const LR: &str = "1e-3";

type Doc = (Vec<i64>, Vec<i64>);

struct Reference {
    model: PathBuf,
    init: PathBuf,
    docs: Vec<Doc>,
    steps: HashMap<String, Tensor>,
}

fn reference(dir: &Path, variant: &str, objective: &str, targets: &str) -> Reference {
    let tensors = common::make_reference(dir, variant);
    let model = dir.join("model");
    let out = dir.join("peft");
    common::python(
        "lora_peft.py",
        &[
            model.to_str().unwrap(),
            dir.join("reference.safetensors").to_str().unwrap(),
            out.to_str().unwrap(),
            "--objective",
            objective,
            "--targets",
            targets,
            "--steps",
            &STEPS.to_string(),
            "--eps",
            EPS,
            "--lr",
            LR,
        ],
    );
    Reference {
        model,
        init: out.join("init"),
        docs: common::documents(&tensors),
        steps: common::read(&out.join("steps.safetensors")),
    }
}

fn job(
    r: &Reference,
    sharding: &str,
    objective: &str,
    targets: &str,
) -> accrue_worker::config::JobConfig {
    let objective = match objective {
        "dpo" => "[objective]\nkind = \"dpo\"\nbeta = 0.1\nreference = \"live\"\n",
        _ => "",
    };
    let targets = if targets == "all-linear" {
        "\"all-linear\"".to_string()
    } else {
        format!("{:?}", targets.split(',').collect::<Vec<_>>())
    };
    common::job_config(
        r.model.to_str().unwrap(),
        &format!(
            "[optimizer]\nlr = {LR}\nweight_decay = 0.1\ngrad_clip = 1.0\neps = {EPS}\nbetas = [0.9, 0.95]\n\
             [runtime]\nloss_chunk_tokens = 16\n[parallel]\nsharding = \"{sharding}\"\n{objective}\
             [lora]\nrank = 4\nalpha = 8\ntarget_modules = {targets}\ninit = \"{}\"\n",
            r.init.display(),
        ),
    )
}

/// One rank's microbatches of a step: SFT documents, or DPO pairs
/// (documents 2i, 2i+1) with their roles.
fn microbatches(
    docs: &[Doc],
    objective: &str,
    groups: &[Vec<usize>],
) -> Vec<(PackedBatch, MicrobatchMeta)> {
    groups
        .iter()
        .map(|g| {
            if g.is_empty() {
                return (PackedBatch::default(), MicrobatchMeta::default());
            }
            if objective == "sft" {
                let d: Vec<Doc> = g.iter().map(|&i| docs[i].clone()).collect();
                return (common::batch(&d), MicrobatchMeta::default());
            }
            let mut d = Vec::new();
            let mut seqs = Vec::new();
            for &p in g {
                for role in 0..2u32 {
                    d.push(docs[2 * p + role as usize].clone());
                    seqs.push(SeqMeta {
                        doc_id: format!("pair-{p}"),
                        role,
                        advantage: None,
                        ref_logp: None,
                    });
                }
            }
            (
                common::batch(&d),
                MicrobatchMeta {
                    seqs,
                    ..Default::default()
                },
            )
        })
        .collect()
}

/// Trains `STEPS` steps on `layout[rank]` (groups of documents or pairs
/// per microbatch) and returns, per step, rank 0's adapters, and the base
/// weights after training.
fn train(
    r: &Reference,
    sharding: &str,
    objective: &str,
    targets: &str,
    layout: &[Vec<Vec<usize>>],
) -> Trained {
    let cfg = job(r, sharding, objective, targets);
    let world = layout.len();
    let norms = StepNorms {
        loss_tokens: common::batch(&r.docs).loss_tokens(),
        pairs: (r.docs.len() / 2) as u64,
        sequences: 0,
    };
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let cfg = cfg.clone();
            let mbs = microbatches(&r.docs, objective, &layout[rank]);
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                if cfg.sharding == accrue_worker::config::Sharding::Fsdp {
                    let mut t = FsdpTrainer::new(&cfg, None, Box::new(coll)).unwrap();
                    let split = |all: Vec<(String, Tensor)>| {
                        let (a, b): (Vec<_>, Vec<_>) =
                            all.into_iter().partition(|(n, _)| is_adapter(n));
                        (a, b)
                    };
                    let per_step = run_steps(
                        &mut t,
                        &mbs,
                        &norms,
                        |_, _| {},
                        |t| split(t.named_full_parameters().unwrap()).0,
                    );
                    let base = split(t.named_full_parameters().unwrap()).1;
                    return (per_step, base, Vec::new());
                }
                let mut t = ReplicatedTrainer::new(&cfg, None, Box::new(coll)).unwrap();
                let mut grads = Vec::new();
                let per_step = run_steps(
                    &mut t,
                    &mbs,
                    &norms,
                    |t, s| {
                        if s == 0 && world == 1 {
                            grads = common::snapshot(&t.named_grads());
                        }
                    },
                    |t| common::snapshot(&t.named_parameters()),
                );
                let mut base: Vec<(String, Tensor)> = t
                    .model()
                    .vs
                    .variables()
                    .into_iter()
                    .filter(|(n, _)| !is_adapter(n))
                    .map(|(n, t)| (n, t.detach().copy()))
                    .collect();
                base.sort_by(|a, b| a.0.cmp(&b.0));
                (per_step, base, grads)
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (steps, _, _)) in results.iter().enumerate().skip(1) {
        let (w, n) = common::worst_rel(&steps[STEPS - 1], &results[0].0[STEPS - 1]);
        assert_eq!(
            w, 0.0,
            "rank {rank}'s adapters drifted from rank 0's at {n}"
        );
    }
    let (steps, base, grads) = results.swap_remove(0);
    Trained { steps, base, grads }
}

/// `STEPS` steps of `mbs`: `before(t, step)` runs after a step's
/// microbatches (its gradients), `after(t)` after its optimizer step (what
/// is kept of the step).
fn run_steps<T: Trainer>(
    t: &mut T,
    mbs: &[(PackedBatch, MicrobatchMeta)],
    norms: &StepNorms,
    mut before: impl FnMut(&mut T, usize),
    mut after: impl FnMut(&mut T) -> Vec<(String, Tensor)>,
) -> Vec<Vec<(String, Tensor)>> {
    let mut per_step = Vec::new();
    for s in 0..STEPS {
        for (i, (mb, meta)) in mbs.iter().enumerate() {
            t.train_microbatch(i, mb, meta, norms).unwrap();
        }
        before(t, s);
        t.optimizer_step(LR.parse().unwrap()).unwrap();
        per_step.push(after(t));
    }
    per_step
}

/// Rank 0's adapters after every step, its base weights after training,
/// and (one rank) the gradients of step 1.
struct Trained {
    steps: Vec<Vec<(String, Tensor)>>,
    base: Vec<(String, Tensor)>,
    grads: Vec<(String, Tensor)>,
}

fn parity(variant: &str, objective: &str, targets: &str) {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let r = reference(dir.path(), variant, objective, targets);
    let units = if objective == "sft" {
        r.docs.len()
    } else {
        r.docs.len() / 2
    };
    assert!(units >= 3, "{units} documents or pairs");
    let all: Vec<usize> = (0..units).collect();
    // 1 rank, uneven microbatches; 2 ranks, rank 1 with a padding one.
    let one = vec![vec![all[..1].to_vec(), all[1..].to_vec()]];
    let two = vec![
        vec![all[..1].to_vec(), all[1..2].to_vec()],
        vec![all[2..].to_vec(), vec![]],
    ];
    let stored = common::read(&r.model.join("model.safetensors"));
    for (sharding, layout) in [
        ("ddp", &one),
        ("ddp", &two),
        ("zero2", &two),
        ("fsdp", &two),
    ] {
        let Trained { steps, base, grads } = train(&r, sharding, objective, targets, layout);
        let mut worst = (0.0f64, String::new());
        for (name, g) in &grads {
            let (d, n) = common::diff_norms(g, &r.steps[&format!("grad.{name}")]);
            assert!(n > 0.0, "{name}: PEFT's gradient is zero");
            if d / n > worst.0 {
                worst = (d / n, format!("gradient of {name}"));
            }
        }
        for (s, adapters) in steps.iter().enumerate() {
            assert!(!adapters.is_empty());
            for (name, got) in adapters {
                assert!(is_adapter(name), "{name} trained");
                let want = r
                    .steps
                    .get(&format!("step{}.{name}", s + 1))
                    .unwrap_or_else(|| panic!("PEFT has no {name}"));
                let (d, n) = common::diff_norms(got, want);
                if d / n > worst.0 {
                    worst = (d / n, format!("step {} {name}", s + 1));
                }
            }
            let theirs = r
                .steps
                .keys()
                .filter(|k| k.starts_with(&format!("step{}.", s + 1)))
                .count();
            assert_eq!(adapters.len(), theirs, "adapter count");
        }
        println!(
            "{variant} {objective} {targets} {sharding} {} ranks: worst adapter ‖a−b‖/‖b‖ {:e} ({})",
            layout.len(),
            worst.0,
            worst.1
        );
        assert!(worst.0 <= TOL, "{}: {:e}", worst.1, worst.0);
        for (name, t) in &base {
            let want = &stored[name];
            assert!(
                t.equal(want),
                "{sharding}: base weight {name} changed while training adapters"
            );
        }
        assert_eq!(base.len(), stored.len(), "base variables");
    }
}

#[test]
fn sft_llama_all_linear_equals_peft() {
    parity("llama", "sft", "all-linear");
}

#[test]
fn dpo_llama_equals_peft_with_the_base_as_reference() {
    parity("llama", "dpo", "q_proj,v_proj,down_proj");
}

#[test]
fn sft_qwen3_equals_peft() {
    parity(
        "qwen3",
        "sft",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    );
}

#[test]
fn dpo_qwen3_all_linear_equals_peft() {
    parity("qwen3", "dpo", "all-linear");
}

/// A trained adapter's checkpoint exports (`accrue export`) as a folder
/// `PeftModel.from_pretrained` loads with our logits, and `--merge` as
/// the model PEFT's `merge_and_unload` makes.
#[test]
fn exported_adapter_loads_in_peft_and_merged_export_equals_merge_and_unload() {
    use accrue_coordinator::model::export::{export, ExportOptions};
    use accrue_worker::train::Checkpointing;
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let r = reference(dir.path(), "llama", "sft", "q_proj,o_proj,up_proj");
    let cfg = job(&r, "ddp", "sft", "q_proj,o_proj,up_proj");
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let mb = common::batch(&r.docs);
    let norms = StepNorms {
        loss_tokens: mb.loss_tokens(),
        ..Default::default()
    };
    t.train_microbatch(0, &mb, &MicrobatchMeta::default(), &norms)
        .unwrap();
    t.optimizer_step(1e-2).unwrap();
    let ckpt = dir.path().join("ckpt");
    t.save_checkpoint(&ckpt).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        config["base_model_name_or_path"].as_str(),
        r.model.to_str(),
        "the adapter names its base"
    );
    let (adapter, merged) = (dir.path().join("adapter"), dir.path().join("merged"));
    for (out, merge) in [(&adapter, false), (&merged, true)] {
        let opts = ExportOptions {
            dtype: None,
            shard_bytes: 5 << 30,
            merge,
        };
        export(&ckpt, out, &opts).unwrap();
    }
    assert!(adapter.join("adapter_model.safetensors").is_file());
    assert!(!adapter.join("model.safetensors").exists());
    assert!(merged.join("model.safetensors").is_file());
    // A checkpoint holding the whole model cannot be merged.
    let whole = dir.path().join("whole");
    let e = export(
        &r.model,
        &whole,
        &ExportOptions {
            dtype: None,
            shard_bytes: 5 << 30,
            merge: true,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("LoRA"), "{e}");

    let ids: Vec<i64> = r.docs[0].0.clone();
    let ours = t.model().logits(&ids, &[0, ids.len() as i64]);
    let out = dir.path().join("logits.safetensors");
    let mut args: Vec<String> = [&r.model, &adapter, &merged, &out]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    args.extend(ids.iter().map(i64::to_string));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report: serde_json::Value = serde_json::from_str(
        common::python_output("lora_export.py", &args)
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    let theirs = common::read(&out);
    let peft = common::max_abs_diff(&ours, &theirs["peft.logits"]);
    let merged_logits = common::max_abs_diff(&theirs["merged.logits"], &theirs["peft.logits"]);
    let weights = report["worst_weight_diff"].as_f64().unwrap();
    println!(
        "logits vs PEFT {peft:e}; merged export vs PEFT {merged_logits:e}; merged weights vs merge_and_unload {weights:e} ({})",
        report["worst"]
    );
    assert!(peft <= 1e-5, "our logits vs PEFT's: {peft}");
    assert!(
        merged_logits <= 1e-5,
        "merged export's logits: {merged_logits}"
    );
    assert!(weights <= 1e-6, "merged weights: {weights}");
    // The adapter is not a no-op: the base alone scores otherwise.
    let base = t
        .model()
        .without_adapters(|| t.model().logits(&ids, &[0, ids.len() as i64]));
    assert!(common::max_abs_diff(&ours, &base) > 1e-3);
}

/// Generation (KV-cache decode, batched, sampled) with adapters equals
/// generation with the adapters merged into the weights: the same tokens
/// and the same log-probs.
#[test]
fn generation_with_adapters_equals_the_merged_models() {
    use accrue_worker::generate::{generate, Request, SamplingParams};
    use accrue_worker::model::{Init, Llama, ModelConfig};
    use tch::{Device, Kind};
    let build = || {
        let raw: serde_json::Value = serde_json::from_str(common::TINY_CONFIG).unwrap();
        let cfg: ModelConfig = serde_json::from_value(raw.clone()).unwrap();
        Llama::new(cfg, raw, Kind::Float, Device::Cpu, Init::Seeded(5)).unwrap()
    };
    let mut adapted = build();
    let lora = accrue_worker::config::LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: accrue_arch::lora::Targets::AllLinear,
        use_rslora: true,
        init: None,
    };
    accrue_worker::model::lora::attach(&mut adapted, &lora, 9).unwrap();
    // A trained-looking adapter: B away from its zero init, drawn from a
    // generator of the test's own (libtorch's global one is shared with
    // the tests running beside this one, so its draws would change from
    // run to run, and with them which near-tie a sample meets).
    tch::no_grad(|| {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        for (i, (_, a)) in adapted.adapters().iter().enumerate() {
            let n = a.b.numel();
            let b: Vec<f32> = (0..n).map(|_| rng.random::<f32>() - 0.5).collect();
            let b = Tensor::from_slice(&b).view(a.b.size().as_slice()) * 0.1;
            a.b.shallow_clone().copy_(&(b + i as f64 * 1e-3));
        }
    });
    let merged = build();
    let vars = merged.vs.variables();
    tch::no_grad(|| {
        for (path, a) in adapted.adapters() {
            let w = &vars[&format!("{path}.weight")];
            let _ = w.shallow_clone().g_add_(&a.delta());
        }
    });
    assert_eq!(adapted.adapters().len(), 2 * 7);
    let reqs: Vec<Request> = (0..6)
        .map(|i| Request {
            prompt: (0..(3 + 2 * i))
                .map(|j| ((i * 31 + j * 7 + 3) % 300) as i64)
                .collect(),
            seed: 50 + i as u64,
        })
        .collect();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        max_new_tokens: 12,
        max_batch: 4,
        ..SamplingParams::default()
    };
    let a = generate(&adapted, &params, &reqs).unwrap();
    let m = generate(&merged, &params, &reqs).unwrap();
    let plain = generate(&build(), &params, &reqs).unwrap();
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(&m) {
        assert_eq!(x.tokens, y.tokens, "adapters vs merged weights");
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            worst = worst.max((p - q).abs());
        }
    }
    println!("generation with adapters vs merged: worst log-prob diff {worst:e}");
    assert!(worst <= 1e-5, "{worst}");
    assert!(
        a.iter().zip(&plain).any(|(x, y)| x.tokens != y.tokens),
        "the adapters change nothing: the test cannot tell"
    );
}

/// A LoRA trainer holds the base once, frozen in the compute dtype
/// (bfloat16 here), and keeps float32 masters, gradients and AdamW
/// moments for the adapters only (issue 35: no master copy, state or
/// gradient of the base).
#[test]
fn the_base_has_no_master_copy_gradient_or_moments() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(
        dir.path(),
        "[precision]\ncompute = \"bfloat16\"\n[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n",
    );
    let t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let b = t.state_bytes();
    let vars = t.model().vs.variables();
    let (mut adapters, mut base) = (0u64, 0u64);
    for (name, v) in &vars {
        if is_adapter(name) {
            assert_eq!(v.kind(), tch::Kind::Float, "{name}");
            assert!(v.requires_grad(), "{name}");
            adapters += v.numel() as u64;
        } else {
            assert_eq!(
                v.kind(),
                tch::Kind::BFloat16,
                "{name} is not in the compute dtype"
            );
            assert!(!v.requires_grad(), "{name} is not frozen");
            base += v.numel() as u64;
        }
    }
    // q_proj (64 → 64) and v_proj (64 → 32) of 2 layers, rank 4.
    assert_eq!(adapters, 2 * 4 * ((64 + 64) + (64 + 32)));
    assert_eq!(b.params, 4 * adapters);
    assert_eq!(b.grads, 4 * adapters);
    assert_eq!(b.optimizer, 8 * adapters);
    assert_eq!(b.compute_copy, 0);
    assert_eq!(b.frozen, 2 * base);
    let names: Vec<String> = t.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().all(|n| is_adapter(n)), "{names:?}");
}

/// A LoRA checkpoint (the adapter folder and the adapters' moments)
/// restores at another world size and sharding and trains on as if never
/// interrupted: step 2 from step 1's checkpoint on 2 zero2 ranks equals 2
/// uninterrupted steps on 1 rank.
#[test]
fn a_lora_checkpoint_resumes_at_another_world_size() {
    use accrue_worker::train::Checkpointing;
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let r = reference(dir.path(), "llama", "sft", "all-linear");
    let norms = StepNorms {
        loss_tokens: common::batch(&r.docs).loss_tokens(),
        ..Default::default()
    };
    let lr: f64 = LR.parse().unwrap();
    let ckpt = dir.path().join("step-1");
    let mut t = ReplicatedTrainer::single(&job(&r, "ddp", "sft", "all-linear"), None).unwrap();
    let mb = common::batch(&r.docs);
    for step in 1..=2 {
        t.train_microbatch(0, &mb, &MicrobatchMeta::default(), &norms)
            .unwrap();
        t.optimizer_step(lr).unwrap();
        if step == 1 {
            t.save_checkpoint(&ckpt).unwrap();
        }
    }
    let uninterrupted = common::snapshot(&t.named_parameters());
    for f in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
    ] {
        assert!(ckpt.join(f).is_file(), "{f}");
    }
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "a pretrained base is not copied into every checkpoint"
    );
    let cfg = job(&r, "zero2", "sft", "all-linear");
    let halves = [r.docs[..3].to_vec(), r.docs[3..].to_vec()];
    let handles: Vec<_> = LocalGroup::new(2)
        .into_iter()
        .zip(halves)
        .map(|(coll, docs)| {
            let (cfg, ckpt) = (cfg.clone(), ckpt.clone());
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let mut t = ReplicatedTrainer::new(&cfg, Some(&ckpt), Box::new(coll)).unwrap();
                t.train_microbatch(0, &common::batch(&docs), &MicrobatchMeta::default(), &norms)
                    .unwrap();
                t.optimizer_step(lr).unwrap();
                common::snapshot(&t.named_parameters())
            })
        })
        .collect();
    let resumed: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (w, name) = common::worst_rel(&resumed[0], &uninterrupted);
    println!("resumed at 2 zero2 ranks vs uninterrupted: {w:e} ({name})");
    assert!(w <= 1e-6, "{name}: {w:e}");
    assert_eq!(common::worst_rel(&resumed[1], &resumed[0]).0, 0.0);
}

/// LoRA under fsdp with a bfloat16 compute dtype on 2 ranks: the frozen
/// base's shards are held in bfloat16 (no gradient, no moments), the
/// adapters' shards in float32; a step trains, the checkpoint (a
/// collective, rank 0 writes the adapter folder) restores into new fsdp
/// ranks with the same adapters, and the gathered policy generates with
/// the adapters on.
#[test]
fn fsdp_lora_in_bf16_trains_checkpoints_restores_and_generates() {
    use accrue_worker::generate::{generate, Request, SamplingParams};
    use accrue_worker::train::Checkpointing;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(
        dir.path(),
        "[precision]\ncompute = \"bfloat16\"\n[parallel]\nsharding = \"fsdp\"\n[lora]\nrank = 4\nalpha = 8\n",
    );
    let ckpt = dir.path().join("ckpt");
    let docs = common::synthetic_documents(&[17, 9, 30, 4], 3);
    let norms = StepNorms {
        loss_tokens: common::batch(&docs).loss_tokens(),
        ..Default::default()
    };
    let halves = [docs[..2].to_vec(), docs[2..].to_vec()];
    let run = |restore: bool| -> Vec<Vec<(String, Tensor)>> {
        let handles: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .zip(halves.clone())
            .map(|(coll, mine)| {
                let (cfg, ckpt) = (cfg.clone(), ckpt.clone());
                std::thread::spawn(move || {
                    tch::set_num_threads(1);
                    let from = restore.then_some(ckpt.as_path());
                    let mut t = FsdpTrainer::new(&cfg, from, Box::new(coll)).unwrap();
                    let b = t.state_bytes();
                    assert!(b.frozen > 0 && b.params < b.frozen / 4, "{b:?}");
                    assert_eq!(b.grads, b.params, "gradients of the adapters only");
                    assert_eq!(b.optimizer, 2 * b.params, "moments of the adapters only");
                    if !restore {
                        t.train_microbatch(
                            0,
                            &common::batch(&mine),
                            &MicrobatchMeta::default(),
                            &norms,
                        )
                        .unwrap();
                        t.optimizer_step(1e-2).unwrap();
                        t.save_checkpoint(&ckpt).unwrap();
                    }
                    let policy = t.policy(true).unwrap();
                    assert_eq!(policy.kind(), tch::Kind::BFloat16);
                    let reqs = [Request {
                        prompt: vec![5, 6, 7],
                        seed: 1,
                    }];
                    let params = SamplingParams {
                        max_new_tokens: 4,
                        ..SamplingParams::default()
                    };
                    let out = generate(&policy, &params, &reqs).unwrap();
                    assert_eq!(out[0].tokens.len(), 4);
                    drop(policy);
                    let all = t.named_full_parameters().unwrap();
                    all.into_iter().filter(|(n, _)| is_adapter(n)).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let trained = run(false);
    assert!(ckpt.join("adapter_model.safetensors").is_file());
    assert!(
        ckpt.join("model.safetensors").is_file(),
        "a random base is written"
    );
    let restored = run(true);
    assert!(!trained[0].is_empty());
    assert_eq!(common::worst_rel(&restored[0], &trained[0]).0, 0.0);
    assert_eq!(common::worst_rel(&trained[1], &trained[0]).0, 0.0);
}

/// LoRA dropout (`lora.dropout`): a document's mask is keyed by the seed,
/// the step, the module and the document itself, so two steps of the same
/// documents give the same adapters on 1 rank in one microbatch, on 1 rank
/// with per-layer recomputation, and on 2 ranks in uneven microbatches at
/// ddp, zero2 and fsdp; and the masks are really applied (the update
/// differs from dropout 0's).
#[test]
fn dropout_gives_the_same_update_for_any_split_world_size_and_sharding() {
    let docs = common::synthetic_documents(&[23, 5, 40, 11, 17, 8], 9);
    let run = |dropout: f64, sharding: &str, layout: Vec<Vec<Vec<usize>>>, recompute: bool| {
        let dir = tempfile::tempdir().unwrap();
        let cfg = common::random_job(
            dir.path(),
            &format!(
                "[optimizer]\nlr = 1e-2\neps = 1e-5\n[parallel]\nsharding = \"{sharding}\"\n\
                 [runtime]\nactivation_checkpointing = {recompute}\n\
                 [lora]\nrank = 4\nalpha = 8\ndropout = {dropout}\n"
            ),
        );
        let norms = StepNorms {
            loss_tokens: common::batch(&docs).loss_tokens(),
            ..Default::default()
        };
        let handles: Vec<_> = LocalGroup::new(layout.len())
            .into_iter()
            .zip(layout)
            .map(|(coll, groups)| {
                let cfg = cfg.clone();
                let mbs: Vec<PackedBatch> = groups
                    .iter()
                    .map(|g| {
                        let d: Vec<Doc> = g.iter().map(|&i| docs[i].clone()).collect();
                        if d.is_empty() {
                            PackedBatch::default()
                        } else {
                            common::batch(&d)
                        }
                    })
                    .collect();
                std::thread::spawn(move || {
                    tch::set_num_threads(1);
                    let mut t = accrue_worker::train::build(&cfg, None, Box::new(coll)).unwrap();
                    for _ in 0..2 {
                        for (i, mb) in mbs.iter().enumerate() {
                            t.train_microbatch(i, mb, &MicrobatchMeta::default(), &norms)
                                .unwrap();
                        }
                        t.optimizer_step(1e-2).unwrap();
                    }
                    // Every rank's policy: the model with its adapters.
                    let policy = t.policy(true).unwrap();
                    let mut a: Vec<(String, Tensor)> = policy
                        .vs
                        .variables()
                        .into_iter()
                        .filter(|(n, _)| is_adapter(n))
                        .map(|(n, t)| (n, t.detach().copy()))
                        .collect();
                    a.sort_by(|x, y| x.0.cmp(&y.0));
                    a
                })
            })
            .collect();
        handles.into_iter().next().unwrap().join().unwrap()
    };
    let one = vec![vec![vec![0, 1, 2, 3, 4, 5]]];
    let two = vec![vec![vec![0], vec![1, 2]], vec![vec![3, 4, 5], vec![]]];
    let reference = run(0.3, "ddp", one.clone(), false);
    for (what, got) in [
        ("recomputed", run(0.3, "ddp", one.clone(), true)),
        ("ddp 2 ranks", run(0.3, "ddp", two.clone(), false)),
        ("zero2 2 ranks", run(0.3, "zero2", two.clone(), false)),
        ("fsdp 2 ranks", run(0.3, "fsdp", two.clone(), false)),
    ] {
        let (w, name) = common::worst_rel(&got, &reference);
        println!("dropout 0.3, {what}: {w:e} ({name})");
        assert!(w <= 1e-5, "{what}: {name} differs by {w:e}");
    }
    let (w, _) = common::worst_rel(&run(0.0, "ddp", one, false), &reference);
    println!("dropout 0.3 vs 0: {w:e}");
    assert!(w > 1e-3, "the dropout masks changed nothing ({w:e})");
}

/// A `lora.init` folder that trains another adapter (another rank) is
/// refused by the worker too, naming the file and both values.
#[test]
fn an_init_adapter_of_another_rank_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("adapter");
    std::fs::create_dir_all(&init).unwrap();
    std::fs::write(
        init.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 8}"#,
    )
    .unwrap();
    std::fs::write(init.join("adapter_model.safetensors"), b"").unwrap();
    let cfg = common::random_job(
        dir.path(),
        &format!(
            "[lora]\nrank = 4\nalpha = 8\ninit = \"{}\"\n",
            init.display()
        ),
    );
    let e = format!("{:#}", ReplicatedTrainer::single(&cfg, None).err().unwrap());
    assert!(
        e.contains("adapter_config.json: r = 2, the job's lora.rank is 4"),
        "{e}"
    );
}
