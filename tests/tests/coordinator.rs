//! End-to-end tests of the coordinator and CLI as real processes, with fake
//! workers speaking the real session protocol.

mod common;

use common::*;

#[test]
fn validate_prints_every_problem_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_job(dir.path(), "good", "epochs = 1");
    let ok = accrue(
        "http://127.0.0.1:1",
        &["validate", good.to_str().unwrap()],
        dir.path(),
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    let text = std::fs::read_to_string(&good)
        .unwrap()
        .replace("epochs = 1", "epochs = 1\nsteps = 5")
        .replace("docs_per_step = 8", "docs_per_step = 0")
        .replace("train.jsonl", "missing.jsonl")
        .replace("[checkpoint]", "[optimizer]\nlr = -1.0\n[checkpoint]");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, text).unwrap();
    let out = accrue(
        "http://127.0.0.1:1",
        &["validate", bad.to_str().unwrap()],
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    let printed = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    for field in [
        "job.steps",
        "batch.docs_per_step",
        "data.train[0]",
        "optimizer.lr",
    ] {
        assert!(printed.contains(field), "{field} missing from:\n{printed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_worker_trains_a_job_to_completion() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_job(dir.path(), "echo", "epochs = 1");
    let coord = Coordinator::start(&dir.path().join("state"));
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job = stdout(&out).trim().to_string();
    assert_eq!(job.len(), 36, "a uuid job id: {job:?}");

    let report = fake_worker(coord.url.clone(), None).await.unwrap();
    assert!(
        report.released,
        "the worker is released when the job completes"
    );
    assert_eq!(
        report.steps,
        vec![1, 2, 3, 4, 5],
        "40 documents at 8 per step"
    );
    assert_eq!(report.checkpoints, vec![2, 4, 5]);
    let mut docs: Vec<&str> = report.docs.iter().map(|(_, d)| d.as_str()).collect();
    docs.sort_unstable();
    docs.dedup();
    assert_eq!(docs.len(), 40, "every document trained, none twice");
    assert_eq!(report.docs.len(), 40);

    let watch = accrue(
        &coord.url,
        &["watch", &job, "--from-step", "1", "--json"],
        dir.path(),
    );
    assert!(
        watch.status.success(),
        "watch of a completed job exits 0: {}",
        stdout(&watch)
    );

    let metrics = std::fs::read_to_string(dir.path().join("out/echo/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, m) in lines.iter().enumerate() {
        assert_eq!(m["step"], i as u64 + 1);
        assert_eq!(m["docs"], 8);
        assert!(
            (m["loss"].as_f64().unwrap() - 1.5).abs() < 1e-9,
            "Σℓ/T from the fake sums"
        );
        for key in [
            "tokens",
            "microbatches",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "step_time_s",
        ] {
            assert!(m.get(key).is_some(), "metrics.jsonl lacks {key}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_coordinator_lists_the_same_jobs_and_cursors() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let spec_a = write_job(dir.path(), "a", "steps = 100");
    let spec_b = write_job(dir.path(), "b", "steps = 2");
    let coord = Coordinator::start(&state);
    let url = coord.url.clone();
    let submit = |spec: &std::path::Path| {
        let out = accrue(&url, &["submit", spec.to_str().unwrap()], dir.path());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout(&out).trim().to_string()
    };
    let a = submit(&spec_a);
    // Three steps commit, then the worker goes silent mid-run.
    let report = fake_worker(url.clone(), Some(3)).await.unwrap();
    assert_eq!(report.steps, vec![1, 2, 3]);
    let before_docs = report.docs.clone();
    let b = submit(&spec_b);
    let before = wait_for_jobs(&url, dir.path(), 10, |v| {
        v.as_array().is_some_and(|a| a.len() == 2) && v[0]["step"] == 3
    });

    coord.kill();
    let again = Coordinator::start(&state);
    let after = wait_for_jobs(&again.url, dir.path(), 10, |v| {
        v.as_array().is_some_and(|a| a.len() == 2)
    });
    for (x, y) in before
        .as_array()
        .unwrap()
        .iter()
        .zip(after.as_array().unwrap())
    {
        assert_eq!(x["job_id"], y["job_id"]);
        assert_eq!(x["step"], y["step"]);
        assert_eq!(
            x["cursor"], y["cursor"],
            "the data cursor survives a kill -9"
        );
    }
    let ids: Vec<&str> = after
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![a.as_str(), b.as_str()]);
    assert_eq!(
        after[0]["state"], "pending",
        "no workers yet after the restart"
    );

    // Job a waits briefly for its old member (it may hold the state in
    // memory), so job b takes the first fresh worker and completes.
    let report = fake_worker(again.url.clone(), None).await.unwrap();
    assert_eq!(report.steps, vec![1, 2]);
    assert!(report.released);
    // The next fresh worker holds no state: it restores job a's checkpoint
    // of step 2, replays step 3 (the same documents as its manifest), then
    // trains 4 and 5.
    let report = fake_worker(again.url.clone(), Some(3)).await.unwrap();
    assert_eq!(report.steps, vec![3, 4, 5]);
    assert_eq!(report.replayed, vec![3]);
    let first: Vec<&String> = before_docs
        .iter()
        .filter(|(s, _)| *s == 3)
        .map(|(_, d)| d)
        .collect();
    let replayed: Vec<&String> = report
        .docs
        .iter()
        .filter(|(s, _)| *s == 3)
        .map(|(_, d)| d)
        .collect();
    assert_eq!(replayed, first, "a replay trains the committed documents");
}

/// A job that never checkpoints keeps only its newest steps' documents in
/// memory (issue 19, bounded state): after a restart a fresh worker
/// restores from init and replays every committed step, the oldest read
/// back from the store as the replay reaches them, each with the documents
/// it was trained on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_longer_than_the_history_kept_in_memory_trains_every_step_again() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let spec = write_job(dir.path(), "long", "steps = 120");
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(&spec, text.replace("every_steps = 2", "every_steps = 0")).unwrap();
    let coord = Coordinator::start(&state);
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let committed = 80u64;
    let report = fake_worker(coord.url.clone(), Some(committed as usize))
        .await
        .unwrap();
    assert_eq!(report.steps, (1..=committed).collect::<Vec<_>>());
    wait_for_jobs(&coord.url, dir.path(), 20, |v| v[0]["step"] == committed);
    coord.kill();
    let again = Coordinator::start(&state);
    let report2 = fake_worker(again.url.clone(), Some(committed as usize + 2))
        .await
        .unwrap();
    assert_eq!(report2.replayed, (1..=committed).collect::<Vec<_>>());
    assert_eq!(report2.steps.last(), Some(&(committed + 2)));
    let docs_of = |r: &FakeReport, step: u64| -> Vec<String> {
        r.docs
            .iter()
            .filter(|(s, _)| *s == step)
            .map(|(_, d)| d.clone())
            .collect()
    };
    for step in 1..=committed {
        let (first, again) = (docs_of(&report, step), docs_of(&report2, step));
        assert!(!first.is_empty());
        assert_eq!(again, first, "step {step} replayed with its own documents");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let coord = Coordinator::start(&dir.path().join("state"));
    let out = accrue(&coord.url, &["status", "no-such-job"], dir.path());
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-job"));

    // A spec whose dataset has a malformed line: the error names file:line.
    let spec = write_job(dir.path(), "broken", "epochs = 1");
    let mut data = std::fs::read_to_string(dir.path().join("train.jsonl")).unwrap();
    data.push_str("{\"prompt\": \"1+1=\", \"completion\": \n");
    std::fs::write(dir.path().join("train.jsonl"), data).unwrap();
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir.path());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train.jsonl:41"), "{err}");
    let jobs = accrue(&coord.url, &["jobs", "--json"], dir.path());
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&jobs.stdout).unwrap(),
        serde_json::json!([])
    );
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `accrue validate` (offline) and `accrue submit` (to `url`) of `spec`:
/// both must exit 1 with `want` in their error output.
fn refused_by_validate_and_submit(url: &str, dir: &std::path::Path, spec: &str, want: &str) {
    let out = accrue("http://127.0.0.1:1", &["validate", spec], dir);
    assert_eq!(out.status.code(), Some(1), "validate: {}", stdout(&out));
    assert!(stderr(&out).contains(want), "validate: {}", stderr(&out));
    let out = accrue(url, &["submit", spec], dir);
    assert_eq!(out.status.code(), Some(1), "submit: {}", stdout(&out));
    assert!(stderr(&out).contains(want), "submit: {}", stderr(&out));
}

/// Issue 14 item 1: a model whose vocab_size (100) cannot hold the byte
/// tokenizer's 259 ids passed validate and submit; the worker's trainer
/// then panicked in the embedding and the job hung at step 0.
#[test]
fn a_model_vocab_below_the_tokenizers_ids_is_refused_by_validate_and_submit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = write_job(d, "small-vocab", "epochs = 1");
    let config = std::fs::read_to_string(d.join("tiny.json")).unwrap();
    std::fs::write(
        d.join("tiny.json"),
        config.replace("\"vocab_size\":320", "\"vocab_size\":100"),
    )
    .unwrap();
    let coord = Coordinator::start(&d.join("state"));
    let want = format!(
        "model.config: vocab_size = 100 in {} cannot hold the byte tokenizer's 259 token ids",
        d.join("tiny.json").display()
    );
    refused_by_validate_and_submit(&coord.url, d, spec.to_str().unwrap(), &want);
}

/// Issue 14 item 8: pre-tokenized ids were bounded by the tokenizer's
/// vocabulary (259 under the byte tokenizer), not the model's (320 here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pretokenized_ids_up_to_the_models_vocab_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = write_job(d, "ids", "epochs = 1");
    let rows: String = (0..8)
        .map(|i| format!("{{\"input_ids\": [1, {}, 319, 5]}}\n", 260 + i))
        .collect();
    std::fs::write(d.join("train.jsonl"), rows).unwrap();
    let coord = Coordinator::start(&d.join("state"));
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], d);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = fake_worker(coord.url.clone(), None).await.unwrap();
    assert_eq!(report.steps, vec![1], "8 documents at 8 per step");
    assert!(report.released);

    // An id at the model's vocab_size is refused, naming the row.
    std::fs::write(d.join("train.jsonl"), "{\"input_ids\": [1, 320]}\n").unwrap();
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains(
            "train.jsonl:1: \"input_ids\"[1] = 320 is not below the model's vocab_size 320"
        ),
        "{}",
        stderr(&out)
    );
}

/// Issue 14 item 2: `batch.docs_per_step = 1000000000` was accepted by
/// validate, submit and `accrue set`; the coordinator then grew until the
/// kernel killed it.
#[test]
fn a_billion_docs_per_step_is_refused_by_validate_submit_and_set() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = Coordinator::start(&d.join("state"));
    let spec = write_job(d, "huge", "steps = 100");
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(
        &spec,
        text.replace("docs_per_step = 8", "docs_per_step = 1000000000"),
    )
    .unwrap();
    let want =
        "batch.docs_per_step: 1000000000 is more than the limit of 1048576 documents per step";
    refused_by_validate_and_submit(&coord.url, d, spec.to_str().unwrap(), want);
    // More documents than the dataset holds (40) would train one twice.
    std::fs::write(
        &spec,
        text.replace("docs_per_step = 8", "docs_per_step = 41"),
    )
    .unwrap();
    refused_by_validate_and_submit(
        &coord.url,
        d,
        spec.to_str().unwrap(),
        "batch.docs_per_step: 41 is more than the 40 documents in data.train",
    );

    std::fs::write(&spec, &text).unwrap();
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], d);
    assert!(out.status.success(), "{}", stderr(&out));
    let job = stdout(&out).trim().to_string();
    for (n, want) in [
        ("1000000000", want),
        (
            "41",
            "batch.docs_per_step: 41 is more than the 40 documents",
        ),
    ] {
        let out = accrue(&coord.url, &["set", &job, "--docs-per-step", n], d);
        assert_eq!(out.status.code(), Some(1), "set {n}: {}", stdout(&out));
        assert!(stderr(&out).contains(want), "set {n}: {}", stderr(&out));
    }
    let out = accrue(&coord.url, &["set", &job, "--docs-per-step", "40"], d);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Issue 14 item 6: `job.output_dir = ""` became the submit directory.
#[test]
fn an_empty_output_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = Coordinator::start(&d.join("state"));
    let spec = write_job(d, "nowhere", "epochs = 1");
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(
        &spec,
        text.replace("output_dir = \"out/nowhere\"", "output_dir = \"\""),
    )
    .unwrap();
    refused_by_validate_and_submit(
        &coord.url,
        d,
        spec.to_str().unwrap(),
        "job.output_dir: must not be empty",
    );
}

/// Issue 14 item 7: `accrue steps JOB --detail --json | head -1` panicked
/// ("failed printing to stdout: Broken pipe"). Now every command whose
/// reader has gone exits quietly with 141 (128 + SIGPIPE, what a shell
/// reports for `yes | head -1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_to_a_closed_pipe_exits_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = write_job(d, "pipe", "epochs = 1");
    let coord = Coordinator::start(&d.join("state"));
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], d);
    assert!(out.status.success(), "{}", stderr(&out));
    let job = stdout(&out).trim().to_string();
    fake_worker(coord.url.clone(), None).await.unwrap();
    let spec_path = spec.to_str().unwrap();
    for args in [
        &["steps", &job, "--detail", "--json"][..],
        &["steps", &job],
        &["jobs", "--json"],
        &["status", &job],
        &["watch", &job, "--from-step", "1", "--json"],
        &["validate", spec_path],
    ] {
        // A pipe whose reader is closed before the command starts: its
        // first write fails with EPIPE, whatever the timing.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = std::process::Command::new(bin_dir().join("accrue"))
            .args(["--coordinator", &coord.url])
            .args(args)
            .current_dir(d)
            .stdout(writer)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(141), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?}");
    }
}

/// Issue 14 item 10: a corrupt `model.init` checkpoint was named only in
/// the worker's log; the job said "no state to recover". Submit now
/// refuses it naming the file and what is wrong.
#[test]
fn a_corrupt_model_init_checkpoint_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = Coordinator::start(&d.join("state"));
    write_job(d, "unused", "epochs = 1");
    let ckpt = d.join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    std::fs::copy(d.join("tiny.json"), ckpt.join("config.json")).unwrap();
    std::fs::write(
        ckpt.join("manifest.json"),
        r#"{"job":"j","step":2,"cursor":{"epoch":0,"position":16,"overflow":[]},"world_size":1,"generation":1}"#,
    )
    .unwrap();
    let weights = ckpt.join("model.safetensors");
    std::fs::write(&weights, b"this is not a model").unwrap();
    let spec = d.join("resume.toml");
    let text = std::fs::read_to_string(d.join("unused.toml"))
        .unwrap()
        .replace(
            "init = \"random\"\nconfig = \"tiny.json\"",
            "init = \"ckpt\"",
        )
        .replace("name = \"unused\"", "name = \"resume\"");
    std::fs::write(&spec, text).unwrap();
    let want = format!("model.init: {}: not a safetensors file", weights.display());
    refused_by_validate_and_submit(&coord.url, d, spec.to_str().unwrap(), &want);
}
