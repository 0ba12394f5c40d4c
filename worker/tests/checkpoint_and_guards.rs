//! Checkpoint round-trip (transformers loads what the trainer saves; a
//! restored trainer continues identically) and the non-finite guards.

mod common;

use accrue_worker::train::{Checkpointing, ReplicatedTrainer, Trainer};

fn job(dir: &std::path::Path) -> accrue_worker::config::JobConfig {
    common::random_job(dir, "[optimizer]\nweight_decay = 0.01\n")
}

#[test]
fn checkpoint_round_trip_transformers_and_resume() {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    let cfg = job(dir.path());
    let docs = common::synthetic_documents(&[23, 9, 31], 11);
    let batch = common::batch(&docs);
    let total = batch.loss_tokens();

    let mut a = ReplicatedTrainer::single(&cfg, None).unwrap();
    a.microbatch(0, &batch, total).unwrap();
    a.optimizer_step(1e-3).unwrap();
    let ckpt = dir.path().join("ckpt");
    a.save_checkpoint(&ckpt).unwrap();

    // transformers loads it and gives our logits.
    common::assert_transformers_logits(dir.path(), &ckpt, a.model(), &docs);

    // Restored trainer: same parameters and optimizer state, same next step.
    let mut b = ReplicatedTrainer::single(&cfg, Some(&ckpt)).unwrap();
    let (wp, np) = common::worst_rel(
        &b.named_parameters(),
        &common::snapshot(&a.named_parameters()),
    );
    assert_eq!(wp, 0.0, "restored parameter {np} differs");
    let (sa, ma) = a.optimizer_state().unwrap();
    let (sb, mb) = b.optimizer_state().unwrap();
    assert_eq!(sa, sb);
    for ((n, m1, v1), (_, m2, v2)) in ma.iter().zip(&mb) {
        assert_eq!(common::max_abs_diff(m1, m2), 0.0, "exp_avg of {n}");
        assert_eq!(common::max_abs_diff(v1, v2), 0.0, "exp_avg_sq of {n}");
    }
    let next = common::batch(&common::synthetic_documents(&[14, 40], 12));
    let t = next.loss_tokens();
    let la = a.microbatch(0, &next, t).unwrap();
    let lb = b.microbatch(0, &next, t).unwrap();
    assert_eq!(la.loss_sum, lb.loss_sum);
    a.optimizer_step(1e-3).unwrap();
    b.optimizer_step(1e-3).unwrap();
    let (wp, np) = common::worst_rel(
        &b.named_parameters(),
        &common::snapshot(&a.named_parameters()),
    );
    assert_eq!(wp, 0.0, "after resuming, parameter {np} differs");
}

#[test]
fn nan_parameter_fails_the_microbatch_and_leaves_gradients_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = ReplicatedTrainer::single(&job(dir.path()), None).unwrap();
    let batch = common::batch(&common::synthetic_documents(&[20, 10], 3));
    let total = batch.loss_tokens();
    t.microbatch(0, &batch, total).unwrap();
    let grads_before = common::snapshot(&t.named_grads());
    let (_, norm_w) = t
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n == "model.norm.weight")
        .unwrap();
    tch::no_grad(|| {
        let _ = norm_w.get(0).fill_(f64::NAN);
    });
    let err = format!("{:#}", t.microbatch(3, &batch, total).unwrap_err());
    assert!(
        err.contains("microbatch 3") && err.contains("non-finite loss"),
        "{err}"
    );
    let (w, n) = common::worst_rel(&common::snapshot(&t.named_grads()), &grads_before);
    assert_eq!(w, 0.0, "gradient of {n} changed by a failed microbatch");
}

#[test]
fn nan_gradient_fails_the_optimizer_step_and_leaves_parameters_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = ReplicatedTrainer::single(&job(dir.path()), None).unwrap();
    let batch = common::batch(&common::synthetic_documents(&[20, 10], 4));
    t.microbatch(0, &batch, batch.loss_tokens()).unwrap();
    let before = common::snapshot(&t.named_parameters());
    let (_, g) = t.named_grads().into_iter().next().unwrap();
    tch::no_grad(|| {
        let _ = g.get(0).fill_(f64::INFINITY);
    });
    let err = t.optimizer_step(1e-3).unwrap_err().to_string();
    assert!(err.contains("non-finite gradient norm"), "{err}");
    let (w, n) = common::worst_rel(&t.named_parameters(), &before);
    assert_eq!(w, 0.0, "parameter {n} changed by a failed step");
    // Gradients were discarded: the next step starts clean.
    let norm_after: f64 = t
        .named_grads()
        .iter()
        .map(|(_, g)| f64::try_from(g.abs().sum(tch::Kind::Double)).unwrap())
        .sum();
    assert_eq!(norm_after, 0.0);
    assert_eq!(t.optimizer_state().unwrap().0, 0);
}
