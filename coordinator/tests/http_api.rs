//! The coordinator's HTTP API in process (http.rs): a real server with HTTP
//! on 127.0.0.1:0, a job trained two steps by a fake worker over the real
//! session protocol, then the status page, `/api/status` and
//! `/api/jobs/{id}/metrics` must show it, and an unknown job is a JSON 404.

mod common;

use std::time::Duration;

use common::{fake_worker, get_parts, loss_2, FakeWorker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_api_shows_jobs_workers_and_step_metrics() {
    let spec = "[job]\nname = \"h\"\nsteps = 2\noutput_dir = \"out\"\n[model]\ninit = \"random\"\n\
                config = \"tiny.json\"\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n\
                [batch]\ndocs_per_step = 4\n";

    let (dir, server, http) = common::start_with_http().await;
    let url = server.url.clone();

    // Before any job: empty lists, and the page itself.
    let (status, ctype, body) = get_parts(http, "/api/status").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(ctype, "application/json");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["jobs"], serde_json::json!([]), "{v}");
    let (status, ctype, body) = get_parts(http, "/").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(ctype.starts_with("text/html"), "{ctype}");
    assert!(
        body.contains("id=\"loss-chart\"") && !body.contains("://cdn"),
        "{body}"
    );

    let job = common::submit(&url, dir.path(), spec).await;
    tokio::time::timeout(
        Duration::from_secs(20),
        fake_worker(url, FakeWorker::new(loss_2)),
    )
    .await
    .expect("the fake worker is released when the job completes");

    let (_, _, body) = get_parts(http, "/api/status").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let j = &v["jobs"][0];
    assert_eq!(j["id"], job.as_str(), "{v}");
    assert_eq!(j["name"], "h");
    assert_eq!(j["kind"], "sft");
    assert_eq!(j["state"], "completed");
    assert_eq!(j["step"], 2);
    assert_eq!(j["generation"], 1);
    // The fake worker reports its plans' tokens (56 over both steps of
    // this fixture), as a worker does: the coordinator checks them.
    assert_eq!(j["tokens_seen"], 56);
    assert_eq!(j["last_loss"], 2.0);
    let w = &v["workers"][0];
    assert_eq!(w["hostname"], "fake", "{v}");
    assert!(w["heartbeat_age_s"].as_f64().unwrap() >= 0.0, "{v}");

    let (status, _, body) = get_parts(http, &format!("/api/jobs/{job}/metrics")).await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    let steps: Vec<u64> = m["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2], "{m}");
    assert_eq!(m["steps"][0]["loss"], 2.0);
    assert_eq!(m["more"], false);
    let (_, _, body) = get_parts(http, &format!("/api/jobs/{job}/metrics?since=1")).await;
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(m["steps"].as_array().unwrap().len(), 1, "{m}");
    assert_eq!(m["steps"][0]["step"], 2);

    let (status, ctype, body) = get_parts(http, "/api/jobs/nope/metrics").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    assert_eq!(ctype, "application/json");
    assert_eq!(body, r#"{"error":"job nope not found"}"#);
    let (status, _, _) = get_parts(http, &format!("/api/jobs/{job}/metrics?since=x")).await;
    assert_eq!(status, "HTTP/1.1 400 Bad Request");
    server.stop.cancel();
    server.task.await.unwrap().unwrap();
}
