//! The worker session against a real in-process coordinator, with a fake
//! executor (no libtorch model): registration, plans, heartbeats during a
//! step longer than the heartbeat timeout, metrics.jsonl, checkpoints with
//! their manifest, release, and resuming a job from a checkpoint at the same
//! step and data position.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::wire as cwire;
use accrue_worker::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, StepNorms};
use accrue_worker::collective::{Collective, Solo};
use accrue_worker::runner::{Factory, RunnerConfig};
use accrue_worker::session::{self, SessionConfig};
use accrue_worker::train::{
    CheckpointWrite, Checkpointing, Membership, Passes, StepStats, Trainer,
};

use tokio_util::sync::CancellationToken;

/// Loss falls with every optimizer step; the first microbatch can be slow.
struct Fake {
    steps: u32,
    slow_first: Option<Duration>,
    solo: Solo,
}

impl Passes for Fake {
    fn train_microbatch(
        &mut self,
        _index: usize,
        mb: &PackedBatch,
        _meta: &MicrobatchMeta,
        _norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        if let Some(d) = self.slow_first.take() {
            std::thread::sleep(d);
        }
        let loss_tokens = mb.labels.iter().filter(|&&l| l != -100).count() as u64;
        Ok(MicrobatchOutcome {
            loss_sum: loss_tokens as f64 * 4.0 / f64::from(self.steps + 1),
            loss_tokens,
            tokens: mb.labels.len() as u64,
            ..Default::default()
        })
    }

    fn zero_grad(&mut self) {}

    fn grads_finite(&self) -> bool {
        true
    }
}

impl Membership for Fake {
    fn set_collective(&mut self, _: Box<dyn Collective>) -> anyhow::Result<()> {
        Ok(())
    }

    fn group(&mut self) -> &mut dyn Collective {
        &mut self.solo
    }
}

impl Checkpointing for Fake {
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let steps = self.steps;
        Ok(Box::new(move |dir: &Path| {
            // A real (if tiny) model folder: submit checks what a
            // `model.init` checkpoint holds.
            std::fs::write(
                dir.join("config.json"),
                r#"{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
            )?;
            std::fs::write(dir.join("model.safetensors"), fake_weights(steps))?;
            Ok(vec!["config.json".into(), "model.safetensors".into()])
        }))
    }
}

impl Trainer for Fake {
    fn optimizer_step(&mut self, _lr: f64) -> anyhow::Result<StepStats> {
        self.steps += 1;
        Ok(StepStats { grad_norm: 1.0 })
    }
}

/// The fake replica's state as a safetensors file: its step count.
fn fake_weights(steps: u32) -> Vec<u8> {
    let bytes = steps.to_le_bytes();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![1], &bytes).unwrap();
    safetensors::serialize([("steps", view)], None).unwrap()
}

fn steps_of(file: &[u8]) -> anyhow::Result<u32> {
    let st = safetensors::SafeTensors::deserialize(file)?;
    let t = st.tensor("steps")?;
    Ok(u32::from_le_bytes(t.data().try_into()?))
}

/// A factory recording what each build restored from.
fn factory(restores: Arc<Mutex<Vec<Option<PathBuf>>>>, slow_first: Option<Duration>) -> Factory {
    Arc::new(move |_, restore, _| {
        restores
            .lock()
            .unwrap()
            .push(restore.map(Path::to_path_buf));
        // A restored replica continues its step count from the checkpoint.
        let steps = match restore {
            Some(d) => steps_of(&std::fs::read(d.join("model.safetensors"))?)?,
            None => 0,
        };
        Ok(Box::new(Fake {
            steps,
            slow_first,
            solo: Solo,
        }) as Box<dyn Trainer>)
    })
}

fn spec(name: &str, init: &str) -> String {
    let model = if init == "random" {
        "init = \"random\"\nconfig = \"tiny.json\"".to_string()
    } else {
        format!("init = \"{init}\"")
    };
    format!(
        "[job]\nname = \"{name}\"\nseed = 3\nsteps = 3\noutput_dir = \"out/{name}\"\n\
         [model]\n{model}\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\nmax_tokens = 64\n\
         [batch]\ndocs_per_step = 4\n[checkpoint]\nevery_steps = 2\n"
    )
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn train(url: &str, dir: &Path, spec: String, f: Factory) -> String {
    let mut admin = cwire::admin_client::AdminClient::connect(url.to_string())
        .await
        .unwrap();
    let job = admin
        .submit_job(cwire::SubmitJobRequest {
            spec_toml: spec,
            base_dir: dir.display().to_string(),
            new_job: false,
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let cfg = SessionConfig::new(url);
    tokio::time::timeout(
        Duration::from_secs(30),
        session::run(cfg, RunnerConfig::new(f)),
    )
    .await
    .expect("the worker is released when the job completes")
    .unwrap();
    let state = admin
        .get_job(cwire::GetJobRequest {
            job_id: job.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(
        state.state,
        cwire::JobState::Completed as i32,
        "{}",
        state.reason
    );
    job
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_trains_checkpoints_and_a_resumed_job_continues_at_the_same_step_and_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = String::new();
    for i in 0..20 {
        rows.push_str(&format!(
            "{{\"prompt\": \"{i}+{i}=\", \"completion\": \"{}\"}}\n",
            2 * i
        ));
    }
    std::fs::write(dir.path().join("train.jsonl"), rows).unwrap();
    std::fs::write(dir.path().join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();

    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
    cfg.heartbeat_interval_ms = 100;
    cfg.heartbeat_timeout_ms = 800;
    cfg.tick_ms = 50;
    let server = Server::bind(cfg).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(stop.clone()));

    // Job a: three steps; the first microbatch takes 2 s, longer than the
    // heartbeat timeout, so a runtime blocked by compute would lose the worker.
    let restores = Arc::new(Mutex::new(Vec::new()));
    let slow = Some(Duration::from_secs(2));
    train(
        &url,
        dir.path(),
        spec("a", "random"),
        factory(restores.clone(), slow),
    )
    .await;
    assert_eq!(
        *restores.lock().unwrap(),
        vec![None],
        "built once, never lost"
    );
    let out_a = dir.path().join("out/a");
    let a = metrics(&out_a.join("metrics.jsonl"));
    let steps: Vec<u64> = a.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![1, 2, 3]);
    for m in &a {
        for field in [
            "loss",
            "tokens",
            "docs",
            "microbatches",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "step_time_s",
        ] {
            assert!(m.get(field).is_some(), "{field} missing from {m}");
        }
        assert_eq!(m["docs"], 4);
        assert_eq!(m["generation"], 1, "no worker loss, no new generation");
    }
    assert!(a[0]["step_time_s"].as_f64().unwrap() >= 2.0);
    let loss: Vec<f64> = a.iter().map(|m| m["loss"].as_f64().unwrap()).collect();
    assert!(loss[0] > loss[1] && loss[1] > loss[2], "{loss:?}");
    // every_steps = 2 and the final step: both checkpoints, each complete.
    for step in [2u64, 3] {
        let ck = out_a.join(format!("checkpoints/step-{step}"));
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ck.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(m["step"], step);
        assert_eq!(m["cursor"], a[step as usize - 1]["cursor"], "step {step}");
        assert_eq!(
            (m["world_size"].as_u64(), m["generation"].as_u64()),
            (Some(1), Some(1))
        );
        assert!(ck.join("model.safetensors").is_file());
        assert!(ck.join("rank-0.json").is_file(), "the rank's marker");
        accrue_checkpoint::verify(&ck).unwrap();
    }

    // Job b resumes from a's step-2 checkpoint: it trains step 3 only, on
    // the documents a trained at step 3, and restores from that directory.
    let ck2 = out_a.join("checkpoints/step-2");
    let restores = Arc::new(Mutex::new(Vec::new()));
    train(
        &url,
        dir.path(),
        spec("b", &ck2.display().to_string()),
        factory(restores.clone(), None),
    )
    .await;
    assert_eq!(*restores.lock().unwrap(), vec![Some(ck2)]);
    let b = metrics(&dir.path().join("out/b/metrics.jsonl"));
    assert_eq!(b.len(), 1, "{b:?}");
    assert_eq!(b[0]["step"], 3);
    assert_eq!(b[0]["cursor"], a[2]["cursor"], "same data position");
    assert_eq!(b[0]["tokens"], a[2]["tokens"], "same documents");
    assert!(
        (b[0]["loss"].as_f64().unwrap() - loss[2]).abs() < 1e-12,
        "the restored replica continues where it was"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A coordinator of another contract revision: it refuses every
/// registration naming `protocol`, and counts them.
struct OtherRevision {
    registrations: Arc<Mutex<u32>>,
}

#[tonic::async_trait]
impl cwire::worker_service_server::WorkerService for OtherRevision {
    async fn register(
        &self,
        req: tonic::Request<cwire::RegisterRequest>,
    ) -> Result<tonic::Response<cwire::RegisterResponse>, tonic::Status> {
        *self.registrations.lock().unwrap() += 1;
        let sent = req.into_inner().protocol;
        assert_eq!(
            sent,
            accrue_proto::PROTOCOL,
            "the worker sends its revision"
        );
        Err(tonic::Status::failed_precondition(format!(
            "protocol: this worker speaks revision {sent}, this coordinator {}",
            sent + 1
        )))
    }

    type SessionStream =
        tokio_stream::wrappers::ReceiverStream<Result<cwire::CoordinatorMessage, tonic::Status>>;

    async fn session(
        &self,
        _: tonic::Request<tonic::Streaming<cwire::WorkerMessage>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("never reached"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refused_for_its_contract_revision_exits_naming_it_without_retrying() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let registrations = Arc::new(Mutex::new(0));
    let service = cwire::worker_service_server::WorkerServiceServer::new(OtherRevision {
        registrations: registrations.clone(),
    });
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let restores = Arc::new(Mutex::new(Vec::new()));
    // Retrying would go on for the whole reconnect timeout (a minute).
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        session::run(
            SessionConfig::new(&url),
            RunnerConfig::new(factory(restores, None)),
        ),
    )
    .await
    .expect("the worker gives up at once")
    .unwrap_err();
    let message = format!("{err:#}");
    assert!(message.contains("refused this worker"), "{message}");
    assert!(message.contains("protocol: "), "{message}");
    assert_eq!(
        *registrations.lock().unwrap(),
        1,
        "registered once, not retried"
    );
    server.abort();
}
