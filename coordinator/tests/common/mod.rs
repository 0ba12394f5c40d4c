//! Helpers shared by the in-process integration tests: a real [`Server`] on
//! 127.0.0.1:0, a small SFT fixture, a plain HTTP `GET`, and a fake worker
//! that registers and answers Configure, StepPlan, CheckpointRequest and
//! Release over the real session protocol.

// Each file under tests/ is its own crate and uses only some of these
// helpers; without this, every file would warn about the ones it leaves.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::shell::service::Shared;
use accrue_coordinator::wire;
use accrue_coordinator::wire::coordinator_message::Msg as In;
use accrue_coordinator::wire::worker_message::Msg as Out;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// A server running on a spawned task.
pub struct Running {
    /// `http://` and the gRPC address.
    pub url: String,
    /// The gRPC address.
    pub addr: SocketAddr,
    /// The HTTP (status page, `/metrics`) address, where served.
    pub http: Option<SocketAddr>,
    /// Weak, so that a stopped server releases its state store (a restart
    /// on the same state dir must be able to open it).
    pub shared: Weak<Shared>,
    pub stop: CancellationToken,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// A config for a server on 127.0.0.1:0 keeping its state in `state`.
pub fn config(state: &Path) -> ServerConfig {
    ServerConfig::new("127.0.0.1:0".parse().unwrap(), state.to_path_buf())
}

/// Binds `cfg` and runs the server until `stop` is cancelled.
pub async fn start_with(cfg: ServerConfig) -> Running {
    let server = Server::bind(cfg).await.unwrap();
    let addr = server.local_addr();
    let http = server.metrics_addr();
    let shared = Arc::downgrade(&server.shared());
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(stop.clone()));
    Running {
        url: format!("http://{addr}"),
        addr,
        http,
        shared,
        stop,
        task,
    }
}

/// A server with the default config, state in `state`.
pub async fn start(state: &Path) -> Running {
    start_with(config(state)).await
}

/// A server serving HTTP too, and a directory holding 8 SFT rows
/// (completion "x") and `tiny.json`; returns the HTTP address.
pub async fn start_with_http() -> (tempfile::TempDir, Running, SocketAddr) {
    let dir = tempfile::tempdir().unwrap();
    write_sft_fixture(dir.path(), 8, |_| "x".to_string());
    let mut cfg = config(&dir.path().join("state"));
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let s = start_with(cfg).await;
    let http = s.http.expect("http is served");
    (dir, s, http)
}

/// Writes `train.jsonl` with `rows` rows `{i}+1=` → `completion(i)`, and a
/// model config `tiny.json` (only its vocab_size is read here).
pub fn write_sft_fixture(dir: &Path, rows: usize, completion: impl Fn(usize) -> String) {
    let rows: String = (0..rows)
        .map(|i| {
            format!(
                "{{\"prompt\": \"{i}+1=\", \"completion\": \"{}\"}}\n",
                completion(i)
            )
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), rows).unwrap();
    std::fs::write(dir.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
}

/// Submits `spec` with `dir` as its base; returns the job id.
pub async fn submit(url: &str, dir: &Path, spec: &str) -> String {
    let mut admin = wire::admin_client::AdminClient::connect(url.to_string())
        .await
        .unwrap();
    admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec.into(),
            base_dir: dir.display().to_string(),
            new_job: false,
        })
        .await
        .unwrap()
        .into_inner()
        .job_id
}

/// `GET path` on a fresh connection: the whole response, head and body.
pub async fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// `GET path`: (status line, content type, body).
pub async fn get_parts(addr: SocketAddr, path: &str) -> (String, String, String) {
    let out = get(addr, path).await;
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.lines().next().unwrap().to_string();
    let ctype = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or_default()
        .to_string();
    (status, ctype, body.to_string())
}

/// Awaited before a plan is answered; the session waits with it.
pub type PlanHook =
    Box<dyn FnMut(&wire::StepPlan) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// What a fake worker reports and does besides answering.
pub struct FakeWorker {
    pub hostname: &'static str,
    pub collective_addr: &'static str,
    /// The sums reported for a plan.
    pub sums: fn(&wire::StepPlan) -> wire::MetricSums,
    /// Close the session on the plan of this step (the worker is lost).
    pub die_at: Option<u64>,
    /// Hold the result of this step until the gate opens (other messages,
    /// checkpoint requests, are still answered meanwhile).
    pub hold: Option<(u64, oneshot::Receiver<()>)>,
    /// Run on each plan before it is answered.
    pub before_plan: Option<PlanHook>,
    /// Close the session on the generation round of this number.
    pub die_at_round: Option<u64>,
}

impl FakeWorker {
    /// Host "fake", no collective address, `sums` for every plan, no faults.
    pub fn new(sums: fn(&wire::StepPlan) -> wire::MetricSums) -> FakeWorker {
        FakeWorker {
            hostname: "fake",
            collective_addr: "",
            sums,
            die_at: None,
            hold: None,
            before_plan: None,
            die_at_round: None,
        }
    }
}

/// 2.0 loss per token: 20 over 10 loss tokens, 12 tokens, one microbatch.
pub fn loss_2(_: &wire::StepPlan) -> wire::MetricSums {
    wire::MetricSums {
        loss_sum: 20.0,
        loss_tokens: 10,
        tokens: 12,
        microbatches: 1,
        ..Default::default()
    }
}

/// `sums` with the counts a real worker reports for plan `p` (its
/// microbatches, tokens, documents and loss tokens, the loss per token
/// kept): the coordinator refuses a result that disagrees with its plan.
pub fn counted(sums: wire::MetricSums, p: &wire::StepPlan) -> wire::MetricSums {
    let mbs = &p.microbatches;
    // Per sequence, the labels after its first that are not ignored.
    let loss_tokens: u64 = mbs
        .iter()
        .flat_map(|m| {
            let ids = accrue_proto::unpack_u32(&m.token_ids).unwrap();
            let labels = accrue_proto::microbatch_labels(&ids, &m.labels, &m.loss_mask).unwrap();
            m.cu_seq_lens
                .windows(2)
                .map(|w| {
                    let seq = &labels[w[0] as usize..w[1] as usize];
                    seq.iter().skip(1).filter(|&&l| l != -100).count() as u64
                })
                .collect::<Vec<_>>()
        })
        .sum();
    // The fake's loss per token is kept over the plan's loss tokens.
    let per_token = sums.loss_sum / sums.loss_tokens.max(1) as f64;
    wire::MetricSums {
        loss_tokens,
        loss_sum: per_token * loss_tokens as f64,
        microbatches: mbs.len() as u32,
        tokens: mbs.iter().map(|m| m.token_ids.len() as u64 / 4).sum(),
        documents: mbs
            .iter()
            .flat_map(|m| &m.sequences)
            .filter(|q| q.role == 0)
            .count() as u64,
        ..sums
    }
}

/// Registers, answers Configure with Ready, each plan with a result of
/// `w.sums`, acknowledges checkpoints; returns the doc ids of every sequence
/// it was planned when released (or lost).
pub async fn fake_worker(url: String, mut w: FakeWorker) -> Vec<String> {
    let mut c = wire::worker_service_client::WorkerServiceClient::connect(url)
        .await
        .unwrap();
    let reg = c
        .register(wire::RegisterRequest {
            hostname: w.hostname.into(),
            device: "cpu".into(),
            collective_addr: w.collective_addr.into(),
            protocol: accrue_proto::PROTOCOL,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
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
    let mut docs = Vec::new();
    while let Ok(Some(m)) = inbound.message().await {
        let reply = match m.msg {
            Some(In::Configure(c)) => Out::Ready(wire::Ready {
                job_id: c.job_id,
                generation: c.generation,
                step: c.step,
            }),
            Some(In::StepPlan(p)) if w.die_at == Some(p.step) => return docs,
            Some(In::StepPlan(p)) => {
                if let Some(hook) = w.before_plan.as_mut() {
                    hook(&p).await;
                }
                let seqs = p.microbatches.iter().flat_map(|m| &m.sequences);
                docs.extend(seqs.map(accrue_proto::doc_label));
                let result = Out::StepResult(wire::StepResult {
                    sums: Some(counted((w.sums)(&p), &p)),
                    job_id: p.job_id,
                    generation: p.generation,
                    step: p.step,
                    rank: p.rank,
                    logps: Vec::new(),
                    nonfinite_microbatches: Vec::new(),
                });
                match w.hold.take() {
                    Some((step, gate)) if step == p.step => {
                        let tx = tx.clone();
                        tokio::spawn(async move {
                            let _ = gate.await;
                            let _ = tx.send(msg(result)).await;
                        });
                        continue;
                    }
                    other => w.hold = other,
                }
                result
            }
            Some(In::GeneratePlan(g)) if w.die_at_round == Some(g.round) => return docs,
            Some(In::GeneratePlan(g)) => Out::GenerateResult(generated(&g)),
            Some(In::CheckpointRequest(c)) => Out::CheckpointDone(wire::CheckpointDone {
                job_id: c.job_id,
                step: c.step,
                rank: 0,
                path: c.dir,
            }),
            Some(In::Release(_)) => return docs,
            _ => continue,
        };
        tx.send(msg(reply)).await.unwrap();
    }
    docs
}

/// A deterministic answer to a generation round: the completion of sample
/// `k` is the text `k` then the byte tokenizer's EOS (257), each token at
/// log-prob -0.1.
pub fn generated(g: &wire::GeneratePlan) -> wire::GenerateResult {
    let completions = g
        .requests
        .iter()
        .map(|q| {
            let mut ids: Vec<u32> = q.sample.to_string().bytes().map(u32::from).collect();
            ids.push(257);
            wire::Completion {
                prompt_id: q.prompt_id.clone(),
                sample: q.sample,
                logprobs: accrue_proto::pack_f32(&vec![-0.1; ids.len()]),
                token_ids: accrue_proto::pack_u32(&ids),
                finish: wire::FinishReason::Stop as i32,
                routing: Vec::new(),
            }
        })
        .collect();
    wire::GenerateResult {
        job_id: g.job_id.clone(),
        generation: g.generation,
        round: g.round,
        rank: g.rank,
        policy_version: g.policy_version,
        completions,
        seconds: 0.01,
    }
}
