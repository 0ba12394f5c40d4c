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
