//! Exact gradient accumulation (DESIGN.md "The math", "Accumulation
//! boundary"): the same documents as one microbatch or as k microbatches of
//! uneven lengths give the same gradients and the same parameters after the
//! optimizer step, also when k changes from step to step. The two classic
//! bugs — keeping only the last microbatch's gradient (ZeRO-2) and
//! averaging per-microbatch means (dividing by the number of microbatches) —
//! are computed explicitly and shown to miss by far more than the tolerance.

mod common;

use accrue_worker::batch::PackedBatch;
use accrue_worker::train::{Passes, ReplicatedTrainer, Trainer};
use tch::Tensor;

const TOL: f64 = 1e-5;
const LR: f64 = 1e-3;
const LENGTHS: [usize; 9] = [37, 5, 61, 12, 2, 28, 44, 9, 19];

/// Splits documents into microbatches at the given document indices.
fn split(docs: &[(Vec<i64>, Vec<i64>)], cuts: &[usize]) -> Vec<PackedBatch> {
    let mut out = Vec::new();
    let mut start = 0;
    for &c in cuts.iter().chain(std::iter::once(&docs.len())) {
        out.push(common::batch(&docs[start..c]));
        start = c;
    }
    out
}

/// eps = 1e-6: AdamW's first step is ≈ lr·g/(|g| + eps), which turns the
/// fp32 reassociation noise of gradient elements near eps in size into
/// parameter noise (measured: 1.0e-5 with eps = 1e-8 on the varying-k run,
/// 1.8e-7 with eps = 1e-6, while the gradients agree to 2e-7 either way).
fn trainer(dir: &std::path::Path) -> ReplicatedTrainer {
    tch::set_num_threads(2);
    let cfg = common::random_job(
        dir,
        "[optimizer]\nweight_decay = 0.1\ngrad_clip = 1.0\neps = 1e-6\n[runtime]\nloss_chunk_tokens = 32\n",
    );
    ReplicatedTrainer::single(&cfg, None).unwrap()
}

/// How a (possibly wrong) accumulation treats a step's microbatches.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Accumulate {
    /// Σ_mb (1/T) Σ_t ℓ_t, gradients summed: the contract.
    Exact,
    /// Gradients reset before every microbatch: only the last one survives.
    LastOnly,
    /// Each microbatch's mean loss divided by the number of microbatches.
    MeanOfMeans,
}

fn run_step(
    t: &mut ReplicatedTrainer,
    mbs: &[PackedBatch],
    how: Accumulate,
) -> Vec<(String, Tensor)> {
    let total: u64 = mbs.iter().map(|m| m.loss_tokens()).sum();
    for (i, mb) in mbs.iter().enumerate() {
        let norm = match how {
            Accumulate::Exact => total,
            Accumulate::LastOnly => {
                t.zero_grad();
                total
            }
            Accumulate::MeanOfMeans => mb.loss_tokens() * mbs.len() as u64,
        };
        t.microbatch(i, mb, norm).unwrap();
    }
    let grads = common::snapshot(&t.named_grads());
    t.optimizer_step(LR).unwrap();
    grads
}

#[test]
fn accumulation_k_uneven_microbatches_equal_one_microbatch() {
    let dir = tempfile::tempdir().unwrap();
    let docs = common::synthetic_documents(&LENGTHS, 1);
    let one = vec![common::batch(&docs)];
    let k = split(&docs, &[1, 2, 6]); // 37 | 5 | 61+12+2+28 | 44+9+19 tokens

    let mut reference = trainer(dir.path());
    let g_ref = run_step(&mut reference, &one, Accumulate::Exact);
    let p_ref = common::snapshot(&reference.named_parameters());

    let mut ok = trainer(dir.path());
    let g = run_step(&mut ok, &k, Accumulate::Exact);
    let (gw, gn) = common::worst_rel(&g, &g_ref);
    let (pw, pn) = common::worst_rel(&ok.named_parameters(), &p_ref);
    println!("exact: gradients {gw:e} ({gn}), parameters {pw:e} ({pn})");
    assert!(gw <= TOL, "gradient of {gn} differs by {gw}");
    assert!(pw <= TOL, "parameter {pn} differs by {pw}");

    // The wrong implementations must fail the same check by a wide margin.
    for how in [Accumulate::LastOnly, Accumulate::MeanOfMeans] {
        let mut bad = trainer(dir.path());
        let g = run_step(&mut bad, &k, how);
        let (gw, gn) = common::worst_rel(&g, &g_ref);
        let (pw, pn) = common::worst_rel(&bad.named_parameters(), &p_ref);
        println!("{how:?}: gradients {gw:e} ({gn}), parameters {pw:e} ({pn})");
        assert!(
            gw > 100.0 * TOL,
            "{how:?} gradients should differ, got {gw}"
        );
        assert!(
            pw > 100.0 * TOL,
            "{how:?} parameters should differ, got {pw}"
        );
    }
}

#[test]
fn accumulation_varying_k_across_steps_matches_one_microbatch_per_step() {
    let dir = tempfile::tempdir().unwrap();
    // Four steps with different documents; the split changes every step.
    type Docs = Vec<(Vec<i64>, Vec<i64>)>;
    let steps: Vec<(Docs, Vec<usize>)> = vec![
        (common::synthetic_documents(&LENGTHS, 2), vec![4]),
        (
            common::synthetic_documents(&[50, 3, 17, 8, 33], 3),
            vec![1, 2, 3, 4],
        ),
        (common::synthetic_documents(&[21, 64, 6], 4), vec![]),
        (
            common::synthetic_documents(&[7, 7, 40, 13, 25, 3], 5),
            vec![2, 3],
        ),
    ];
    let mut reference = trainer(dir.path());
    let mut split_run = trainer(dir.path());
    for (s, (docs, cuts)) in steps.iter().enumerate() {
        run_step(&mut reference, &[common::batch(docs)], Accumulate::Exact);
        run_step(&mut split_run, &split(docs, cuts), Accumulate::Exact);
        let (pw, pn) = common::worst_rel(
            &split_run.named_parameters(),
            &common::snapshot(&reference.named_parameters()),
        );
        println!(
            "step {s} (k = {}): parameters {pw:e} ({pn})",
            cuts.len() + 1
        );
        assert!(pw <= TOL, "step {s}: parameter {pn} differs by {pw}");
    }
    let (step_a, _) = reference.optimizer_state().unwrap();
    let (step_b, _) = split_run.optimizer_state().unwrap();
    assert_eq!((step_a, step_b), (4, 4));
}

#[test]
fn padding_microbatch_contributes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let docs = common::synthetic_documents(&LENGTHS, 6);
    let mut a = trainer(dir.path());
    let mut b = trainer(dir.path());
    let ga = run_step(&mut a, &[common::batch(&docs)], Accumulate::Exact);
    let total = common::batch(&docs).loss_tokens();
    let empty = PackedBatch::default();
    let s = b.microbatch(0, &empty, total).unwrap();
    assert_eq!((s.tokens, s.loss_tokens, s.loss_sum), (0, 0, 0.0));
    b.microbatch(1, &common::batch(&docs), total).unwrap();
    let gb = common::snapshot(&b.named_grads());
    let (gw, _) = common::worst_rel(&gb, &ga);
    assert!(gw <= TOL);
}
