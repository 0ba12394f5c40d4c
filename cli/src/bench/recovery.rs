//! `accrue bench recovery`: how fast a job notices a lost worker and gets
//! back to committing steps. For each sharding level, world size and fault
//! it runs an in-process coordinator (default 2 s heartbeat timeout) and real
//! `accrue-worker` processes training a tiny Llama (hidden 64, 2 layers) on
//! synthetic arithmetic, lets a few steps commit, then hits the last worker
//! mid-step: `kill` is `kill -9` (its sockets close), `stop` is SIGSTOP (a
//! frozen process: only the heartbeat timeout can tell). It reports the
//! time from the fault to the coordinator ending the generation (detection)
//! and to the next committed step. Times are taken when the watch stream
//! delivers the event in this process.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::args::RecoveryArgs;
use crate::client::{connect, rpc_error};
use crate::local::{wait_for_workers, worker_binary};
use crate::output::{errln, outln};
use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::wire::{
    watch_job_response::Item, AbortReason, CancelJobRequest, EventKind, JobState, SubmitJobRequest,
    WatchJobRequest,
};

/// Detection target for a dead worker (issue 6).
const DETECT_TARGET_S: f64 = 2.0;
/// Next-committed-step target after a death (issue 6).
const NEXT_STEP_TARGET_S: f64 = 10.0;
/// Steps committed before the fault.
const WARM_STEPS: u64 = 4;

/// One measurement.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryRow {
    pub sharding: String,
    pub workers: u32,
    pub fault: String,
    /// Median step time before the fault.
    pub step_time_s: f64,
    /// Fault → the coordinator ends the generation.
    pub detect_s: f64,
    /// Fault → the next committed step.
    pub next_step_s: f64,
}

/// `accrue bench recovery`.
pub async fn run(args: &RecoveryArgs) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    for sharding in &args.sharding {
        for &workers in &args.workers {
            for fault in &args.faults {
                anyhow::ensure!(workers >= 2, "--workers: at least 2 (one is hit)");
                anyhow::ensure!(
                    fault == "kill" || fault == "stop",
                    "--faults: `kill` or `stop`, not {fault:?}"
                );
                let row = measure(sharding, workers, fault)
                    .await
                    .with_context(|| format!("{sharding}, {workers} workers, {fault}"))?;
                if args.json {
                    outln!("{}", serde_json::to_string(&row)?)?;
                } else {
                    outln!(
                        "{:<6} W={} {:<5} step {:>6.3}s  detect {:>6.3}s  next step {:>6.3}s",
                        row.sharding,
                        row.workers,
                        row.fault,
                        row.step_time_s,
                        row.detect_s,
                        row.next_step_s
                    )?;
                }
                rows.push(row);
            }
        }
    }
    for r in rows.iter().filter(|r| r.fault == "kill") {
        if r.detect_s > DETECT_TARGET_S || r.next_step_s > NEXT_STEP_TARGET_S {
            errln!(
                "target missed: {} W={} kill: detect {:.3}s (≤ {DETECT_TARGET_S}), next step {:.3}s (≤ {NEXT_STEP_TARGET_S})",
                r.sharding, r.workers, r.detect_s, r.next_step_s
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_job(dir: &Path, sharding: &str, workers: u32) -> anyhow::Result<String> {
    accrue_coordinator::stream::data::synth::synth_arithmetic(&dir.join("data"), 3, 2000)?;
    std::fs::write(
        dir.join("tiny.json"),
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,
"intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
"vocab_size":320,"max_position_embeddings":512,"rms_norm_eps":1e-5,"rope_theta":10000.0,
"initializer_range":0.02,"tie_word_embeddings":false,"bos_token_id":256,"eos_token_id":257}"#,
    )?;
    Ok(format!(
        r#"[job]
name = "recovery"
seed = 1
steps = 200
output_dir = "{out}"
[model]
init = "random"
config = "{dir}/tiny.json"
[data]
train = ["{dir}/data/arith-sft.jsonl"]
format = "sft"
max_tokens = 256
[batch]
docs_per_step = 16
[optimizer]
lr = 1e-3
[parallel]
sharding = "{sharding}"
min_workers = 1
max_workers = {workers}
[checkpoint]
every_steps = 3
"#,
        out = dir.join("out").display(),
        dir = dir.display(),
    ))
}

async fn measure(sharding: &str, workers: u32, fault: &str) -> anyhow::Result<RecoveryRow> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    let spec = write_job(dir, sharding, workers)?;
    let config = ServerConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), dir.join("state"));
    let server = Server::bind(config).await?;
    let shared = server.shared();
    let url = format!("http://{}", server.local_addr());
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));

    let bin = worker_binary()?;
    std::fs::create_dir_all(dir.join("logs"))?;
    let mut children: Vec<(Child, std::path::PathBuf)> = Vec::new();
    for k in 0..workers {
        let log_path = dir.join(format!("logs/worker-{k}.log"));
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(&bin)
            .args([
                "--coordinator",
                &url,
                "--threads",
                "1",
                "--peak-tflops",
                "1",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        children.push((child, log_path));
    }
    let result = async {
        wait_for_workers(&shared, workers, &mut children).await?;
        let mut client = connect(&crate::args::Conn::new(&url)).await?;
        let job = client
            .submit_job(SubmitJobRequest {
                spec_toml: spec,
                base_dir: dir.display().to_string(),
                new_job: false,
            })
            .await
            .map_err(|s| rpc_error(&s, &url))?
            .into_inner()
            .job_id;
        let mut watch = client
            .watch_job(WatchJobRequest {
                job_id: job.clone(),
                from_step: 0,
            })
            .await
            .map_err(|s| rpc_error(&s, &url))?
            .into_inner();
        let mut step_times = Vec::new();
        while (step_times.len() as u64) < WARM_STEPS {
            match next(&mut watch).await? {
                Item::Step(s) => step_times.push(s.step_time_s),
                Item::Event(e) if e.kind() == EventKind::State => {
                    anyhow::bail!("job ended before the fault: {}", e.message)
                }
                Item::Event(_) | Item::Eval(_) => {}
            }
        }
        step_times.sort_by(f64::total_cmp);
        let step_time_s = step_times[step_times.len() / 2];
        // Mid-step: half a step after the last commit.
        tokio::time::sleep(Duration::from_secs_f64(step_time_s / 2.0)).await;
        let (victim, _) = children.last_mut().expect("workers");
        let pid = victim.id().context("the victim has exited")?;
        let t0 = Instant::now();
        if fault == "kill" {
            victim.start_kill()?;
        } else {
            signal(pid, "STOP").await?;
        }
        // A step whose results were all in before the fault may still
        // commit: only a step committed after the detection counts.
        let mut detect_s = None;
        let next_step_s = loop {
            match next(&mut watch).await? {
                // A generation that ends says why.
                Item::Event(e)
                    if e.kind() == EventKind::Generation
                        && e.abort_reason() != AbortReason::Unspecified =>
                {
                    detect_s.get_or_insert(t0.elapsed().as_secs_f64());
                }
                Item::Event(e) if e.kind() == EventKind::State && e.state() == JobState::Failed => {
                    anyhow::bail!("the job failed after the fault: {}", e.message)
                }
                Item::Step(_) if detect_s.is_some() => break t0.elapsed().as_secs_f64(),
                _ => {}
            }
        };
        let _ = client.cancel_job(CancelJobRequest { job_id: job }).await;
        Ok(RecoveryRow {
            sharding: sharding.to_string(),
            workers,
            fault: fault.to_string(),
            step_time_s,
            detect_s: detect_s.expect("set before the loop ends"),
            next_step_s,
        })
    }
    .await;
    for (c, _) in children.iter_mut() {
        if let Some(pid) = c.id() {
            let _ = signal(pid, "CONT").await;
        }
        let _ = c.kill().await;
    }
    stop.cancel();
    let _ = serving.await;
    result
}

/// The next item of the watch stream, within a minute.
async fn next(
    watch: &mut tonic::Streaming<accrue_coordinator::wire::WatchJobResponse>,
) -> anyhow::Result<Item> {
    let item = tokio::time::timeout(Duration::from_secs(60), watch.next())
        .await
        .context("nothing on the watch stream for 60 s")?
        .context("the watch stream ended")??;
    item.item.context("an empty watch item")
}

async fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .await?
        .success();
    anyhow::ensure!(ok, "kill -{sig} {pid} failed");
    Ok(())
}
