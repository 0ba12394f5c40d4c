//! FSDP full-shard equivalence (issue 4, DESIGN.md "The math"): the same
//! documents for 3 steps as (a) the single-process `ReplicatedTrainer`, one
//! microbatch per step, (c) 2 FSDP ranks with uneven microbatches, (d) 3
//! FSDP ranks with a step where one rank has only padding microbatches —
//! the same parameters (per tensor ‖a−b‖ ≤ 1e-5·‖b‖), loss sums and
//! gradient norms. Untied and tied embeddings, GQA. Also: a sharded FSDP
//! checkpoint loads in transformers and restores at another world size,
//! and the per-rank state memory at world 1, 2, 4. Generation (issue 17)
//! decodes with the full model gathered for the round.

mod common;

use std::path::Path;

use accrue_worker::batch::PackedBatch;
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::Collective;
use accrue_worker::config::JobConfig;
use accrue_worker::generate::{generate, Completion, Request, SamplingParams};
use accrue_worker::model::Llama;
use accrue_worker::train::fsdp::FsdpTrainer;
use accrue_worker::train::{Checkpointing, ReplicatedTrainer, Trainer};
use tch::Tensor;

const TOL: f64 = 1e-5;
const LR: f64 = 1e-3;

type Docs = Vec<(Vec<i64>, Vec<i64>)>;
type Params = Vec<(String, Tensor)>;
/// Per step, per rank, the microbatches (every rank the same count).
type Plan = Vec<Vec<Vec<PackedBatch>>>;

/// A tiny GQA Llama (hidden 64, 2 layers), optionally with tied embeddings.
fn job(dir: &Path, tied: bool) -> JobConfig {
    let config = common::TINY_CONFIG.replace(
        "\"tie_word_embeddings\": false",
        &format!("\"tie_word_embeddings\": {tied}"),
    );
    job_of(dir, &config)
}

/// A job over the model `config`.
fn job_of(dir: &Path, config: &str) -> JobConfig {
    tch::set_num_threads(2);
    let path = dir.join("config.json");
    std::fs::write(&path, config).unwrap();
    // eps = 1e-6: see tests/accumulation.rs (AdamW amplifies fp32 noise in
    // gradient elements near eps).
    common::job_config(
        "random",
        &format!(
            "config = \"{}\"\n[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n[runtime]\nloss_chunk_tokens = 32\n",
            path.display()
        ),
    )
}

/// The documents of the 3 steps.
fn steps() -> Vec<Docs> {
    vec![
        common::synthetic_documents(&[37, 5, 61, 12, 2, 28, 44, 9, 19], 1),
        common::synthetic_documents(&[50, 3, 17, 8, 33], 2),
        common::synthetic_documents(&[21, 64, 6, 7, 40, 13], 3),
    ]
}

fn batch(docs: &[(Vec<i64>, Vec<i64>)]) -> PackedBatch {
    common::batch(docs)
}

fn empty() -> PackedBatch {
    PackedBatch::default()
}

/// 2 ranks, uneven splits, 1 to 3 microbatches per rank and step.
fn plan_2(steps: &[Docs]) -> Plan {
    let s = steps;
    vec![
        vec![
            vec![batch(&s[0][0..1]), batch(&s[0][1..4])],
            vec![batch(&s[0][4..8]), batch(&s[0][8..9])],
        ],
        vec![vec![batch(&s[1][0..2])], vec![batch(&s[1][2..5])]],
        vec![
            vec![batch(&s[2][0..1]), empty(), batch(&s[2][1..2])],
            vec![batch(&s[2][2..4]), batch(&s[2][4..5]), batch(&s[2][5..6])],
        ],
    ]
}

/// 3 ranks; in step 1 rank 2 has only padding microbatches (and rank 1 one
/// padding microbatch beside data), in step 2 microbatch 1 is padding on
/// every rank.
fn plan_3(steps: &[Docs]) -> Plan {
    let s = steps;
    vec![
        vec![
            vec![batch(&s[0][0..2]), batch(&s[0][2..3])],
            vec![batch(&s[0][3..6]), empty()],
            vec![batch(&s[0][6..8]), batch(&s[0][8..9])],
        ],
        vec![
            vec![batch(&s[1][0..1]), batch(&s[1][1..3])],
            vec![batch(&s[1][3..5]), empty()],
            vec![empty(), empty()],
        ],
        vec![
            vec![batch(&s[2][0..2]), empty()],
            vec![batch(&s[2][2..5]), empty()],
            vec![batch(&s[2][5..6]), empty()],
        ],
    ]
}

/// Per step: (Σ loss over ranks, Σ loss tokens, grad norm).
type Stats = Vec<(f64, u64, f64)>;

fn run_reference(cfg: &JobConfig, steps: &[Docs]) -> (Stats, Params) {
    let mut t = ReplicatedTrainer::single(cfg, None).unwrap();
    let mut stats = Vec::new();
    for docs in steps {
        let b = batch(docs);
        let s = t.microbatch(0, &b, b.loss_tokens()).unwrap();
        let g = t.optimizer_step(LR).unwrap();
        stats.push((s.loss_sum, s.loss_tokens, g.grad_norm));
    }
    (stats, common::snapshot(&t.named_parameters()))
}

/// How a step's loss normaliser is chosen (the wrong one must be caught).
#[derive(Clone, Copy, PartialEq)]
enum Norm {
    /// T = the step's global loss-token count: the contract.
    Global,
    /// Each rank its own count (averaging over ranks, the classic bug).
    PerRank,
}

/// Runs `f(rank, collective)` on `world` threads of an in-process group.
fn on_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize, Box<dyn Collective>) -> R + Send + Clone + 'static,
) -> Vec<R> {
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let f = f.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                f(rank, Box::new(coll))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Trains `rank`'s part of `plan`; returns its per-step stats.
fn train(t: &mut FsdpTrainer, rank: usize, plan: &Plan, norm: Norm) -> Stats {
    let world = plan[0].len();
    let mut stats = Vec::new();
    for step in plan {
        let global: u64 = step.iter().flatten().map(|m| m.loss_tokens()).sum();
        let mine: u64 = step[rank].iter().map(|m| m.loss_tokens()).sum();
        let total = match norm {
            Norm::Global => global,
            Norm::PerRank => mine * world as u64,
        };
        let (mut loss, mut tokens) = (0.0, 0);
        for (i, mb) in step[rank].iter().enumerate() {
            let s = t.microbatch(i, mb, total).unwrap();
            loss += s.loss_sum;
            tokens += s.loss_tokens;
        }
        let g = t.optimizer_step(LR).unwrap();
        stats.push((loss, tokens, g.grad_norm));
    }
    stats
}

/// Sums the ranks' stats per step (checking they agree on the grad norm)
/// and checks every rank gathered the same parameters.
fn combine(results: Vec<(Stats, Params)>) -> (Stats, Params) {
    let mut stats = results[0].0.clone();
    for (s, st) in stats.iter_mut().enumerate() {
        st.0 = results.iter().map(|r| r.0[s].0).sum();
        st.1 = results.iter().map(|r| r.0[s].1).sum();
        for r in &results {
            assert_eq!(r.0[s].2, st.2, "step {s}: ranks disagree on the grad norm");
        }
    }
    for r in &results[1..] {
        let (w, n) = common::worst_rel(&r.1, &results[0].1);
        assert_eq!(w, 0.0, "ranks gathered different values of {n}");
    }
    let params = results.into_iter().next().unwrap().1;
    (stats, params)
}

/// Runs `plan` from a fresh init on as many FSDP ranks as it has.
fn run_fsdp(cfg: &JobConfig, plan: &Plan, norm: Norm) -> (Stats, Params) {
    let (cfg, plan) = (cfg.clone(), plan.clone());
    combine(on_ranks(plan[0].len(), move |rank, coll| {
        let mut t = FsdpTrainer::new(&cfg, None, coll).unwrap();
        let stats = train(&mut t, rank, &plan, norm);
        (stats, t.named_full_parameters().unwrap())
    }))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

fn assert_equivalent(label: &str, got: &(Stats, Params), want: &(Stats, Params)) {
    for (s, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        println!(
            "{label} step {s}: loss {:.6} vs {:.6}, tokens {} vs {}, grad norm {:.6} vs {:.6}",
            g.0, w.0, g.1, w.1, g.2, w.2
        );
        assert_eq!(g.1, w.1, "{label} step {s}: loss tokens");
        assert!(
            rel(g.0, w.0) <= TOL,
            "{label} step {s}: loss sum {} vs {}",
            g.0,
            w.0
        );
        assert!(
            rel(g.2, w.2) <= TOL,
            "{label} step {s}: grad norm {} vs {}",
            g.2,
            w.2
        );
    }
    let (pw, pn) = common::worst_rel(&got.1, &want.1);
    println!("{label}: worst parameter difference {pw:e} ({pn})");
    assert!(pw <= TOL, "{label}: parameter {pn} differs by {pw}");
}

fn equivalence(tied: bool) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path(), tied);
    let steps = steps();
    let reference = run_reference(&cfg, &steps);
    let names: Vec<&str> = reference.1.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.contains(&"lm_head.weight"), !tied);

    let two = run_fsdp(&cfg, &plan_2(&steps), Norm::Global);
    assert_equivalent("fsdp 2 ranks", &two, &reference);
    let three = run_fsdp(&cfg, &plan_3(&steps), Norm::Global);
    assert_equivalent("fsdp 3 ranks", &three, &reference);

    // The check catches a rank-averaging normaliser.
    let bad = run_fsdp(&cfg, &plan_2(&steps), Norm::PerRank);
    let (pw, _) = common::worst_rel(&bad.1, &reference.1);
    println!("per-rank normaliser: worst parameter difference {pw:e}");
    assert!(
        pw > 100.0 * TOL,
        "a per-rank normaliser should differ, got {pw}"
    );
}

/// Every family (issue 34): fsdp on 2 ranks (q/k norms, post-norms,
/// Gemma's scaled embedding and (1 + w) final norm sharded like any
/// parameter) equals one process.
#[test]
fn fsdp_matches_single_process_for_every_family() {
    for (family, model) in common::FAMILY_CONFIGS {
        let dir = tempfile::tempdir().unwrap();
        let cfg = job_of(dir.path(), model);
        let steps = steps();
        let reference = run_reference(&cfg, &steps);
        let two = run_fsdp(&cfg, &plan_2(&steps), Norm::Global);
        assert_equivalent(&format!("{family}: fsdp 2 ranks"), &two, &reference);
    }
}

#[test]
fn fsdp_matches_single_process_untied() {
    equivalence(false);
}

#[test]
fn fsdp_matches_single_process_tied() {
    equivalence(true);
}

#[test]
fn fsdp_checkpoint_loads_in_transformers_and_restores_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path(), false);
    let docs = common::synthetic_documents(&[23, 9, 31, 17], 11);
    let next = common::synthetic_documents(&[14, 40, 8], 12);
    let first: Plan = vec![vec![vec![batch(&docs[0..1])], vec![batch(&docs[1..4])]]];
    let second_2: Plan = vec![vec![vec![batch(&next[0..2])], vec![batch(&next[2..3])]]];
    let second_3: Plan = vec![vec![
        vec![batch(&next[0..1])],
        vec![empty()],
        vec![batch(&next[1..3])],
    ]];
    let ckpt = dir.path().join("ckpt");

    // 2 ranks: a step, a checkpoint, another step.
    let (c, path, (p1, p2)) = (cfg.clone(), ckpt.clone(), (first.clone(), second_2));
    let saved = combine(on_ranks(2, move |rank, coll| {
        let mut t = FsdpTrainer::new(&c, None, coll).unwrap();
        train(&mut t, rank, &p1, Norm::Global);
        t.save_checkpoint(&path).unwrap();
        let at_save = t.named_full_parameters().unwrap();
        train(&mut t, rank, &p2, Norm::Global);
        let mut both = at_save;
        both.extend(t.named_full_parameters().unwrap());
        (Vec::new(), both)
    }))
    .1;
    let (at_save, after) = saved.split_at(saved.len() / 2);
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00002.safetensors",
        "config.json",
        "trainer.json",
    ] {
        assert!(ckpt.join(f).exists(), "checkpoint lacks {f}");
    }

    // transformers loads it and gives the single-process trainer's logits.
    let mut reference = ReplicatedTrainer::single(&cfg, None).unwrap();
    let b = batch(&docs);
    reference.microbatch(0, &b, b.loss_tokens()).unwrap();
    reference.optimizer_step(LR).unwrap();
    let (pw, pn) = common::worst_rel(at_save, &common::snapshot(&reference.named_parameters()));
    assert!(
        pw <= TOL,
        "parameter {pn} differs from the trainer's by {pw}"
    );
    common::assert_transformers_logits(dir.path(), &ckpt, reference.model(), &docs);

    // Restored on 3 ranks: the saved parameters exactly, and the same next
    // step (moments and step count restored too).
    let (c, path) = (cfg.clone(), ckpt.clone());
    let restored = combine(on_ranks(3, move |rank, coll| {
        let mut t = FsdpTrainer::new(&c, Some(&path), coll).unwrap();
        assert_eq!(t.optimizer_steps(), 1);
        let loaded = t.named_full_parameters().unwrap();
        train(&mut t, rank, &second_3, Norm::Global);
        let mut both = loaded;
        both.extend(t.named_full_parameters().unwrap());
        (Vec::new(), both)
    }))
    .1;
    let (loaded, resumed) = restored.split_at(restored.len() / 2);
    let (w, n) = common::worst_rel(loaded, at_save);
    assert_eq!(w, 0.0, "restored parameter {n} differs");
    let (w, n) = common::worst_rel(resumed, after);
    println!("resumed on 3 ranks vs continued on 2: {w:e} ({n})");
    assert!(w <= TOL, "after resuming, parameter {n} differs by {w}");
}

/// Per-rank parameter + gradient + AdamW bytes for hidden 256, 4 layers,
/// 4 heads, intermediate 688, vocab 32000 (issue 4's memory table).
#[test]
fn fsdp_state_memory_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let config = r#"{
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
      "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
      "tie_word_embeddings": false, "hidden_act": "silu"
    }"#;
    let path = dir.path().join("config.json");
    std::fs::write(&path, config).unwrap();
    let cfg = common::job_config("random", &format!("config = \"{}\"\n", path.display()));
    let mut ddp = 0;
    println!(
        "world rank     params      grads  optimizer      total  vs ddp  (+ largest gathered unit)"
    );
    for world in [1usize, 2, 4] {
        for (rank, coll) in LocalGroup::new(world).into_iter().enumerate() {
            // No collective runs in `new`: ranks can be built one by one.
            let t = FsdpTrainer::new(&cfg, None, Box::new(coll)).unwrap();
            let b = t.state_bytes();
            if world == 1 {
                // World 1 holds everything: DDP's per-rank state.
                ddp = b.total();
            }
            let ratio = b.total() as f64 / ddp as f64;
            println!(
                "{world:>5} {rank:>4} {:>10} {:>10} {:>10} {:>10} {ratio:>7.3}  (+ {})",
                b.params,
                b.grads,
                b.optimizer,
                b.total(),
                t.largest_unit_bytes()
            );
            assert_eq!(b.optimizer, 2 * b.params);
            if world == 4 {
                assert!(
                    ratio <= 0.35,
                    "fsdp at 4 ranks holds {ratio:.3} of ddp's state"
                );
            }
        }
    }
}

/// A rank whose microbatch is bad fails with its own error; the other
/// ranks fail too instead of waiting in a collective, and no gradient is
/// applied anywhere.
#[test]
fn fsdp_a_failing_rank_fails_every_rank_without_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path(), false);
    let docs = common::synthetic_documents(&[20, 30], 4);
    let errors = on_ranks(2, move |rank, coll| {
        let mut t = FsdpTrainer::new(&cfg, None, coll).unwrap();
        let mut mb = batch(&docs[rank..rank + 1]);
        if rank == 0 {
            mb.input_ids[3] = 100_000; // outside the 300-token vocabulary
        }
        let err = t.microbatch(0, &mb, 40).unwrap_err();
        // Both ranks still agree on an (all-zero) gradient norm afterwards.
        let norm = t.optimizer_step(LR).unwrap().grad_norm;
        (format!("{err:#}"), norm)
    });
    assert!(
        errors[0].0.contains("outside the vocabulary"),
        "{}",
        errors[0].0
    );
    assert!(errors[1].0.contains("another rank"), "{}", errors[1].0);
    assert_eq!((errors[0].1, errors[1].1), (0.0, 0.0));
}

/// A model's parameters, sorted by name.
fn params_of(m: &Llama) -> Params {
    let mut v: Params = m.vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    common::snapshot(&v)
}

/// Bitwise equality of two parameter lists (dtype included).
fn assert_identical(label: &str, got: &Params, want: &Params) {
    assert_eq!(got.len(), want.len(), "{label}: parameter count");
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m, "{label}");
        assert_eq!(a.kind(), b.kind(), "{label}: {n} dtype");
        assert!(a.equal(b), "{label}: {n} differs");
    }
}

/// Prompts of different lengths for greedy decoding.
fn prompts() -> Vec<Request> {
    [9usize, 1, 14, 4, 6]
        .iter()
        .enumerate()
        .map(|(i, &n)| Request {
            prompt: (0..n)
                .map(|j| ((i * 41 + j * 13 + 3) % 300) as i64)
                .collect(),
            seed: 7 + i as u64,
        })
        .collect()
}

fn greedy() -> SamplingParams {
    SamplingParams {
        max_new_tokens: 10,
        max_batch: 2,
        ..SamplingParams::default()
    }
}

/// Generation under fsdp (issue 17, FSDP's `summon_full_params`): the
/// model a round gathers holds, bit for bit, the single-process model's
/// parameters at init and the FSDP ranks' own full parameters after 3
/// steps (those are the single-process ones within the equivalence
/// tolerance). Greedy decoding from it, rank 0 with three prompts and rank
/// 1 with two, then rank 0 with all and rank 1 with none (it still
/// gathers), gives the single-process model's tokens one for one.
#[test]
fn fsdp_generation_gathers_the_full_model_and_decodes_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path(), false);
    let steps = steps();
    let reqs = prompts();
    let mut single = ReplicatedTrainer::single(&cfg, None).unwrap();
    let init = params_of(single.compute_model());
    let want_init = generate(single.compute_model(), &greedy(), &reqs).unwrap();
    for docs in &steps {
        let b = batch(docs);
        single.microbatch(0, &b, b.loss_tokens()).unwrap();
        single.optimizer_step(LR).unwrap();
    }
    let trained = params_of(single.compute_model());
    let want = generate(single.compute_model(), &greedy(), &reqs).unwrap();
    assert_ne!(
        want_init.iter().map(|c| &c.tokens).collect::<Vec<_>>(),
        want.iter().map(|c| &c.tokens).collect::<Vec<_>>(),
        "training should change what greedy decoding gives"
    );

    let (cfg2, plan, reqs2) = (cfg.clone(), plan_2(&steps), reqs.clone());
    let ranks = on_ranks(2, move |rank, coll| {
        let mut t = FsdpTrainer::new(&cfg2, None, coll).unwrap();
        let policy = t.gather_policy(true).unwrap();
        let at_init = params_of(&policy);
        let share = if rank == 0 { &reqs2[..3] } else { &reqs2[3..] };
        let init_out = generate(&policy, &greedy(), share).unwrap();
        drop(policy);
        train(&mut t, rank, &plan, Norm::Global);
        let full = t.named_full_parameters().unwrap();
        let policy = t.gather_policy(true).unwrap();
        let gathered = params_of(&policy);
        let share = if rank == 0 { &reqs2[..] } else { &reqs2[..0] };
        let out = generate(&policy, &greedy(), share).unwrap();
        (at_init, init_out, full, gathered, out)
    });
    for (rank, (at_init, _, full, gathered, _)) in ranks.iter().enumerate() {
        assert_identical(&format!("rank {rank} at init"), at_init, &init);
        assert_identical(&format!("rank {rank} after 3 steps"), gathered, full);
        let (w, n) = common::worst_rel(gathered, &trained);
        println!("rank {rank}: gathered vs single-process after 3 steps: {w:e} ({n})");
        assert!(w <= TOL, "rank {rank}: {n} differs by {w}");
    }
    let init_out: Vec<&Completion> = ranks.iter().flat_map(|r| &r.1).collect();
    for (i, (g, w)) in init_out.iter().zip(&want_init).enumerate() {
        assert_eq!(g.tokens, w.tokens, "prompt {i} at init");
        // Same weights; another batch and thread count reorder the sums.
        for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
            assert!(
                (a - b).abs() <= 1e-5,
                "prompt {i} at init: log-prob {a} vs {b}"
            );
        }
    }
    assert!(ranks[1].4.is_empty());
    assert_eq!(ranks[0].4.len(), want.len());
    for (i, (g, w)) in ranks[0].4.iter().zip(&want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "prompt {i} after 3 steps");
        for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
            assert!((a - b).abs() <= 1e-4, "prompt {i}: log-prob {a} vs {b}");
        }
    }
}

/// Mixed precision: the gathered policy is in the compute dtype, equal bit
/// for bit to the replicated trainer's compute copy, and decodes the same.
/// A rank that cannot run the round fails every rank before the gather,
/// without a hang.
#[test]
fn fsdp_policy_is_the_compute_copy_and_a_refusing_rank_fails_all_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = job(dir.path(), true);
    cfg.precision.compute = tch::Kind::BFloat16;
    let single = ReplicatedTrainer::single(&cfg, None).unwrap();
    let want_params = params_of(single.compute_model());
    let reqs = prompts();
    let want = generate(single.compute_model(), &greedy(), &reqs).unwrap();
    let (cfg2, reqs2) = (cfg.clone(), reqs.clone());
    let ranks = on_ranks(2, move |rank, coll| {
        let mut t = FsdpTrainer::new(&cfg2, None, coll).unwrap();
        let policy = t.gather_policy(true).unwrap();
        let out = generate(&policy, &greedy(), &reqs2).unwrap();
        let params = params_of(&policy);
        drop(policy);
        let refused = t.gather_policy(rank != 1).map(|_| ()).unwrap_err();
        (params, out, format!("{refused:#}"))
    });
    for (rank, (params, out, refused)) in ranks.iter().enumerate() {
        assert!(params.iter().all(|(_, p)| p.kind() == tch::Kind::BFloat16));
        assert_identical(&format!("rank {rank}"), params, &want_params);
        for (g, w) in out.iter().zip(&want) {
            assert_eq!((&g.tokens, &g.logprobs), (&w.tokens, &w.logprobs));
        }
        let expect = if rank == 1 {
            "this rank"
        } else {
            "1 other rank"
        };
        assert!(refused.contains(expect), "rank {rank}: {refused}");
    }
}
