//! bfloat16 training: a step runs with finite loss close to the float32
//! one on the same model and tokens, and a bf16 checkpoint says so in its
//! config.json and restores to the same parameters.

mod common;

use accrue_worker::batch::PackedBatch;
use accrue_worker::train::{Checkpointing, ReplicatedTrainer, Trainer};

fn batch() -> PackedBatch {
    let docs: Vec<(Vec<i64>, Vec<i64>)> = [(19usize, 3usize), (7, 0), (30, 8)]
        .iter()
        .enumerate()
        .map(|(k, &(n, masked))| {
            let ids: Vec<i64> = (0..n).map(|i| ((i * 37 + k * 11) % 300) as i64).collect();
            let mut labels = ids.clone();
            labels[..masked].fill(-100);
            (ids, labels)
        })
        .collect();
    common::batch(&docs)
}

#[test]
fn a_bf16_step_tracks_fp32_and_its_checkpoint_restores() {
    tch::set_num_threads(2);
    let dir = tempfile::tempdir().unwrap();
    common::make_reference(dir.path(), "llama");
    let model = dir.path().join("model");
    let b = batch();
    let total = b.loss_tokens();
    let run = |dtype: &str| {
        let cfg = common::job_config(
            model.to_str().unwrap(),
            &format!("dtype = \"{dtype}\"\n[optimizer]\neps = 1e-6\n"),
        );
        let mut t = ReplicatedTrainer::single(&cfg, None).unwrap();
        let s = t.microbatch(0, &b, total).unwrap();
        let norm = t.optimizer_step(1e-3).unwrap().grad_norm;
        (t, s.loss_sum / total as f64, norm)
    };
    let (_, loss32, norm32) = run("float32");
    let (mut t16, loss16, norm16) = run("bfloat16");
    println!("loss fp32 {loss32} bf16 {loss16}; grad norm fp32 {norm32} bf16 {norm16}");
    assert!(loss16.is_finite() && norm16.is_finite());
    assert!(
        (loss16 - loss32).abs() <= 0.02 * loss32,
        "{loss16} vs {loss32}"
    );
    assert!(
        (norm16 - norm32).abs() <= 0.05 * norm32,
        "{norm16} vs {norm32}"
    );

    let ck = dir.path().join("ck");
    t16.save_checkpoint(&ck).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let cfg = common::job_config(
        model.to_str().unwrap(),
        "dtype = \"bfloat16\"\n[optimizer]\neps = 1e-6\n",
    );
    let back = ReplicatedTrainer::single(&cfg, Some(&ck)).unwrap();
    let (a, b) = (t16.named_parameters(), back.named_parameters());
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(ta.kind(), tch::Kind::BFloat16, "{na}");
        assert!(ta.equal(tb), "{na} changed across save/restore");
    }
}
