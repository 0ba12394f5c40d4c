//! Context parallelism is exact (issue 37): the same documents trained for
//! 3 steps by one rank with one microbatch per step, and by groups of
//! ranks splitting every microbatch's row (C = 2 and 4 in one group, and
//! two groups of 2 each given half the documents), end with the same
//! parameters, loss sums and gradient norms, at ddp, zero2 and fsdp. The
//! documents run to 64 tokens, several times a rank's share of a row at
//! C = 4. Ranks are threads: one `LocalGroup` for the data-parallel
//! reduction over every rank, one per context group.

mod common;

use accrue_worker::batch::PackedBatch;
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::Collective;
use accrue_worker::train::{FsdpTrainer, ReplicatedTrainer, Trainer};

const TOL: f64 = 1e-5;
const LR: f64 = 1e-3;

type Docs = Vec<(Vec<i64>, Vec<i64>)>;

fn steps() -> Vec<Docs> {
    vec![
        common::synthetic_documents(&[37, 5, 61, 12, 2, 28, 44, 9, 19], 21),
        common::synthetic_documents(&[50, 3, 17, 8, 33], 22),
        common::synthetic_documents(&[21, 64, 6, 7, 7, 40], 23),
    ]
}

struct Outcome {
    params: Vec<(String, tch::Tensor)>,
    loss_sums: Vec<f64>,
    grad_norms: Vec<f64>,
}

/// Trains [`steps`] on `groups` context groups of `size` ranks each
/// (world = groups × size): group g gets the documents `i % groups == g`
/// of each step as one microbatch.
fn train(sharding: &str, groups: usize, size: usize) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(
        dir.path(),
        &format!(
            "[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n\
             [runtime]\nloss_chunk_tokens = 32\n[parallel]\nsharding = \"{sharding}\"\n"
        ),
    );
    let docs = steps();
    let totals: Vec<u64> = docs
        .iter()
        .map(|d| common::batch(d).loss_tokens())
        .collect();
    let mut context: Vec<Option<Box<dyn Collective>>> = (0..groups)
        .flat_map(|_| LocalGroup::new(size))
        .map(|r| Some(Box::new(r) as Box<dyn Collective>))
        .collect();
    let handles: Vec<_> = LocalGroup::new(groups * size)
        .into_iter()
        .enumerate()
        .map(|(rank, coll)| {
            let cfg = cfg.clone();
            let totals = totals.clone();
            let group = rank / size;
            let mine: Vec<PackedBatch> = docs
                .iter()
                .map(|d| {
                    let part: Docs = d
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| i % groups == group)
                        .map(|(_, x)| x.clone())
                        .collect();
                    common::batch(&part)
                })
                .collect();
            let ctx = context[rank].take().unwrap();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let mut t = Ranked::new(&cfg, Box::new(coll), ctx);
                let mut per_step = Vec::new();
                for (s, mb) in mine.iter().enumerate() {
                    let loss = t.microbatch(mb, totals[s]);
                    let st = t.trainer().optimizer_step(LR).unwrap();
                    per_step.push((loss, st.grad_norm));
                }
                (common::snapshot(&t.parameters()), per_step)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, (params, _)) in results.iter().enumerate().skip(1) {
        let (w, n) = common::worst_rel(params, &results[0].0);
        assert_eq!(w, 0.0, "rank {rank}'s replica drifted from rank 0 at {n}");
    }
    let steps = results[0].1.len();
    // Every rank of a group reports its group's row sums: the same on
    // each, counted once.
    for (rank, r) in results.iter().enumerate() {
        let first = &results[rank - rank % size].1;
        let same = r.1.iter().zip(first).all(|(a, b)| a.0 == b.0);
        assert!(
            same,
            "rank {rank}'s loss sums differ from its group's first rank's"
        );
    }
    Outcome {
        params: results[0]
            .0
            .iter()
            .map(|(n, t)| (n.clone(), t.copy()))
            .collect(),
        loss_sums: (0..steps)
            .map(|s| results.iter().step_by(size).map(|r| r.1[s].0).sum())
            .collect(),
        grad_norms: results[0].1.iter().map(|p| p.1).collect(),
    }
}

/// A rank's trainer at the job's sharding, splitting rows over its group.
enum Ranked {
    Replicated(Box<ReplicatedTrainer>),
    Fsdp(Box<FsdpTrainer>),
}

impl Ranked {
    fn new(
        cfg: &accrue_worker::config::JobConfig,
        coll: Box<dyn Collective>,
        group: Box<dyn Collective>,
    ) -> Ranked {
        match cfg.sharding {
            accrue_worker::config::Sharding::Fsdp => Ranked::Fsdp(Box::new(
                FsdpTrainer::new(cfg, None, coll)
                    .unwrap()
                    .with_context(group),
            )),
            _ => Ranked::Replicated(Box::new(
                ReplicatedTrainer::new(cfg, None, coll)
                    .unwrap()
                    .with_context(group),
            )),
        }
    }

    fn trainer(&mut self) -> &mut dyn Trainer {
        match self {
            Ranked::Replicated(t) => t.as_mut(),
            Ranked::Fsdp(t) => t.as_mut(),
        }
    }

    /// One microbatch scaled by the step's loss tokens: its loss sum.
    fn microbatch(&mut self, mb: &PackedBatch, total: u64) -> f64 {
        match self {
            Ranked::Replicated(t) => t.microbatch(0, mb, total),
            Ranked::Fsdp(t) => t.microbatch(0, mb, total),
        }
        .unwrap()
        .loss_sum
    }

    fn parameters(&mut self) -> Vec<(String, tch::Tensor)> {
        match self {
            Ranked::Replicated(t) => t.named_parameters(),
            Ranked::Fsdp(t) => t.named_full_parameters().unwrap(),
        }
    }
}

fn worst(a: &Outcome, b: &Outcome) -> (f64, String) {
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
    let reference = train("ddp", 1, 1);
    for (groups, size) in [(1, 2), (1, 4), (2, 2)] {
        let got = train(sharding, groups, size);
        let (w, what) = worst(&got, &reference);
        println!(
            "{sharding}, {groups} group(s) of {size}: worst relative difference {w:e} ({what})"
        );
        assert!(
            w <= TOL,
            "{sharding}, {groups}×{size}: {what} differs by {w:e}"
        );
    }
}

#[test]
fn ddp_context_parallel_steps_equal_one_rank() {
    equivalence("ddp");
}

#[test]
fn zero2_context_parallel_steps_equal_one_rank() {
    equivalence("zero2");
}

#[test]
fn fsdp_context_parallel_steps_equal_one_rank() {
    equivalence("fsdp");
}
