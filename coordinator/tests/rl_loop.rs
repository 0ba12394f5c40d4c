//! The RL loop in process (issue 17): the real server on 127.0.0.1:0
//! generating its own rollouts through fake workers that answer
//! `GeneratePlan` over the real session protocol; completions decoded,
//! scored by the exact-match verifier, trained as a stream. A generator
//! lost mid-round loses no prompt and counts no rollout twice.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use common::{fake_worker, start, FakeWorker};

/// 6 prompts whose right answer is "0": the fake workers answer sample k
/// with "k", so in every group of 2 one rollout is right (reward 1).
fn write_prompts(dir: &Path) {
    let rows: String = (0..6)
        .map(|i| format!("{{\"prompt\": \"{i}*0=\", \"answer\": \"0\"}}\n"))
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows).unwrap();
    std::fs::write(dir.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
}

fn spec(steps: u64, min_workers: u32) -> String {
    format!(
        "[job]\nname = \"loop\"\nsteps = {steps}\noutput_dir = \"out\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"prompts.jsonl\"]\nmax_tokens = 256\n\
         [batch]\ndocs_per_step = 4\n[objective]\nkind = \"pg\"\n\
         [parallel]\nmin_workers = {min_workers}\nmax_workers = 2\n\
         [rl]\ngroup_size = 2\n[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 8\n\
         [rl.verifier]\nkind = \"exact\"\n"
    )
}

fn sums(_: &accrue_coordinator::wire::StepPlan) -> accrue_coordinator::wire::MetricSums {
    accrue_coordinator::wire::MetricSums {
        loss_sum: 2.0,
        loss_tokens: 2,
        tokens: 8,
        microbatches: 1,
        ..Default::default()
    }
}

/// The step lines of the job's metrics.jsonl.
fn steps(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("step").is_some() && v.get("loss").is_some())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_generates_scores_and_trains_with_a_generator_lost_mid_round() {
    let dir = tempfile::tempdir().unwrap();
    write_prompts(dir.path());
    let s = start(&dir.path().join("state")).await;
    // Two generators; b dies on round 1 (before answering it).
    let mut b = FakeWorker::new(sums);
    b.die_at_round = Some(1);
    let wb = tokio::spawn(fake_worker(s.url.clone(), b));
    let wa = tokio::spawn(fake_worker(s.url.clone(), FakeWorker::new(sums)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _job = common::submit(&s.url, dir.path(), &spec(6, 1)).await;

    let a_docs = tokio::time::timeout(Duration::from_secs(60), wa)
        .await
        .expect("the job completes and releases its worker")
        .unwrap();
    let b_docs = wb.await.unwrap();
    let steps = steps(dir.path());
    assert_eq!(steps.len(), 6, "{steps:?}");
    for m in &steps {
        assert_eq!(m["docs"], 4, "{m}");
        assert_eq!(m["generation"], 2, "b was lost in the first round: {m}");
        assert_eq!(m["extra"]["rl/reward_mean"], 0.5, "{m}");
        assert_eq!(m["extra"]["rl/accuracy"], 0.5, "{m}");
        assert_eq!(m["extra"]["rl/response_tokens_mean"], 2.0, "{m}");
    }
    // Every rollout trained once (b trained nothing, or steps replanned
    // only after it was lost).
    let all: Vec<&String> = a_docs.iter().chain(&b_docs).collect();
    let unique: BTreeSet<&&String> = all.iter().collect();
    assert_eq!(
        b_docs.len(),
        0,
        "b died in the first round, before any step"
    );
    assert_eq!((all.len(), unique.len()), (24, 24), "{all:?}");
    s.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generating_spec_is_checked_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    write_prompts(dir.path());
    std::fs::write(
        dir.path().join("prompts.jsonl"),
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"no answer\"}\n",
    )
    .unwrap();
    let s = start(&dir.path().join("state")).await;
    let mut admin = accrue_coordinator::wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    let submit = |spec: String| accrue_coordinator::wire::SubmitJobRequest {
        spec_toml: spec,
        base_dir: dir.path().display().to_string(),
        new_job: false,
    };
    let e = admin.submit_job(submit(spec(2, 1))).await.unwrap_err();
    assert!(
        e.message().contains("prompts.jsonl:2") && e.message().contains("reference answer"),
        "{e}"
    );
    let no_verifier = spec(2, 1).replace("[rl.verifier]\nkind = \"exact\"\n", "");
    let e = admin.submit_job(submit(no_verifier)).await.unwrap_err();
    assert!(e.message().contains("rl.verifier"), "{e}");
    s.stop.cancel();
}

/// Episodes against an environment program through the real server
/// (issue 36): the program's reward is each episode's, and the program
/// ends with its job (its process group killed when the job's terminal
/// state is written), not when the coordinator exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_program_scores_episodes_and_ends_with_its_job() {
    let dir = tempfile::tempdir().unwrap();
    write_prompts(dir.path());
    std::fs::write(
        dir.path().join("env.py"),
        r#"import json, os, sys
open("env.pid", "w").write(str(os.getpid()))
for line in sys.stdin:
    m = json.loads(line)
    if m["type"] == "step":
        ok = m["content"].strip() == "0"
        print(json.dumps({"episode": m["episode"], "done": True, "reward": 1.0 if ok else 0.25, "correct": ok}), flush=True)
"#,
    )
    .unwrap();
    let s = start(&dir.path().join("state")).await;
    let wa = tokio::spawn(fake_worker(s.url.clone(), FakeWorker::new(sums)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let spec = spec(2, 1).replace(
        "[rl.verifier]",
        "[rl.env]\nkind = \"command\"\ncommand = [\"python3\", \"env.py\"]\n[rl.verifier]",
    );
    let job = common::submit(&s.url, dir.path(), &spec).await;
    tokio::time::timeout(Duration::from_secs(60), wa)
        .await
        .expect("the job completes and releases its worker")
        .unwrap();
    let mut admin = accrue_coordinator::wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    let rec = admin
        .get_job(accrue_coordinator::wire::GetJobRequest { job_id: job })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(
        rec.state,
        accrue_coordinator::wire::JobState::Completed as i32,
        "{}",
        rec.reason
    );
    let steps = steps(dir.path());
    assert_eq!(steps.len(), 2, "{steps:?}");
    for m in &steps {
        // The program's rewards (1 and 0.25), not the verifier's (1, 0).
        assert_eq!(m["extra"]["rl/reward_mean"], 0.625, "{m}");
        assert_eq!(m["extra"]["rl/turns_mean"], 1.0, "{m}");
    }
    let pid = std::fs::read_to_string(dir.path().join("env.pid")).unwrap();
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while proc_dir.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !proc_dir.exists(),
        "the environment program {pid} outlived its job"
    );
    s.stop.cancel();
}
