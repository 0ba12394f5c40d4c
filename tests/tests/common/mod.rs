//! Shared harness for the workspace integration tests: builds and runs the
//! real binaries on 127.0.0.1 with OS-chosen ports, and a fake worker that
//! speaks the real session protocol and echoes plans back as results.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Once;
use std::time::Duration;

use accrue_proto::v1 as wire;
use accrue_proto::v1::coordinator_message::Msg as In;
use accrue_proto::v1::worker_message::Msg as Out;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

static BUILD: Once = Once::new();

/// Directory of the workspace's built binaries (built once per test run).
pub fn bin_dir() -> PathBuf {
    BUILD.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "-q",
                "-p",
                "accrue-coordinator",
                "-p",
                "accrue-cli",
                // Tests that run `accrue local` start real workers.
                "-p",
                "accrue-worker",
                "--bins",
            ])
            .current_dir(workspace_root())
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building the binaries failed");
    });
    // target/<profile>/deps/<test> → target/<profile>
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A running `accrue-coordinator` process.
pub struct Coordinator {
    pub child: Child,
    pub url: String,
    pub addr: String,
}

impl Coordinator {
    pub fn start(state_dir: &Path) -> Coordinator {
        Self::start_on(state_dir, "127.0.0.1:0")
    }

    pub fn start_on(state_dir: &Path, listen: &str) -> Coordinator {
        let mut child = Command::new(bin_dir().join("accrue-coordinator"))
            .args(["--listen", listen, "--state-dir"])
            .arg(state_dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting accrue-coordinator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Coordinator {
            child,
            url: format!("http://{addr}"),
            addr,
        }
    }

    /// `kill -9`: no chance to clean up.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the `accrue` CLI against `url`.
pub fn accrue(url: &str, args: &[&str], cwd: &Path) -> Output {
    Command::new(bin_dir().join("accrue"))
        .args(["--coordinator", url])
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("running accrue")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// What a fake worker saw.
#[derive(Debug, Default, Clone)]
pub struct FakeReport {
    pub steps: Vec<u64>,
    pub checkpoints: Vec<u64>,
    pub released: bool,
    /// doc ids of every sequence in every plan, with the step.
    pub docs: Vec<(u64, String)>,
    /// Steps whose plan was a replay of an already committed step.
    pub replayed: Vec<u64>,
    /// Generation rounds answered (the RL loop).
    pub rounds: Vec<u64>,
    /// Steps whose policy it published (`rl.publish_every`).
    pub published: Vec<u64>,
    /// Disaggregated RL: the generations it was configured in as a
    /// generator, and the policy versions it loaded.
    pub generator_in: Vec<u64>,
    pub synced: Vec<u64>,
    /// (generation, step, doc id) of every sequence in every plan: a step
    /// re-planned in a new generation shows under both.
    pub plan_docs: Vec<(u64, u64, String)>,
}

/// A worker speaking the real protocol: answers Configure with Ready and a
/// plan with sums computed from the plan's own tokens (loss = 1.5/token).
/// Stops after `max_steps` results (then just stops answering) if given.
pub async fn fake_worker(url: String, max_steps: Option<usize>) -> anyhow::Result<FakeReport> {
    fake_generator(url, max_steps, None).await
}

/// [`fake_worker`] that also answers the RL loop's generation rounds: the
/// completion of sample k is the text "k" and the byte tokenizer's EOS,
/// each token at log-prob -0.1. It dies (closes its session unanswered)
/// on round `die_at_round`.
pub async fn fake_generator(
    url: String,
    max_steps: Option<usize>,
    die_at_round: Option<u64>,
) -> anyhow::Result<FakeReport> {
    let mut client = wire::worker_service_client::WorkerServiceClient::connect(url).await?;
    let reg = client
        .register(wire::RegisterRequest {
            held: None,
            hostname: "fake".into(),
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            collective_addr: "127.0.0.1:9".into(),
            version: "test".into(),
            previous_worker_id: String::new(),
            peak_flops: 1e12,
            gpu_name: String::new(),
            gpu_memory_bytes: 0,
            protocol: accrue_proto::PROTOCOL,
            // It cannot relay: its generations are sent directly.
            relay_addr: String::new(),
        })
        .await?
        .into_inner();
    let (tx, rx) = mpsc::channel(64);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let send = |m: Out| wire::WorkerMessage { msg: Some(m) };
    tx.send(send(Out::Hello(wire::Hello {
        worker_id: reg.worker_id.clone(),
    })))
    .await?;
    let mut inbound = client.session(outbound).await?.into_inner();
    let hb = tx.clone();
    let beat = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if hb
                .send(send(Out::Heartbeat(wire::Heartbeat::default())))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let mut report = FakeReport::default();
    let mut rank = 0;
    let mut generation = 0;
    while let Some(msg) = inbound.next().await {
        let Some(msg) = msg?.msg else { continue };
        match msg {
            In::Configure(c) => {
                rank = c.rank;
                generation = c.generation;
                if c.role() == wire::Role::Generator {
                    report.generator_in.push(c.generation);
                }
                tx.send(send(Out::Ready(wire::Ready {
                    job_id: c.job_id,
                    generation: c.generation,
                    step: c.step,
                })))
                .await?;
            }
            In::StepPlan(p) => {
                if max_steps.is_some_and(|m| report.steps.len() >= m) {
                    break;
                }
                let mut sums = wire::MetricSums {
                    grad_norm: 0.5,
                    ..Default::default()
                };
                for mb in &p.microbatches {
                    let ids = accrue_proto::unpack_u32(&mb.token_ids)?;
                    let labels = accrue_proto::microbatch_labels(&ids, &mb.labels, &mb.loss_mask)?;
                    anyhow::ensure!(
                        mb.cu_seq_lens.last().copied().unwrap_or(0) as usize == ids.len(),
                        "cu_seq_lens do not cover the row"
                    );
                    for w in mb.cu_seq_lens.windows(2) {
                        let seq = &labels[w[0] as usize..w[1] as usize];
                        sums.loss_tokens +=
                            seq.iter().skip(1).filter(|&&l| l != -100).count() as u64;
                    }
                    sums.tokens += ids.len() as u64;
                    // A document counts at its first sequence, as workers count.
                    sums.documents += mb.sequences.iter().filter(|s| s.role == 0).count() as u64;
                    sums.microbatches += 1;
                    report.docs.extend(
                        mb.sequences
                            .iter()
                            .map(|s| (p.step, accrue_proto::doc_label(s))),
                    );
                    report.plan_docs.extend(
                        mb.sequences
                            .iter()
                            .map(|s| (p.generation, p.step, accrue_proto::doc_label(s))),
                    );
                }
                sums.loss_sum = 1.5 * sums.loss_tokens as f64;
                report.steps.push(p.step);
                if p.replay {
                    report.replayed.push(p.step);
                }
                tx.send(send(Out::StepResult(wire::StepResult {
                    job_id: p.job_id,
                    generation: p.generation,
                    step: p.step,
                    rank: p.rank,
                    sums: Some(sums),
                    logps: Vec::new(),
                    nonfinite_microbatches: Vec::new(),
                })))
                .await?;
            }
            In::CheckpointRequest(c) => {
                report.checkpoints.push(c.step);
                tx.send(send(Out::CheckpointDone(wire::CheckpointDone {
                    job_id: c.job_id,
                    step: c.step,
                    rank: 0,
                    path: c.dir,
                })))
                .await?;
            }
            In::Abort(_) => {}
            In::GeneratePlan(g) if die_at_round == Some(g.round) => break,
            In::GeneratePlan(g) => {
                report.rounds.push(g.round);
                let completions = g
                    .requests
                    .iter()
                    .map(|q| {
                        let mut ids: Vec<u32> =
                            q.sample.to_string().bytes().map(u32::from).collect();
                        ids.push(257);
                        wire::Completion {
                            routing: Default::default(),
                            prompt_id: q.prompt_id.clone(),
                            sample: q.sample,
                            logprobs: accrue_proto::pack_f32(&vec![-0.1; ids.len()]),
                            token_ids: accrue_proto::pack_u32(&ids),
                            finish: wire::FinishReason::Stop as i32,
                        }
                    })
                    .collect();
                tx.send(send(Out::GenerateResult(wire::GenerateResult {
                    job_id: g.job_id,
                    generation: g.generation,
                    round: g.round,
                    rank: g.rank,
                    policy_version: g.policy_version,
                    completions,
                    seconds: 0.01,
                })))
                .await?;
            }
            In::PublishPolicy(p) => {
                // As a worker does: the model's config and weights (the
                // coordinator adds the tokenizer files); for generator
                // workers a snapshot kept in memory.
                if p.target() == wire::PolicyTarget::Disk {
                    let dir = std::path::Path::new(&p.dir);
                    std::fs::create_dir_all(dir)?;
                    std::fs::write(
                        dir.join("config.json"),
                        r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
                    )?;
                    std::fs::write(dir.join("model.safetensors"), b"weights")?;
                }
                report.published.push(p.step);
                tx.send(send(Out::PolicyPublished(wire::PolicyPublished {
                    job_id: p.job_id,
                    step: p.step,
                    rank,
                    path: p.dir,
                    generation,
                })))
                .await?;
            }
            // Trainer rank 0 would broadcast; the generator answers once
            // it loaded the policy.
            In::SyncWeights(w) if report.generator_in.last() == Some(&w.generation) => {
                report.synced.push(w.version);
                tx.send(send(Out::WeightsSynced(wire::WeightsSynced {
                    job_id: w.job_id,
                    generation: w.generation,
                    version: w.version,
                    rank,
                    bytes: 0,
                    seconds: 0.0,
                })))
                .await?;
            }
            In::SyncWeights(_) => {}
            // Never sent to a worker that advertises no relay address.
            In::Relay(r) => anyhow::bail!("a relay for generation {}", r.generation),
            In::Release(_) => {
                report.released = true;
                break;
            }
        }
    }
    beat.abort();
    Ok(report)
}

/// Writes a tiny SFT dataset and a job spec using it into `dir`.
pub fn write_job(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let mut data = String::new();
    for i in 0..40 {
        data.push_str(&format!(
            "{{\"prompt\": \"{i}+{i}=\", \"completion\": \"{}\"}}\n",
            2 * i
        ));
    }
    std::fs::write(dir.join("train.jsonl"), data).unwrap();
    std::fs::write(
        dir.join("tiny.json"),
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":320,"max_position_embeddings":512,"rms_norm_eps":1e-5}"#,
    )
    .unwrap();
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 7
{extra}
output_dir = "out/{name}"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["train.jsonl"]
format = "sft"
max_tokens = 64
[batch]
docs_per_step = 8
[checkpoint]
every_steps = 2
"#
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// Polls `accrue jobs --json` until `pred` holds (or panics after `secs`).
pub fn wait_for_jobs(
    url: &str,
    cwd: &Path,
    secs: u64,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let out = accrue(url, &["jobs", "--json"], cwd);
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            if pred(&v) {
                return v;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out; last: {}",
            stdout(&out)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
