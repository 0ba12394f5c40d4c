//! The RL loop with the real coordinator binary (issue 17): prompts in, the
//! coordinator plans generation rounds for its workers (here fake
//! generators speaking the real protocol), scores the completions with the
//! exact-match verifier and trains on them. A generator that dies in the
//! middle of a round loses no prompt and no rollout is trained twice.

mod common;

use std::collections::BTreeSet;

use common::*;

/// 8 prompts whose answer is "0" (sample 0 of a fake generator is right,
/// sample 1 wrong) and a 6-step generating job over them, groups of 2,
/// 4 rollouts a step, with these `[parallel]` and extra `[rl]` lines.
fn loop_job(dir: &std::path::Path, name: &str, parallel: &str, rl: &str) -> std::path::PathBuf {
    let rows: String = (0..8)
        .map(|i| format!("{{\"question\": \"{i} times 0?\", \"answer\": \"#### 0\"}}\n"))
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows).unwrap();
    std::fs::write(dir.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
    let spec = dir.join("loop.toml");
    std::fs::write(
        &spec,
        format!(
            "[job]\nname = \"{name}\"\nsteps = 6\noutput_dir = \"out\"\n\
             [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
             [data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"prompts.jsonl\"]\nmax_tokens = 256\n\
             [batch]\ndocs_per_step = 4\n[objective]\nkind = \"pg\"\n\
             [parallel]\n{parallel}\n\
             [rl]\ngroup_size = 2\n{rl}[rl.sampling]\nmax_new_tokens = 8\n\
             [rl.verifier]\nkind = \"gsm8k\"\n"
        ),
    )
    .unwrap();
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generator_killed_mid_round_loses_no_prompt_and_counts_no_rollout_twice() {
    let dir = tempfile::tempdir().unwrap();
    let spec = loop_job(dir.path(), "loop", "min_workers = 1\nmax_workers = 2", "");
    let coord = Coordinator::start(&dir.path().join("state"));
    // Both generators are in the first generation; b dies on round 2.
    let a = tokio::spawn(fake_generator(coord.url.clone(), None, None));
    let b = tokio::spawn(fake_generator(coord.url.clone(), None, Some(2)));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let a = a.await.unwrap().unwrap();
    let b = b.await.unwrap().unwrap();
    assert!(a.released, "the job completes");
    assert_eq!(b.rounds, [1], "b answered round 1, died on round 2");
    // Each rollout (its stream id) trained once, by whichever rank had it.
    let trained: Vec<&String> = a.docs.iter().chain(&b.docs).map(|(_, d)| d).collect();
    let unique: BTreeSet<&&String> = trained.iter().collect();
    assert_eq!((trained.len(), unique.len()), (24, 24), "{trained:?}");
    let metrics = std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 6);
    for m in &steps {
        assert_eq!(m["docs"], 4, "{m}");
        assert_eq!(m["extra"]["rl/accuracy"], 0.5, "{m}");
    }
    // 6 steps × 2 prompts = 12 prompt uses of 8 prompts: every prompt
    // once in epoch 0, then 4 of epoch 1 — read back from the groups the
    // coordinator logged in the rollout store is not exposed, so count the
    // steps' cursor instead: the stream head moved by 2 groups a step.
    let heads: Vec<u64> = steps
        .iter()
        .map(|m| m["cursor"]["position"].as_u64().unwrap())
        .collect();
    assert_eq!(heads, [2, 4, 6, 8, 10, 12]);
}

/// Disaggregated (`rl.generators = 1`) with the real coordinator binary:
/// of three workers one generates and two train; the generator dies on
/// its second round; the generation re-forms with one trainer and a new
/// generator (synced before any round), which generates the lost round's
/// prompts again. Every rollout is trained once, by trainers only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_generator_killed_mid_round_loses_no_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let spec = loop_job(
        dir.path(),
        "apart",
        "min_workers = 2\nmax_workers = 3",
        "generators = 1\nmax_staleness = 1\n",
    );
    let coord = Coordinator::start(&dir.path().join("state"));
    // Registered in this order, c (holding nothing, last) generates first.
    let a = tokio::spawn(fake_generator(coord.url.clone(), None, None));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let b = tokio::spawn(fake_generator(coord.url.clone(), None, None));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let c = tokio::spawn(fake_generator(coord.url.clone(), None, Some(2)));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = a.await.unwrap().unwrap();
    let b = b.await.unwrap().unwrap();
    let c = c.await.unwrap().unwrap();
    assert!(a.released && b.released, "the job completes");
    assert_eq!(c.generator_in, [1], "c generated in generation 1");
    assert_eq!(c.rounds, [1], "c answered round 1, died on round 2");
    assert!(c.steps.is_empty(), "a generator trains no step");
    assert_eq!(c.synced.first(), Some(&0), "synced before its first round");
    // Then one of a and b generates (both hold the training state; the
    // other trains alone) and loads the current policy before generating.
    let (trainer, generator) = if b.generator_in.is_empty() {
        (&b, &a)
    } else {
        (&a, &b)
    };
    assert_eq!(
        generator.generator_in.len(),
        1,
        "{:?}",
        generator.generator_in
    );
    assert!(trainer.generator_in.is_empty());
    let synced = &generator.synced;
    assert!(
        !synced.is_empty() && synced.windows(2).all(|w| w[0] < w[1]),
        "{synced:?}"
    );
    let rounds = &generator.rounds;
    assert!(
        !rounds.is_empty() && rounds.iter().all(|&r| r > 2),
        "{rounds:?}"
    );
    assert!(trainer.rounds.is_empty(), "the trainer never generates");
    // A step in flight when c died was aborted and planned again in the
    // new generation: what committed is each step's last generation's plan.
    let plans: Vec<&(u64, u64, String)> = a.plan_docs.iter().chain(&b.plan_docs).collect();
    let last_gen = |step: u64| plans.iter().filter(|p| p.1 == step).map(|p| p.0).max();
    let trained: Vec<&String> = plans
        .iter()
        .filter(|p| last_gen(p.1) == Some(p.0))
        .map(|p| &p.2)
        .collect();
    let unique: BTreeSet<&&String> = trained.iter().collect();
    assert_eq!((trained.len(), unique.len()), (24, 24), "{trained:?}");
    let metrics = std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 6);
    for m in &steps {
        assert_eq!(m["docs"], 4, "{m}");
        assert!(m["extra"]["staleness/max"].as_f64().unwrap() <= 1.0, "{m}");
    }
    let heads: Vec<u64> = steps
        .iter()
        .map(|m| m["cursor"]["position"].as_u64().unwrap())
        .collect();
    assert_eq!(heads, [2, 4, 6, 8, 10, 12]);
}
