//! Data parallelism is exact (DESIGN.md "The math", issue 4 "Done means"):
//! the same documents trained for 3 steps as (a) 1 rank, 1 microbatch per
//! step; (b) 1 rank, several uneven microbatches; (c) 2 ranks; (d) 3 ranks
//! with a step where one rank gets only padding microbatches — end with the
//! same parameters and report the same loss sum and gradient norm per step,
//! at `ddp` and at `zero2`. Ranks are threads joined by `LocalGroup`.
//! The two classic bugs (averaging over ranks, dropping a microbatch's
//! gradient) are run too and must fail the same check.

mod common;

use accrue_worker::batch::PackedBatch;
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::train::{Passes, ReplicatedTrainer, Trainer};
use tch::Tensor;

const TOL: f64 = 1e-5;
const LR: f64 = 1e-3;

type Docs = Vec<(Vec<i64>, Vec<i64>)>;
/// `layout[step][rank][microbatch]` = indices into that step's documents;
/// an empty microbatch is padding.
type Layout = Vec<Vec<Vec<Vec<usize>>>>;

fn steps() -> Vec<Docs> {
    vec![
        common::synthetic_documents(&[37, 5, 61, 12, 2, 28, 44, 9, 19], 21),
        common::synthetic_documents(&[50, 3, 17, 8, 33], 22),
        common::synthetic_documents(&[21, 64, 6, 7, 7, 40], 23),
    ]
}

/// The four splits of the issue, for the documents of [`steps`].
fn layouts() -> Vec<(&'static str, Layout)> {
    let one = vec![
        vec![vec![(0..9).collect()]],
        vec![vec![(0..5).collect()]],
        vec![vec![(0..6).collect()]],
    ];
    let uneven = vec![
        vec![vec![vec![0], vec![1, 2], vec![3, 4, 5, 6, 7, 8]]],
        vec![vec![vec![0, 1, 2, 3], vec![4]]],
        vec![vec![vec![0], vec![1], vec![2, 3], vec![4, 5]]],
    ];
    let two = vec![
        vec![
            vec![vec![0, 1, 2], vec![3]],
            vec![vec![4, 5, 6, 7, 8], vec![]],
        ],
        vec![vec![vec![0, 1]], vec![vec![2, 3, 4]]],
        vec![vec![vec![0], vec![1]], vec![vec![2, 3], vec![4, 5]]],
    ];
    let three = vec![
        vec![
            vec![vec![0, 1, 2]],
            vec![vec![3, 4, 5]],
            vec![vec![6, 7, 8]],
        ],
        // Rank 2 gets only padding this step.
        vec![
            vec![vec![0, 1], vec![2]],
            vec![vec![3, 4], vec![]],
            vec![vec![], vec![]],
        ],
        vec![vec![vec![0, 1]], vec![vec![2, 3]], vec![vec![4, 5]]],
    ];
    vec![
        ("1 rank, 1 microbatch", one),
        ("1 rank, uneven microbatches", uneven),
        ("2 ranks", two),
        ("3 ranks, one padding-only", three),
    ]
}

/// A (possibly wrong) way to combine ranks and microbatches.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Bug {
    None,
    /// Each rank normalises by its own loss tokens and the reduction
    /// averages over ranks (mean of rank means).
    AverageOverRanks,
    /// Rank 0 resets its gradients before its second microbatch of the
    /// first step (ZeRO-2's "only the last microbatch survives").
    DropMicrobatch,
}

struct Outcome {
    params: Vec<(String, Tensor)>,
    /// Per step: Σ over ranks of the loss sums, and the reported norm.
    loss_sums: Vec<f64>,
    grad_norms: Vec<f64>,
}

fn config_of(
    dir: &std::path::Path,
    model: &str,
    sharding: &str,
) -> accrue_worker::config::JobConfig {
    common::random_job_of(
        dir,
        model,
        &format!(
            "[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n\
             [runtime]\nloss_chunk_tokens = 32\n[parallel]\nsharding = \"{sharding}\"\n"
        ),
    )
}

fn train(sharding: &str, layout: &Layout, bug: Bug) -> Outcome {
    train_model(common::TINY_CONFIG, sharding, layout, bug)
}

fn train_model(model: &str, sharding: &str, layout: &Layout, bug: Bug) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_of(dir.path(), model, sharding);
    let docs = steps();
    let world = layout[0].len();
    // Every document of every step exactly once; equal microbatch counts.
    for (s, ranks) in layout.iter().enumerate() {
        let mut seen: Vec<usize> = ranks.iter().flatten().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..docs[s].len()).collect::<Vec<_>>(), "step {s}");
        assert!(ranks.iter().all(|r| r.len() == ranks[0].len()), "step {s}");
    }
    let batch = |s: usize, idx: &[usize]| -> PackedBatch {
        if idx.is_empty() {
            return PackedBatch::default();
        }
        let d: Docs = idx.iter().map(|&i| docs[s][i].clone()).collect();
        common::batch(&d)
    };
    let totals: Vec<u64> = docs
        .iter()
        .map(|d| common::batch(d).loss_tokens())
        .collect();
    let handles: Vec<_> = LocalGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let cfg = cfg.clone();
            let totals = totals.clone();
            let mine: Vec<Vec<PackedBatch>> = layout
                .iter()
                .enumerate()
                .map(|(s, ranks)| ranks[rank].iter().map(|mb| batch(s, mb)).collect())
                .collect();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let mut t = ReplicatedTrainer::new(&cfg, None, Box::new(coll)).unwrap();
                let mut per_step = Vec::new();
                for (s, mbs) in mine.iter().enumerate() {
                    let local: u64 = mbs.iter().map(PackedBatch::loss_tokens).sum();
                    let norm = match bug {
                        Bug::AverageOverRanks => local * world as u64,
                        _ => totals[s],
                    };
                    let mut loss = 0.0;
                    for (i, mb) in mbs.iter().enumerate() {
                        if bug == Bug::DropMicrobatch && (s, rank, i) == (0, 0, 1) {
                            t.zero_grad();
                        }
                        loss += t.microbatch(i, mb, norm).unwrap().loss_sum;
                    }
                    let st = t.optimizer_step(LR).unwrap();
                    per_step.push((loss, st.grad_norm));
                }
                (common::snapshot(&t.named_parameters()), per_step)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (params, per_step)) in results.iter().enumerate().skip(1) {
        let (w, n) = common::worst_rel(params, &results[0].0);
        assert_eq!(w, 0.0, "rank {rank}'s replica drifted from rank 0 at {n}");
        let norms: Vec<f64> = per_step.iter().map(|p| p.1).collect();
        let norms0: Vec<f64> = results[0].1.iter().map(|p| p.1).collect();
        assert_eq!(norms, norms0, "rank {rank} reports another grad norm");
    }
    let steps = results[0].1.len();
    Outcome {
        params: results[0]
            .0
            .iter()
            .map(|(n, t)| (n.clone(), t.copy()))
            .collect(),
        loss_sums: (0..steps)
            .map(|s| results.iter().map(|r| r.1[s].0).sum())
            .collect(),
        grad_norms: results[0].1.iter().map(|p| p.1).collect(),
    }
}

/// Worst relative difference of parameters, loss sums and grad norms.
fn compare(a: &Outcome, b: &Outcome) -> (f64, String) {
    let (mut worst, mut what) = common::worst_rel(&a.params, &b.params);
    for s in 0..b.loss_sums.len() {
        for (name, x, y) in [
            ("loss sum", a.loss_sums[s], b.loss_sums[s]),
            ("grad norm", a.grad_norms[s], b.grad_norms[s]),
        ] {
            let rel = (x - y).abs() / y.abs().max(1e-30);
            if rel > worst {
                (worst, what) = (rel, format!("step {s} {name}: {x} vs {y}"));
            }
        }
    }
    (worst, what)
}

fn equivalence(sharding: &str) {
    let layouts = layouts();
    let reference = train("ddp", &layouts[0].1, Bug::None);
    println!("reference grad norms {:?}", reference.grad_norms);
    for (name, layout) in &layouts {
        let got = train(sharding, layout, Bug::None);
        let (w, what) = compare(&got, &reference);
        println!("{sharding}, {name}: worst relative difference {w:e} ({what})");
        assert!(w <= TOL, "{sharding}, {name}: {what} differs by {w:e}");
    }
}

#[test]
fn ddp_same_update_for_any_split_and_world_size() {
    equivalence("ddp");
}

#[test]
fn zero2_same_update_for_any_split_and_world_size() {
    equivalence("zero2");
}

/// Every family (issue 34): 3 AdamW steps on 2 ranks with uneven
/// microbatches, at ddp and zero2, equal 1 rank with one microbatch per
/// step (and that equals transformers + torch AdamW: tests/optimizer.rs).
#[test]
fn families_same_update_on_two_ranks_at_ddp_and_zero2() {
    let layouts = layouts();
    for (family, model) in common::FAMILY_CONFIGS {
        let reference = train_model(model, "ddp", &layouts[0].1, Bug::None);
        for sharding in ["ddp", "zero2"] {
            let got = train_model(model, sharding, &layouts[2].1, Bug::None);
            let (w, what) = compare(&got, &reference);
            println!("{family} {sharding}, 2 ranks: worst relative difference {w:e} ({what})");
            assert!(w <= TOL, "{family} {sharding}: {what} differs by {w:e}");
        }
    }
}

#[test]
fn averaging_over_ranks_or_dropping_a_microbatch_fails_the_check() {
    let layouts = layouts();
    let reference = train("ddp", &layouts[0].1, Bug::None);
    for sharding in ["ddp", "zero2"] {
        for bug in [Bug::AverageOverRanks, Bug::DropMicrobatch] {
            let got = train(sharding, &layouts[2].1, bug);
            let (w, what) = compare(&got, &reference);
            println!("{sharding}, {bug:?}: {w:e} ({what})");
            assert!(
                w > 100.0 * TOL,
                "{sharding}, {bug:?} should miss the reference, got {w:e}"
            );
        }
    }
}
