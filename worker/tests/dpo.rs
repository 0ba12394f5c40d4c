//! DPO (issue 5 "Done means"): packed pairs through `Passes::train_microbatch`
//! against TRL 1.16's own `DPOTrainer._compute_loss`
//! (`scripts/reference/dpo_trl.py`), per-sequence log-probs of packed pairs
//! against each sequence alone (the packing offset regression), and the same
//! update for one microbatch, uneven microbatches and two ranks, with the
//! wrong normaliser (local pair count instead of the step's P) shown to fail.
//!
//! Pairs share a prompt (labels -100) and have completions of very different
//! lengths (1 to 50 tokens), so a wrong offset between a pair's two sequences
//! or between pairs shows up at once.

mod common;

use std::collections::BTreeMap;

use accrue_worker::batch::PackedBatch;
use accrue_worker::batch::{MicrobatchMeta, SeqMeta, StepNorms};
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::Collective;
use accrue_worker::train::{Passes, ReplicatedTrainer, Trainer};
use tch::Tensor;

type Doc = (Vec<i64>, Vec<i64>);

/// One preference pair with its cached reference log-probs.
#[derive(Clone, Debug)]
struct Pair {
    id: String,
    chosen: Doc,
    rejected: Doc,
    ref_chosen: f64,
    ref_rejected: f64,
}

/// `(prompt, chosen completion, rejected completion)` lengths.
const SHAPES: [(usize, usize, usize); 8] = [
    (4, 3, 50),
    (10, 45, 2),
    (6, 12, 14),
    (20, 1, 30),
    (3, 25, 9),
    (7, 40, 4),
    (2, 6, 33),
    (15, 18, 17),
];

fn tokens(n: usize, seed: u64) -> Vec<i64> {
    common::synthetic_documents(&[n], seed).remove(0).0
}

/// Pairs without reference log-probs yet (filled by [`with_reference`]).
fn raw_pairs() -> Vec<Pair> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, &(p, c, r))| {
            let prompt = tokens(p, 100 + i as u64);
            let doc = |n: usize, seed: u64| -> Doc {
                let ids: Vec<i64> = prompt.iter().copied().chain(tokens(n, seed)).collect();
                let labels = ids
                    .iter()
                    .enumerate()
                    .map(|(j, &t)| if j < p { -100 } else { t })
                    .collect();
                (ids, labels)
            };
            Pair {
                id: format!("pair-{i}"),
                chosen: doc(c, 200 + i as u64),
                rejected: doc(r, 300 + i as u64),
                ref_chosen: 0.0,
                ref_rejected: 0.0,
            }
        })
        .collect()
}

fn job(dir: &std::path::Path, loss: &str, beta: f64) -> accrue_worker::config::JobConfig {
    common::random_job(
        dir,
        &format!(
            "[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n\
             [runtime]\nloss_chunk_tokens = 16\n\
             [objective]\nkind = \"dpo\"\nbeta = {beta}\nloss = \"{loss}\"\n"
        ),
    )
}

fn trainer(dir: &std::path::Path, loss: &str, beta: f64) -> ReplicatedTrainer {
    ReplicatedTrainer::single(&job(dir, loss, beta), None).unwrap()
}

/// Packs pairs into one microbatch: `order` lists `(pair, role)`, so a
/// pair's two sequences need not be adjacent.
fn pack(pairs: &[Pair], order: &[(usize, u32)]) -> (PackedBatch, MicrobatchMeta) {
    if order.is_empty() {
        return (PackedBatch::default(), MicrobatchMeta::default());
    }
    let docs: Vec<Doc> = order
        .iter()
        .map(|&(i, role)| {
            if role == 0 {
                pairs[i].chosen.clone()
            } else {
                pairs[i].rejected.clone()
            }
        })
        .collect();
    let seqs = order
        .iter()
        .map(|&(i, role)| SeqMeta {
            doc_id: pairs[i].id.clone(),
            role,
            advantage: None,
            ref_logp: Some(if role == 0 {
                pairs[i].ref_chosen
            } else {
                pairs[i].ref_rejected
            }),
        })
        .collect();
    (
        common::batch(&docs),
        MicrobatchMeta {
            seqs,
            ..Default::default()
        },
    )
}

/// Chosen then rejected of each listed pair.
fn adjacent(idx: &[usize]) -> Vec<(usize, u32)> {
    idx.iter().flat_map(|&i| [(i, 0), (i, 1)]).collect()
}

/// Each sequence's log-prob run alone (one document per microbatch).
fn alone_logps(t: &mut ReplicatedTrainer, pairs: &[Pair]) -> Vec<[f64; 2]> {
    pairs
        .iter()
        .map(|p| {
            let c = t
                .sequence_logps(0, &common::batch(std::slice::from_ref(&p.chosen)))
                .unwrap();
            let r = t
                .sequence_logps(0, &common::batch(std::slice::from_ref(&p.rejected)))
                .unwrap();
            [c[0].0, r[0].0]
        })
        .collect()
}

/// Reference log-probs: the initial model's, moved by deterministic offsets
/// of both signs so rewards, margins and accuracy are not degenerate.
fn with_reference(pairs: &mut [Pair], initial: &[[f64; 2]]) {
    for (i, (p, lp)) in pairs.iter_mut().zip(initial).enumerate() {
        let x = i as f64;
        p.ref_chosen = lp[0] + 3.0 * (1.3 * x + 0.4).sin();
        p.ref_rejected = lp[1] - 2.0 * (0.7 * x).cos();
    }
}

fn pairs_with_reference(dir: &std::path::Path) -> Vec<Pair> {
    let mut pairs = raw_pairs();
    let initial = alone_logps(&mut trainer(dir, "sigmoid", 0.1), &pairs);
    with_reference(&mut pairs, &initial);
    pairs
}

/// Runs the listed microbatches, microbatch i normalised by `p_norm[i]`
/// pairs (the step's P, unless a bug is simulated); returns
/// `(Σ loss, Σ extra metrics)`.
fn run_microbatches(
    t: &mut ReplicatedTrainer,
    mbs: &[(PackedBatch, MicrobatchMeta)],
    p_norm: &[u64],
) -> (f64, BTreeMap<String, f64>) {
    let mut loss = 0.0;
    let mut extra = BTreeMap::new();
    for (i, (mb, meta)) in mbs.iter().enumerate() {
        let norms = StepNorms {
            pairs: p_norm[i],
            ..Default::default()
        };
        let o = t.train_microbatch(i, mb, meta, &norms).unwrap();
        loss += o.loss_sum;
        // The pairs counted beside the objective's sums, compared alike.
        *extra.entry("pairs".to_string()).or_insert(0.0) += o.pairs as f64;
        for (k, v) in o.extra {
            *extra.entry(k).or_insert(0.0) += v;
        }
    }
    (loss, extra)
}

fn pairs_json(pairs: &[Pair], loss_type: &str, beta: f64) -> String {
    let list: Vec<serde_json::Value> = pairs
        .iter()
        .map(|p| {
            serde_json::json!({
                "chosen_ids": p.chosen.0, "chosen_labels": p.chosen.1,
                "rejected_ids": p.rejected.0, "rejected_labels": p.rejected.1,
                "ref_chosen": p.ref_chosen, "ref_rejected": p.ref_rejected,
            })
        })
        .collect();
    serde_json::json!({"loss_type": loss_type, "beta": beta, "pairs": list}).to_string()
}

/// Runs `dpo_trl.py` on the trainer's current weights.
fn trl_reference(
    dir: &std::path::Path,
    t: &ReplicatedTrainer,
    pairs: &[Pair],
    loss_type: &str,
    beta: f64,
) -> (serde_json::Value, std::collections::HashMap<String, Tensor>) {
    let model = dir.join("hf");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), common::TINY_CONFIG).unwrap();
    Tensor::write_safetensors(&t.named_parameters(), model.join("model.safetensors")).unwrap();
    let spec = dir.join("pairs.json");
    std::fs::write(&spec, pairs_json(pairs, loss_type, beta)).unwrap();
    let grads = dir.join("grads.safetensors");
    let out = common::python_output(
        "dpo_trl.py",
        &[
            model.to_str().unwrap(),
            spec.to_str().unwrap(),
            grads.to_str().unwrap(),
        ],
    );
    let line = out.lines().last().expect("dpo_trl.py printed nothing");
    (serde_json::from_str(line).unwrap(), common::read(&grads))
}

/// Our loss "dpo_norm" is TRL 1.16's "sigmoid_norm".
fn trl_parity(loss: &str, trl_loss: &str, beta: f64) {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let pairs = pairs_with_reference(dir.path());
    let p = pairs.len() as u64;
    let mut t = trainer(dir.path(), loss, beta);
    let (reference, ref_grads) = trl_reference(dir.path(), &t, &pairs, trl_loss, beta);

    // Three uneven microbatches; in the first a pair's two sequences are
    // apart (rejected before chosen, another pair in between).
    let mbs = vec![
        pack(&pairs, &[(0, 1), (1, 0), (0, 0), (1, 1), (2, 0), (2, 1)]),
        pack(&pairs, &adjacent(&[3])),
        pack(&pairs, &adjacent(&[4, 5, 6, 7])),
    ];
    let (loss_sum, extra) = run_microbatches(&mut t, &mbs, &[p; 3]);
    let pf = p as f64;
    assert_eq!(extra["pairs"], pf);

    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1.0);
    let theirs = reference["loss"].as_f64().unwrap();
    let ours = loss_sum / pf;
    println!(
        "{loss}: loss {ours} vs TRL {theirs} (diff {:e})",
        rel(ours, theirs)
    );
    assert!(rel(ours, theirs) <= 1e-5, "{loss}: loss {ours} vs {theirs}");
    let m = &reference["metrics"];
    let mut worst_metric = 0.0f64;
    for (ours, trl) in [
        ("rewards/chosen", "rewards/chosen"),
        ("rewards/rejected", "rewards/rejected"),
        ("rewards/margin", "rewards/margins"),
        ("rewards/accuracy", "rewards/accuracies"),
        ("logps/chosen", "logps/chosen"),
        ("logps/rejected", "logps/rejected"),
    ] {
        let a = extra[ours] / pf;
        let b = m[trl].as_f64().unwrap();
        println!("{loss}: {ours} {a} vs TRL {trl} {b}");
        assert!(rel(a, b) <= 1e-5, "{loss}: {ours} {a} vs TRL {trl} {b}");
        worst_metric = worst_metric.max(rel(a, b));
    }
    // Not degenerate: some pairs right, some wrong.
    let acc = extra["rewards/accuracy"];
    assert!(
        acc > 0.0 && acc < pf,
        "{loss}: accuracy {acc}/{pf} is degenerate"
    );

    // TRL's per-pair policy log-probs vs ours from the packed run.
    let alone = alone_logps(&mut trainer(dir.path(), loss, beta), &pairs);
    let mut worst_logp = 0.0f64;
    for (i, a) in alone.iter().enumerate() {
        for (r, key) in ["chosen_logps", "rejected_logps"].iter().enumerate() {
            let b = reference[key][i].as_f64().unwrap();
            worst_logp = worst_logp.max(rel(a[r], b));
            // transformers' plain forward on the sequence alone, too.
            let b = reference["alone_logps"][i][r].as_f64().unwrap();
            worst_logp = worst_logp.max(rel(a[r], b));
        }
    }
    println!("{loss}: per-sequence logps vs TRL and transformers alone: worst {worst_logp:e}");
    assert!(worst_logp <= 1e-5);

    // Every parameter's gradient, elementwise |a−b| ≤ 1e-4·max(1, |b|).
    let grads = t.named_grads();
    assert_eq!(grads.len(), ref_grads.len(), "{loss}: parameter count");
    let mut worst = (0.0f64, String::new());
    let mut worst_rel = (0.0f64, String::new());
    for (name, g) in &grads {
        let b = ref_grads
            .get(&format!("grad.{name}"))
            .unwrap_or_else(|| panic!("no TRL gradient for {name}"))
            .to_kind(tch::Kind::Double);
        assert!(
            f64::try_from(b.abs().max()).unwrap() > 0.0,
            "{name}: zero grad"
        );
        let d = (g.to_kind(tch::Kind::Double) - &b).abs() / b.abs().clamp_min(1.0);
        let d = f64::try_from(d.max()).unwrap();
        if d > worst.0 {
            worst = (d, name.clone());
        }
        let (dn, n) = common::diff_norms(g, &b);
        if dn / n > worst_rel.0 {
            worst_rel = (dn / n, name.clone());
        }
    }
    println!(
        "{loss}: worst gradient diff {:e} ({}), per tensor ‖a−b‖/‖b‖ {:e} ({})",
        worst.0, worst.1, worst_rel.0, worst_rel.1
    );
    assert!(
        worst_rel.0 <= 1e-4,
        "{loss}: gradient of {} differs by {:e} relative",
        worst_rel.1,
        worst_rel.0
    );
    assert!(
        worst.0 <= 1e-4,
        "{loss}: gradient of {} differs by {}",
        worst.1,
        worst.0
    );
    println!("{loss}: worst metric diff {worst_metric:e}");
}

#[test]
fn dpo_sigmoid_matches_trl() {
    trl_parity("sigmoid", "sigmoid", 0.1);
}

#[test]
fn dpo_ipo_matches_trl() {
    trl_parity("ipo", "ipo", 0.1);
}

#[test]
fn dpo_norm_matches_trl_sigmoid_norm() {
    trl_parity("dpo_norm", "sigmoid_norm", 2.0);
}

/// The packing offset regression: pairs of very different chosen/rejected
/// lengths packed together (and with other pairs, in several orders) give
/// each sequence the log-prob it has alone, `|a−b| ≤ 1e-5·max(1, |b|)`.
#[test]
fn dpo_packed_sequence_logps_equal_unpacked() {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let pairs = raw_pairs();
    let mut t = trainer(dir.path(), "sigmoid", 0.1);
    let alone = alone_logps(&mut t, &pairs);
    let all: Vec<usize> = (0..pairs.len()).collect();
    let mut reversed = adjacent(&all);
    reversed.reverse();
    let orders: Vec<Vec<(usize, u32)>> = vec![
        adjacent(&all),
        reversed,
        // All chosen first, then all rejected (TRL's batch layout).
        all.iter()
            .map(|&i| (i, 0))
            .chain(all.iter().map(|&i| (i, 1)))
            .collect(),
        // Only the most lopsided pairs (1–3 vs 30–50 tokens).
        adjacent(&[0, 3, 1]),
    ];
    let mut worst = 0.0f64;
    for order in &orders {
        let (mb, _) = pack(&pairs, order);
        let packed = t.sequence_logps(0, &mb).unwrap();
        assert_eq!(packed.len(), order.len());
        for (&(i, role), (lp, n)) in order.iter().zip(&packed) {
            let want = alone[i][role as usize];
            let d = (lp - want).abs() / want.abs().max(1.0);
            worst = worst.max(d);
            assert!(
                d <= 1e-5,
                "pair {i} role {role}: packed {lp} vs alone {want}"
            );
            let doc = if role == 0 {
                &pairs[i].chosen
            } else {
                &pairs[i].rejected
            };
            let expected_tokens = doc.1[1..].iter().filter(|&&l| l != -100).count() as u64;
            assert_eq!(*n, expected_tokens, "pair {i} role {role}: loss tokens");
        }
    }
    println!("packed vs alone per-sequence log-probs: worst {worst:e}");
    // The check can fail: with the rejected sequence's offset taken from the
    // chosen one's length (the old bug), the sums differ by far more.
    let (mb, _) = pack(&pairs, &adjacent(&[0]));
    let mut wrong = mb.clone();
    let c_len = pairs[0].chosen.0.len() as i64;
    let r_len = pairs[0].rejected.0.len() as i64;
    wrong.cu_seq_lens = vec![0, r_len, c_len + r_len];
    let bad = t.sequence_logps(0, &wrong).unwrap();
    let d = (bad[1].0 - alone[0][1]).abs() / alone[0][1].abs();
    println!("with a wrong offset: {d:e}");
    assert!(
        d > 1e-2,
        "a wrong offset should change the log-prob, got {d:e}"
    );
}

/// A pair can sit in one step twice (a step spanning an epoch boundary),
/// even in one microbatch: each copy counts as a pair, with the same loss
/// and gradient as two separate microbatches of it (the two sequences of a
/// copy need not be adjacent); an unmatched copy is an error.
#[test]
fn a_pair_twice_in_one_microbatch_counts_twice() {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let pairs = pairs_with_reference(dir.path());
    let grads = |mbs: &[(PackedBatch, MicrobatchMeta)]| {
        let mut t = trainer(dir.path(), "sigmoid", 0.1);
        let (loss, extra) = run_microbatches(&mut t, mbs, &vec![2; mbs.len()]);
        (loss, extra, common::snapshot(&t.named_grads()))
    };
    let twice = grads(&[pack(
        &pairs,
        &[(2, 0), (5, 0), (2, 0), (5, 1), (2, 1), (2, 1)],
    )]);
    let apart = grads(&[pack(&pairs, &adjacent(&[2])), pack(&pairs, &adjacent(&[2]))]);
    assert_eq!(twice.1["pairs"], 3.0);
    assert_eq!(apart.1["pairs"], 2.0);
    let once = grads(&[pack(&pairs, &adjacent(&[5]))]);
    assert!((twice.0 - apart.0 - once.0).abs() <= 1e-9 * twice.0.abs());
    let alone = grads(&[
        pack(&pairs, &adjacent(&[2])),
        pack(&pairs, &adjacent(&[5])),
        pack(&pairs, &adjacent(&[2])),
    ]);
    let (w, what) = common::worst_rel(&twice.2, &alone.2);
    assert!(w <= 1e-6, "gradients of {what} differ by {w:e}");
    let mut t = trainer(dir.path(), "sigmoid", 0.1);
    let (mb, meta) = pack(&pairs, &[(2, 0), (2, 1), (2, 0)]);
    let err = t
        .train_microbatch(
            0,
            &mb,
            &meta,
            &StepNorms {
                pairs: 2,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("2 chosen and 1 rejected"),
        "{err:#}"
    );
}

/// How a step's microbatches are normalised.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Norm {
    /// P = the step's global pair count (the contract).
    Global,
    /// Each rank divides by its own pair count (a bug to rule out).
    RankPairs,
    /// Each microbatch divides by its own pair count (a bug to rule out).
    MicrobatchPairs,
}

/// `layout[step][rank][microbatch]` = pair indices of that step.
type Layout = Vec<Vec<Vec<Vec<usize>>>>;

/// One rank's step: (global pairs P, the rank's pairs, its microbatches).
type RankStep = (u64, u64, Vec<(PackedBatch, MicrobatchMeta)>);

struct Outcome {
    params: Vec<(String, Tensor)>,
    /// Per step: Σ loss, Σ metrics, grad norm.
    losses: Vec<f64>,
    metrics: Vec<BTreeMap<String, f64>>,
    grad_norms: Vec<f64>,
}

fn steps(pairs: &[Pair]) -> Vec<Vec<Pair>> {
    vec![pairs[..5].to_vec(), pairs[5..].to_vec()]
}

fn train_pairs(loss: &str, pairs: &[Pair], layout: &Layout, norm: Norm, context: usize) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path(), loss, 0.1);
    let steps = steps(pairs);
    let world = layout[0].len();
    for (s, ranks) in layout.iter().enumerate() {
        let mut seen: Vec<usize> = ranks.iter().flatten().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..steps[s].len()).collect::<Vec<_>>(), "step {s}");
        assert!(ranks.iter().all(|r| r.len() == ranks[0].len()), "step {s}");
    }
    // Context parallelism (issue 37): each rank of the layout is a group of
    // `context` ranks given the same microbatches.
    let mut groups: Vec<Option<Box<dyn Collective>>> = (0..world)
        .flat_map(|_| LocalGroup::new(context))
        .map(|r| Some(Box::new(r) as Box<dyn Collective>))
        .collect();
    let handles: Vec<_> = LocalGroup::new(world * context)
        .into_iter()
        .enumerate()
        .map(|(thread, coll)| {
            let rank = thread / context;
            let group = groups[thread].take().expect("one per thread");
            let cfg = cfg.clone();
            let mine: Vec<RankStep> = layout
                .iter()
                .enumerate()
                .map(|(s, ranks)| {
                    let local = ranks[rank].iter().map(Vec::len).sum::<usize>() as u64;
                    let mbs = ranks[rank]
                        .iter()
                        .map(|idx| pack(&steps[s], &adjacent(idx)))
                        .collect();
                    (steps[s].len() as u64, local, mbs)
                })
                .collect();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let mut t = ReplicatedTrainer::new(&cfg, None, Box::new(coll))
                    .unwrap()
                    .with_context(group);
                let mut per_step = Vec::new();
                for (global, local, mbs) in &mine {
                    let p: Vec<u64> = mbs
                        .iter()
                        .map(|(_, meta)| match norm {
                            Norm::Global => *global,
                            Norm::RankPairs => (*local).max(1),
                            Norm::MicrobatchPairs => (meta.seqs.len() as u64 / 2).max(1),
                        })
                        .collect();
                    let (loss, extra) = run_microbatches(&mut t, mbs, &p);
                    let st = t.optimizer_step(1e-3).unwrap();
                    per_step.push((loss, extra, st.grad_norm));
                }
                (common::snapshot(&t.named_parameters()), per_step)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, r) in results.iter().enumerate().skip(1) {
        let (w, n) = common::worst_rel(&r.0, &results[0].0);
        assert_eq!(w, 0.0, "rank {rank}'s replica drifted from rank 0 at {n}");
    }
    let n_steps = layout.len();
    // Every rank of a context group reports its group's row sums: the
    // same on each, counted once.
    for (thread, r) in results.iter().enumerate() {
        let leader = &results[thread - thread % context];
        for (s, (mine, first)) in r.1.iter().zip(&leader.1).enumerate() {
            assert_eq!(
                (mine.0, &mine.1),
                (first.0, &first.1),
                "thread {thread}, step {s}: sums differ within its group"
            );
        }
    }
    let leaders: Vec<_> = results.iter().step_by(context).collect();
    let mut metrics = vec![BTreeMap::new(); n_steps];
    for r in &leaders {
        for (s, (_, extra, _)) in r.1.iter().enumerate() {
            for (k, v) in extra {
                *metrics[s].entry(k.clone()).or_insert(0.0) += v;
            }
        }
    }
    Outcome {
        params: common::snapshot(&results[0].0),
        losses: (0..n_steps)
            .map(|s| leaders.iter().map(|r| r.1[s].0).sum())
            .collect(),
        metrics,
        grad_norms: results[0].1.iter().map(|p| p.2).collect(),
    }
}

/// Worst relative difference of parameters, loss sums, metric sums and
/// grad norms (scalars relative to max(1, |b|)).
fn compare(a: &Outcome, b: &Outcome) -> (f64, String) {
    let (mut worst, mut what) = common::worst_rel(&a.params, &b.params);
    for s in 0..b.losses.len() {
        let mut scalars = vec![
            ("loss sum".to_string(), a.losses[s], b.losses[s]),
            ("grad norm".to_string(), a.grad_norms[s], b.grad_norms[s]),
        ];
        assert_eq!(
            a.metrics[s].keys().collect::<Vec<_>>(),
            b.metrics[s].keys().collect::<Vec<_>>()
        );
        for (k, v) in &b.metrics[s] {
            scalars.push((k.clone(), a.metrics[s][k], *v));
        }
        for (name, x, y) in scalars {
            let rel = (x - y).abs() / y.abs().max(1.0);
            if rel > worst {
                (worst, what) = (rel, format!("step {s} {name}: {x} vs {y}"));
            }
        }
    }
    (worst, what)
}

fn layouts() -> Vec<(&'static str, Layout)> {
    vec![
        (
            "1 rank, 1 microbatch",
            vec![vec![vec![(0..5).collect()]], vec![vec![(0..3).collect()]]],
        ),
        (
            "1 rank, uneven microbatches",
            vec![
                vec![vec![vec![0], vec![1, 2, 3], vec![4]]],
                vec![vec![vec![2], vec![0, 1]]],
            ],
        ),
        (
            "2 ranks",
            vec![
                vec![vec![vec![0, 1], vec![2]], vec![vec![3, 4], vec![]]],
                vec![vec![vec![0]], vec![vec![1, 2]]],
            ],
        ),
    ]
}

fn equivalence(loss: &str) {
    let dir = tempfile::tempdir().unwrap();
    let pairs = pairs_with_reference(dir.path());
    let layouts = layouts();
    let reference = train_pairs(loss, &pairs, &layouts[0].1, Norm::Global, 1);
    println!(
        "{loss}: losses {:?}, grad norms {:?}",
        reference.losses, reference.grad_norms
    );
    for (name, layout) in &layouts[1..] {
        let got = train_pairs(loss, &pairs, layout, Norm::Global, 1);
        let (w, what) = compare(&got, &reference);
        println!("{loss}, {name}: worst relative difference {w:e} ({what})");
        assert!(w <= 1e-5, "{loss}, {name}: {what} differs by {w:e}");
    }
    // Context parallelism (issue 37): the 2-rank layout with each rank a
    // group of 2 splitting its rows: a pair's two sequences' log-probs
    // are summed over the group before the pair's loss.
    // Groups of 2 and of 4.
    for context in [2, 4] {
        let got = train_pairs(loss, &pairs, &layouts[2].1, Norm::Global, context);
        let (w, what) = compare(&got, &reference);
        println!("{loss}, 2 ranks × context {context}: worst relative difference {w:e} ({what})");
        assert!(
            w <= 1e-5,
            "{loss}, context {context}: {what} differs by {w:e}"
        );
    }
    // Dividing by a local pair count instead of P misses by far.
    for (bug, (name, layout)) in [Norm::MicrobatchPairs, Norm::RankPairs]
        .into_iter()
        .zip(&layouts[1..])
    {
        let bad = train_pairs(loss, &pairs, layout, bug, 1);
        let (w, what) = common::worst_rel(&bad.params, &reference.params);
        let g = (bad.grad_norms[0] - reference.grad_norms[0]).abs() / reference.grad_norms[0];
        println!("{loss}, {name}, {bug:?}: parameters {w:e} ({what}), grad norm {g:e}");
        assert!(w > 1e-3, "{loss}, {name}, {bug:?}: should miss, got {w:e}");
        assert!(
            g > 1e-2,
            "{loss}, {name}, {bug:?}: grad norm should differ, got {g:e}"
        );
    }
}

#[test]
fn dpo_sigmoid_same_update_for_any_split_and_world_size() {
    equivalence("sigmoid");
}

#[test]
fn dpo_ipo_same_update_for_any_split_and_world_size() {
    equivalence("ipo");
}
