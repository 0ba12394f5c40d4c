//! The coordinator's HTTP API in process (http.rs): a real server with HTTP
//! on 127.0.0.1:0, a job trained two steps by a fake worker over the real
//! session protocol, then the status page, `/api/status` and
//! `/api/jobs/{id}/metrics` must show it, and an unknown job is a JSON 404.

use std::net::SocketAddr;
use std::time::Duration;

use accrue_coordinator::server::{Server, ServerConfig};
use accrue_coordinator::wire;
use accrue_coordinator::wire::coordinator_message::Msg as In;
use accrue_coordinator::wire::worker_message::Msg as Out;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// `GET path`: (status line, content type, body).
async fn get(addr: SocketAddr, path: &str) -> (String, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.lines().next().unwrap().to_string();
    let ctype = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or_default()
        .to_string();
    (status, ctype, body.to_string())
}

/// Registers, answers Configure with Ready and each plan with 2.0 loss per token.
async fn fake_worker(url: String) {
    let mut c = wire::worker_service_client::WorkerServiceClient::connect(url)
        .await
        .unwrap();
    let reg = c
        .register(wire::RegisterRequest {
            hostname: "fake".into(),
            device: "cpu".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let msg = |m| wire::WorkerMessage { msg: Some(m) };
    tx.send(msg(Out::Hello(wire::Hello {
        worker_id: reg.worker_id,
    })))
    .await
    .unwrap();
    let mut inbound = c
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    while let Ok(Some(m)) = inbound.message().await {
        let reply = match m.msg {
            Some(In::Configure(c)) => Out::Ready(wire::Ready {
                job_id: c.job_id,
                generation: c.generation,
                step: c.step,
            }),
            Some(In::StepPlan(p)) => Out::StepResult(wire::StepResult {
                job_id: p.job_id,
                generation: p.generation,
                step: p.step,
                rank: p.rank,
                logps: Vec::new(),
                sums: Some(wire::MetricSums {
                    loss_sum: 20.0,
                    loss_tokens: 10,
                    tokens: 12,
                    microbatches: 1,
                    ..Default::default()
                }),
            }),
            Some(In::CheckpointRequest(c)) => Out::CheckpointDone(wire::CheckpointDone {
                job_id: c.job_id,
                step: c.step,
                rank: 0,
                path: c.dir,
            }),
            Some(In::Release(_)) => return,
            _ => continue,
        };
        tx.send(msg(reply)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_api_shows_jobs_workers_and_step_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = String::new();
    for i in 0..8 {
        rows.push_str(&format!(
            "{{\"prompt\": \"{i}+1=\", \"completion\": \"x\"}}\n"
        ));
    }
    std::fs::write(dir.path().join("train.jsonl"), rows).unwrap();
    std::fs::write(dir.path().join("tiny.json"), "{}").unwrap();
    let spec = "[job]\nname = \"h\"\nsteps = 2\noutput_dir = \"out\"\n[model]\ninit = \"random\"\n\
                config = \"tiny.json\"\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n\
                [batch]\ndocs_per_step = 4\n";

    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::bind(cfg).await.unwrap();
    let http = server.metrics_addr().expect("http is served");
    let url = format!("http://{}", server.local_addr());
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(stop.clone()));

    // Before any job: empty lists, and the page itself.
    let (status, ctype, body) = get(http, "/api/status").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(ctype, "application/json");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["jobs"], serde_json::json!([]), "{v}");
    let (status, ctype, body) = get(http, "/").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(ctype.starts_with("text/html"), "{ctype}");
    assert!(
        body.contains("id=\"loss-chart\"") && !body.contains("://cdn"),
        "{body}"
    );

    let mut admin = wire::admin_client::AdminClient::connect(url.clone())
        .await
        .unwrap();
    let job = admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec.into(),
            base_dir: dir.path().display().to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    tokio::time::timeout(Duration::from_secs(20), fake_worker(url))
        .await
        .expect("the fake worker is released when the job completes");

    let (_, _, body) = get(http, "/api/status").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let j = &v["jobs"][0];
    assert_eq!(j["id"], job.as_str(), "{v}");
    assert_eq!(j["name"], "h");
    assert_eq!(j["kind"], "sft");
    assert_eq!(j["state"], "completed");
    assert_eq!(j["step"], 2);
    assert_eq!(j["generation"], 1);
    // The fake worker reports 12 tokens a step and no document count.
    assert_eq!(j["tokens_seen"], 24);
    assert_eq!(j["last_loss"], 2.0);
    let w = &v["workers"][0];
    assert_eq!(w["hostname"], "fake", "{v}");
    assert!(w["heartbeat_age_s"].as_f64().unwrap() >= 0.0, "{v}");

    let (status, _, body) = get(http, &format!("/api/jobs/{job}/metrics")).await;
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
    let (_, _, body) = get(http, &format!("/api/jobs/{job}/metrics?since=1")).await;
    let m: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(m["steps"].as_array().unwrap().len(), 1, "{m}");
    assert_eq!(m["steps"][0]["step"], 2);

    let (status, ctype, body) = get(http, "/api/jobs/nope/metrics").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    assert_eq!(ctype, "application/json");
    assert_eq!(body, r#"{"error":"job nope not found"}"#);
    let (status, _, _) = get(http, &format!("/api/jobs/{job}/metrics?since=x")).await;
    assert_eq!(status, "HTTP/1.1 400 Bad Request");
    stop.cancel();
    task.await.unwrap().unwrap();
}
