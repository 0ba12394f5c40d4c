//! The Prometheus endpoint, in process: a real server with metrics on
//! 127.0.0.1:0, a job trained two steps by a fake worker over the real
//! session protocol, then `GET /metrics` must show the committed steps.

use std::net::SocketAddr;
use std::time::Duration;

use accrue_coordinator::server::{Server, ServerConfig};
use accrue_coordinator::wire;
use accrue_coordinator::wire::coordinator_message::Msg as In;
use accrue_coordinator::wire::worker_message::Msg as Out;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
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
async fn metrics_endpoint_shows_committed_steps_and_workers() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = String::new();
    for i in 0..8 {
        rows.push_str(&format!(
            "{{\"prompt\": \"{i}+1=\", \"completion\": \"x\"}}\n"
        ));
    }
    std::fs::write(dir.path().join("train.jsonl"), rows).unwrap();
    std::fs::write(dir.path().join("tiny.json"), "{}").unwrap();
    let spec = "[job]\nname = \"m\"\nsteps = 2\noutput_dir = \"out\"\n[model]\ninit = \"random\"\n\
                config = \"tiny.json\"\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n\
                [batch]\ndocs_per_step = 4\n";

    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = Server::bind(cfg).await.unwrap();
    let metrics = server.metrics_addr().expect("metrics are served");
    let url = format!("http://{}", server.local_addr());
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(stop.clone()));

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

    let text = get(metrics, "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    for line in [
        format!("accrue_steps_committed_total{{job=\"{job}\"}} 2"),
        format!("accrue_loss{{job=\"{job}\"}} 2"),
        format!("accrue_job_generation{{job=\"{job}\"}} 1"),
        "accrue_workers{state=\"active\"} 0".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from:\n{text}"
        );
    }
    // The released worker is idle or, once its session closed, lost: one in all.
    let workers: i64 = text
        .lines()
        .filter(|l| l.starts_with("accrue_workers{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(workers, 1, "{text}");
    for name in ["accrue_step_time_seconds", "accrue_tokens_per_second"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{name}{{job=\"{job}\"}} "))),
            "{name} missing from:\n{text}"
        );
    }
    assert!(get(metrics, "/nope").await.starts_with("HTTP/1.1 404"));
    stop.cancel();
    task.await.unwrap().unwrap();
}
