//! Qwen3-MoE's load-balancing loss (`train::routing`): defined over the
//! whole step, so that the update is the same whatever the microbatch
//! split, world size and sharding, and equal to transformers' own loss
//! over one batch holding every document of the step.

mod common;

use accrue_worker::batch::{MicrobatchMeta, PackedBatch, StepNorms};
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::Collective;
use accrue_worker::train::routing::AUX_METRIC;
use accrue_worker::train::{FsdpTrainer, Passes, ReplicatedTrainer, Trainer};
use tch::Tensor;

type Docs = Vec<(Vec<i64>, Vec<i64>)>;

/// transformers over one right-padded batch of the reference documents
/// (cross-entropy mean + 0.25 · aux, the aux masked to real tokens)
/// against ours over three microbatches with the step's counts.
#[test]
fn aux_loss_matches_transformers_over_the_whole_step() {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let reference = common::make_reference(dir.path(), "qwen3_moe_aux");
    let docs = common::documents(&reference);
    let total = i64::try_from(&reference["total_loss_tokens"]).unwrap() as u64;
    let cfg = common::job_config(
        dir.path().join("model").to_str().unwrap(),
        "[runtime]\nloss_chunk_tokens = 16\n",
    );
    let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
    let batches = [
        common::batch(&docs[0..2]),
        common::batch(&docs[2..3]),
        common::batch(&docs[3..]),
    ];
    let norms = StepNorms {
        loss_tokens: total,
        ..Default::default()
    };
    t.begin_step(&batches).unwrap();
    let mut loss_sum = 0.0;
    let mut aux_sum = 0.0;
    for (i, b) in batches.iter().enumerate() {
        let o = t
            .train_microbatch(i, b, &MicrobatchMeta::default(), &norms)
            .unwrap();
        loss_sum += o.loss_sum;
        aux_sum += o.extra[AUX_METRIC];
    }
    let aux = aux_sum / total as f64;
    let want_aux = f64::try_from(&reference["aux_loss"]).unwrap();
    let want_loss = f64::try_from(&reference["loss"]).unwrap();
    let loss = loss_sum / total as f64 + 0.25 * aux;
    println!("aux {aux} vs {want_aux}; loss {loss} vs {want_loss}");
    assert!(
        (aux - want_aux).abs() <= 1e-5 * want_aux,
        "aux {aux} vs {want_aux}"
    );
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss,
        "loss {loss} vs {want_loss}"
    );
    let grads = t.named_grads();
    let mut worst = (0.0, String::new());
    for (name, g) in &grads {
        let theirs: &Tensor = &reference[&format!("grad.{name}")];
        let (d, n) = common::diff_norms(g, theirs);
        if d / n > worst.0 {
            worst = (d / n, name.clone());
        }
    }
    println!("worst gradient rel diff {:e} ({})", worst.0, worst.1);
    assert!(
        worst.0 <= 1e-5,
        "gradient of {} differs by {}",
        worst.1,
        worst.0
    );
}

const MOE_AUX: &str = r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": true, "output_router_logits": true,
    "router_aux_loss_coef": 0.25, "rms_norm_eps": 1e-6, "initializer_range": 0.05,
    "tie_word_embeddings": false}"#;

/// Per step, per rank, that rank's microbatches (document indices).
type Layout = Vec<Vec<Vec<Vec<usize>>>>;

fn steps() -> Vec<Docs> {
    vec![
        common::synthetic_documents(&[23, 9, 31, 17, 12], 21),
        common::synthetic_documents(&[14, 40, 8, 19], 22),
        common::synthetic_documents(&[30, 11, 25], 23),
    ]
}

/// One rank, one microbatch per step.
fn whole() -> Layout {
    steps()
        .iter()
        .map(|d| vec![vec![(0..d.len()).collect()]])
        .collect()
}

/// Two ranks with uneven microbatches.
fn split() -> Layout {
    vec![
        vec![vec![vec![0, 1], vec![2]], vec![vec![3], vec![4]]],
        vec![vec![vec![0], vec![]], vec![vec![1, 2], vec![3]]],
        vec![vec![vec![0, 1]], vec![vec![2]]],
    ]
}

fn batch(docs: &Docs, idx: &[usize]) -> PackedBatch {
    if idx.is_empty() {
        return PackedBatch::default();
    }
    let d: Docs = idx.iter().map(|&i| docs[i].clone()).collect();
    common::batch(&d)
}

/// Trains one rank's part of `layout`; `whole_step`: the step's counts
/// first (as the runner does), else each microbatch on its own counts (a
/// per-microbatch loss, the definition this design avoids).
fn train_rank(t: &mut dyn Trainer, rank: usize, layout: &Layout, whole_step: bool) -> Vec<f64> {
    let steps = steps();
    let mut norms_out = Vec::new();
    for (s, ranks) in layout.iter().enumerate() {
        let total: u64 = common::batch(&steps[s]).loss_tokens();
        let norms = StepNorms {
            loss_tokens: total,
            ..Default::default()
        };
        let mine: Vec<PackedBatch> = ranks[rank].iter().map(|m| batch(&steps[s], m)).collect();
        if whole_step {
            t.begin_step(&mine).unwrap();
        }
        for (i, b) in mine.iter().enumerate() {
            if b.is_empty() && !t.collective_per_microbatch() {
                continue;
            }
            t.train_microbatch(i, b, &MicrobatchMeta::default(), &norms)
                .unwrap();
        }
        norms_out.push(t.optimizer_step(1e-2).unwrap().grad_norm);
    }
    norms_out
}

type Outcome = (Vec<f64>, Vec<(String, Tensor)>);

fn train(sharding: &str, layout: &Layout, whole_step: bool) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job_of(
        dir.path(),
        MOE_AUX,
        &format!(
            "[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n\
             [runtime]\nloss_chunk_tokens = 32\n[parallel]\nsharding = \"{sharding}\"\n"
        ),
    );
    let world = layout[0].len();
    let fsdp = sharding == "fsdp";
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let (cfg, layout) = (cfg.clone(), layout.clone());
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let coll: Box<dyn Collective> = Box::new(coll);
                if fsdp {
                    let mut t = FsdpTrainer::new(&cfg, None, coll).unwrap();
                    let n = train_rank(&mut t, rank, &layout, whole_step);
                    (n, common::snapshot(&t.named_full_parameters().unwrap()))
                } else {
                    let mut t = ReplicatedTrainer::new(&cfg, None, coll).unwrap();
                    let n = train_rank(&mut t, rank, &layout, whole_step);
                    (n, common::snapshot(&t.named_parameters()))
                }
            })
        })
        .collect();
    let mut results: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results.swap_remove(0)
}

fn worst(a: &Outcome, b: &Outcome) -> (f64, String) {
    let (mut w, mut what) = common::worst_rel(&a.1, &b.1);
    for (s, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        let r = (x - y).abs() / y.abs();
        if r > w {
            (w, what) = (r, format!("step {s} grad norm {x} vs {y}"));
        }
    }
    (w, what)
}

/// 3 AdamW steps with the loss on: 2 ranks with uneven microbatches at
/// ddp, zero2 and fsdp equal 1 rank with one microbatch per step; a loss
/// taken per microbatch (no step counts) is a different update, by far.
#[test]
fn aux_loss_same_update_for_any_split_world_size_and_sharding() {
    let reference = train("ddp", &whole(), true);
    for sharding in ["ddp", "zero2", "fsdp"] {
        let got = train(sharding, &split(), true);
        let (w, what) = worst(&got, &reference);
        println!("{sharding}, 2 ranks: worst relative difference {w:e} ({what})");
        assert!(w <= 2e-5, "{sharding}: {what} differs by {w:e}");
    }
    let per_microbatch = train("ddp", &split(), false);
    let (w, what) = worst(&per_microbatch, &reference);
    println!("per-microbatch counts: {w:e} ({what})");
    assert!(w > 2e-3, "a per-microbatch loss should differ, got {w:e}");
}

/// Top-1 routing with renormalised weights: a token's MLP output is its
/// one expert's, weight exactly 1, so the policy is a function of which
/// expert each token went through — what replay carries.
const MOE_TOP1: &str = r#"{"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 1,
    "moe_intermediate_size": 32, "norm_topk_prob": true, "mlp_only_layers": [0],
    "rms_norm_eps": 1e-6, "initializer_range": 0.2, "tie_word_embeddings": false}"#;

/// Each target's log-prob under `model`'s training forward of `b`,
/// replaying `b.routing` when `replay`.
fn token_logps(model: &accrue_worker::model::Llama, b: &PackedBatch, replay: bool) -> Vec<f64> {
    use accrue_worker::model::Routes;
    let replay = if replay {
        accrue_worker::model::moe::replay_tensors(
            &b.routing,
            b.tokens(),
            &model.arch,
            model.vs.device(),
        )
        .unwrap()
    } else {
        Vec::new()
    };
    let routes = Routes { replay, aux: None };
    tch::no_grad(|| {
        let h = model
            .hidden_routed(&b.input_ids, &b.cu_seq_lens, &routes)
            .hidden;
        let lp = h
            .matmul(&model.lm_head_weight().tr())
            .log_softmax(-1, tch::Kind::Double);
        (0..b.tokens() - 1)
            .map(|t| lp.double_value(&[t as i64, b.input_ids[t + 1]]))
            .collect()
    })
}

/// Routing replay: a generator whose router picks other experts than the
/// trainer's (here: another router weight, as an inference engine's
/// numerics or an older policy would) records each token's experts; the
/// trainer replaying them recomputes the generation's log-probs, its own
/// routing does not.
#[test]
fn routing_replay_recomputes_the_generations_log_probs() {
    use accrue_worker::generate::{generate, Request, SamplingParams};
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job_of(dir.path(), MOE_TOP1, "");
    let trainer = ReplicatedTrainer::single(&cfg, None).unwrap();
    let generator = ReplicatedTrainer::single(&cfg, None).unwrap();
    let gate = "model.layers.1.mlp.gate.weight";
    tch::no_grad(|| {
        let w = &generator.model().vs.variables()[gate];
        let other = Tensor::randn(w.size(), (w.kind(), w.device())) * 0.2;
        w.shallow_clone().copy_(&other);
    });
    let requests: Vec<Request> = [vec![5, 17, 42, 99], vec![3, 1, 4, 1, 5, 9], vec![250]]
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            prompt,
            seed: i as u64,
        })
        .collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 12,
        record_routing: true,
        ..SamplingParams::default()
    };
    let done = generate(generator.model(), &params, &requests).unwrap();
    let (mut worst_replayed, mut worst_own) = (0.0f64, 0.0f64);
    for (r, c) in requests.iter().zip(&done) {
        let seq: Vec<i64> = r.prompt.iter().chain(&c.tokens).copied().collect();
        // Every token the generator ran, then the last one, never run.
        assert_eq!(c.routing.len(), seq.len() - 1, "one expert per token run");
        let mut routing = c.routing.clone();
        routing.push(-1);
        let b = PackedBatch {
            cu_seq_lens: vec![0, seq.len() as i64],
            labels: seq.clone(),
            input_ids: seq,
            routing,
        };
        let p = r.prompt.len();
        let replayed = token_logps(trainer.model(), &b, true);
        let own = token_logps(trainer.model(), &b, false);
        for (j, &lp) in c.logprobs.iter().enumerate() {
            worst_replayed = worst_replayed.max((replayed[p - 1 + j] - lp as f64).abs());
            worst_own = worst_own.max((own[p - 1 + j] - lp as f64).abs());
        }
    }
    // A routing that does not fit the model is the plan's error.
    let mut t = trainer;
    let bad = PackedBatch {
        input_ids: vec![1, 2, 3],
        labels: vec![1, 2, 3],
        cu_seq_lens: vec![0, 3],
        routing: vec![0, 1],
    };
    let norms = StepNorms {
        loss_tokens: 2,
        ..Default::default()
    };
    let e = t
        .train_microbatch(0, &bad, &MicrobatchMeta::default(), &norms)
        .unwrap_err();
    assert!(
        format!("{e:#}").contains("microbatch 0: routing: 2 expert ids for 3 tokens"),
        "{e:#}"
    );
    println!("log-prob vs generation: replayed {worst_replayed:e}, own routing {worst_own:e}");
    assert!(worst_replayed <= 1e-4, "replayed routing: {worst_replayed}");
    assert!(
        worst_own > 1e-2,
        "own routing should differ, got {worst_own}"
    );
}
