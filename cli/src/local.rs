//! `accrue local JOB.toml --workers N`: the embedded default. Runs a
//! coordinator in this process (state in `OUTPUT_DIR/state`), starts N
//! `accrue-worker` processes against it (logs in `OUTPUT_DIR/logs/`),
//! submits the job and follows it with the `watch` progress bar. Exit 0 when
//! the job completes, 1 with the reason when it fails, is cancelled, or every
//! worker died. Workers and server are stopped on exit and on Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use super::client::{connect, rpc_error};
use super::output::errln;
use super::watch;
use crate::args::{Conn, Devices};
use accrue_coordinator::core::Event;
use accrue_coordinator::job::spec::JobSpec;
use accrue_coordinator::shell::auth::{Token, Tokens, WORKER_TOKEN_ENV};
use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::wire::{GetJobRequest, SubmitJobRequest};

/// How long finished workers get to write their final checkpoint and exit.
const WORKER_GRACE: Duration = Duration::from_secs(120);

/// The `accrue-worker` binary: `$ACCRUE_WORKER_BIN`, else next to this exe.
pub fn worker_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("ACCRUE_WORKER_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("locating the accrue executable")?;
    let bin = exe.with_file_name("accrue-worker");
    anyhow::ensure!(
        bin.is_file(),
        "accrue-worker not found next to accrue ({}); run scripts/setup.sh",
        bin.display()
    );
    Ok(bin)
}

/// libtorch threads per worker: the machine's cores shared out, at least 1.
fn threads_per_worker(workers: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / workers.max(1) as usize).max(1)
}

/// The `--device` of worker `k` of a local run on a machine with
/// `visible` GPUs: GPU k mod visible, as one process per GPU wants.
pub fn worker_device(k: u32, visible: usize, devices: Devices) -> String {
    match (devices, visible) {
        (Devices::Gpu, n) if n > 0 => format!("cuda:{}", k as usize % n),
        _ => "cpu".into(),
    }
}

/// GPUs visible to the workers: `CUDA_VISIBLE_DEVICES` when set (its
/// entries up to the first invalid one, as CUDA reads it), else the
/// `GPU n: …` lines of `nvidia-smi -L` (0 without it).
pub fn visible_gpus(cuda_visible_devices: Option<&str>, smi_list: Option<&str>) -> usize {
    if let Some(list) = cuda_visible_devices {
        return list
            .split(',')
            .map(str::trim)
            .take_while(|e| !e.is_empty() && !e.starts_with('-'))
            .count();
    }
    smi_list.map_or(0, |l| {
        l.lines().filter(|line| line.starts_with("GPU ")).count()
    })
}

fn probe_gpus() -> usize {
    let env = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let smi = std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    visible_gpus(env.as_deref(), smi.as_deref())
}

/// Runs `accrue local`.
pub async fn run(
    spec_path: &Path,
    workers: u32,
    devices: Devices,
    metrics_listen: Option<&str>,
    serve_listen: Option<SocketAddr>,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(workers >= 1, "--workers must be at least 1");
    let spec_toml = accrue_coordinator::job::input::read_spec(
        spec_path,
        accrue_coordinator::job::input::MAX_CONFIG_BYTES,
    )?;
    let base = std::path::absolute(std::env::current_dir()?)?;
    let spec = match JobSpec::parse(&spec_toml, &base) {
        Ok(s) => s,
        Err(problems) => {
            errln!("error: {} is not a valid job spec:", spec_path.display());
            for p in problems {
                errln!("  {p}");
            }
            return Ok(ExitCode::FAILURE);
        }
    };
    // What `submit` checks against the model and tokenizer, before a
    // worker starts: a spec the coordinator would refuse is refused now,
    // in the words submit uses (the data is read once, at submit).
    if let Err(problems) = accrue_coordinator::shell::admission::admit(&spec, false) {
        errln!("error: {} cannot run:", spec_path.display());
        for p in problems {
            errln!("  {p}");
        }
        return Ok(ExitCode::FAILURE);
    }
    let worker_bin = worker_binary()?;
    let out = spec.job.output_dir.clone();
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;

    let mut config = ServerConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), out.join("state"));
    config.metrics_from_flag(metrics_listen)?;
    let config_metrics = config.metrics_listen;
    if spec.rl.serve.is_some() {
        config.serve_listen =
            Some(serve_listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))));
    }
    // Local runs are authenticated too: fresh tokens for this run only,
    // handed to the workers through their environment (not argv, which
    // other users can read).
    let tokens = Tokens {
        admin: Some(Token::generate()),
        worker: Some(Token::generate()),
    };
    config.security.tokens = tokens.clone();
    let server = Server::bind(config).await?;
    settle_leftover_jobs(&server, &spec);
    let addr = server.local_addr();
    let metrics = server.metrics_addr();
    let endpoint = server.serve_addr().map(|addr| Endpoint {
        addr,
        admin: tokens.admin.clone(),
        dir: out.clone(),
    });
    let shared = server.shared();
    let url = format!("http://{addr}");
    let stop = CancellationToken::new();
    let serving = tokio::spawn(server.run(stop.clone()));
    errln!(
        "coordinator on {url} (state in {})",
        out.join("state").display()
    );
    match metrics {
        // The page shows workers and reasons with this run's admin token:
        // in the fragment, which the browser keeps and never sends.
        Some(addr) => errln!(
            "status page on http://{addr}/#token={} (Prometheus: http://{addr}/metrics)",
            tokens.admin.as_ref().map_or("", |t| t.expose())
        ),
        None if metrics_listen != Some("off") => errln!(
            "no status page: {} is taken (pass --metrics-listen ADDR)",
            config_metrics.map_or_else(String::new, |a| a.to_string())
        ),
        None => {}
    }

    let gpus = if devices == Devices::Gpu {
        probe_gpus()
    } else {
        0
    };
    let mut children = Vec::new();
    for k in 0..workers {
        let device = worker_device(k, gpus, devices);
        let log_path = logs.join(format!("worker-{k}.log"));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let child = Command::new(&worker_bin)
            .arg("--coordinator")
            .arg(&url)
            .arg("--threads")
            .arg(threads_per_worker(workers).to_string())
            .arg("--device")
            .arg(&device)
            // The worker's own choice would look at LOCAL_RANK first.
            .env_remove("LOCAL_RANK")
            .env(
                WORKER_TOKEN_ENV,
                tokens.worker.as_ref().map_or("", |t| t.expose()),
            )
            .env_remove("ACCRUE_WORKER_TOKEN_FILE")
            .env_remove("ACCRUE_TLS_CA")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", worker_bin.display()))?;
        children.push((child, log_path));
    }
    let placed = if gpus > 0 {
        format!("on {} GPU(s)", gpus.min(workers as usize))
    } else {
        "on the CPU".to_string()
    };
    errln!(
        "{workers} worker(s) started {placed}; logs in {}",
        logs.display()
    );

    // All N workers join before the job starts, so it runs at world N from
    // step 1 rather than growing mid-run.
    let mut released = false;
    let result = match wait_for_workers(&shared, workers, &mut children).await {
        Ok(()) => {
            let conn = Conn {
                token: tokens.admin.as_ref().map(|t| t.expose().to_string()),
                ..Conn::new(&url)
            };
            follow(
                &conn,
                &spec_toml,
                &base,
                endpoint.as_ref(),
                &mut children,
                &mut released,
            )
            .await
        }
        Err(e) => Err(e),
    };
    // Workers released by the job's end finish their final checkpoint and
    // exit by themselves; after Ctrl-C, or when the job never ran, there
    // is nothing to wait for.
    if released {
        let _ = tokio::time::timeout(WORKER_GRACE, async {
            for (c, _) in children.iter_mut() {
                let _ = c.wait().await;
            }
        })
        .await;
    }
    for (c, _) in children.iter_mut() {
        let _ = c.kill().await;
    }
    stop.cancel();
    let _ = serving.await;
    result
}

/// Waits until `n` workers hold an open session, failing if a worker
/// process exits first or none arrive within a minute.
pub(super) async fn wait_for_workers(
    shared: &accrue_coordinator::shell::service::Shared,
    n: u32,
    children: &mut [(Child, PathBuf)],
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let connected = shared.read(|c| c.workers().filter(|w| w.connected()).count());
        if connected >= n as usize {
            return Ok(());
        }
        for (c, log) in children.iter_mut() {
            if let Some(status) = c.try_wait()? {
                anyhow::bail!(
                    "a worker exited ({status}) before the job started; see {}",
                    log.display()
                );
            }
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("only {connected} of {n} workers connected within 60 s");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Jobs restored from an earlier run in the same state dir: the one with
/// this spec's name and spec resumes (the submit below finds it, and the
/// workers restore its latest checkpoint and replay what came after); any
/// other would take the workers, and is cancelled.
fn settle_leftover_jobs(server: &Server, spec: &JobSpec) {
    let shared = server.shared();
    let spec_toml = spec.to_toml();
    let open: Vec<(String, bool, u64)> = shared.read(|c| {
        c.jobs()
            .filter(|j| !j.rec.state.is_terminal())
            .map(|j| {
                let same = j.rec.name == spec.job.name && j.rec.spec_toml == spec_toml;
                (j.rec.id.clone(), same, j.rec.step)
            })
            .collect()
    });
    for (job, same, step) in open {
        if same {
            errln!("resuming job {job} (left unfinished by an earlier run at step {step})");
            continue;
        }
        errln!("cancelling job {job} left unfinished by an earlier run");
        let _ = shared.apply(Event::CancelJob { job });
    }
}

/// Submits the job and watches it, racing Ctrl-C and the workers' deaths;
/// sets `released` when the job ended and its workers are writing their
/// final checkpoint.
/// A served job's endpoint: where it listens, and what its key derives from.
struct Endpoint {
    addr: SocketAddr,
    admin: Option<Token>,
    dir: PathBuf,
}

impl Endpoint {
    /// Writes `endpoint.json` (the base URL and key an `openai` client
    /// takes), readable by its owner only: the key opens the job's policy.
    fn write(&self, job: &str) -> anyhow::Result<()> {
        let base_url = format!("http://{}/jobs/{job}/v1", self.addr);
        let key = self
            .admin
            .as_ref()
            .map_or_else(String::new, |t| t.endpoint_token(job).expose().to_string());
        let path = self.dir.join("endpoint.json");
        let text =
            serde_json::json!({"job": job, "base_url": base_url, "api_key": key}).to_string();
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts
            .open(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        std::io::Write::write_all(&mut f, text.as_bytes())?;
        errln!("endpoint on {base_url} (the key is in {})", path.display());
        Ok(())
    }
}

async fn follow(
    conn: &Conn,
    spec_toml: &str,
    base: &Path,
    endpoint: Option<&Endpoint>,
    children: &mut [(Child, PathBuf)],
    released: &mut bool,
) -> anyhow::Result<ExitCode> {
    let url = conn.coordinator.as_str();
    let mut client = connect(conn).await?;
    let job = client
        .submit_job(SubmitJobRequest {
            spec_toml: spec_toml.to_string(),
            base_dir: base.display().to_string(),
            new_job: false,
        })
        .await
        .map_err(|s| rpc_error(&s, url))
        .context("submit")?
        .into_inner()
        .job_id;
    errln!("submitted job {job}");
    if let Some(e) = endpoint {
        e.write(&job)?;
    }
    let interrupted = accrue_coordinator::shutdown_on_signal();
    let code = tokio::select! {
        biased;
        r = watch::run(conn, &job, 0, false) => {
            *released = true;
            r?
        }
        _ = interrupted.cancelled() => {
            errln!("interrupted: stopping the workers and the coordinator");
            return Ok(ExitCode::from(130));
        }
        dead = all_exited(children) => {
            // Released workers exit as the job ends: a race with the watch.
            let j = client.get_job(GetJobRequest { job_id: job.clone() }).await.ok().and_then(|r| r.into_inner().job);
            match j.and_then(|j| watch::exit_for(j.state)) {
                Some(code) => code,
                None => anyhow::bail!("every worker exited before job {job} ended; see {dead}"),
            }
        }
    };
    if code != ExitCode::SUCCESS {
        let reason = client
            .get_job(GetJobRequest {
                job_id: job.clone(),
            })
            .await
            .ok()
            .and_then(|r| r.into_inner().job)
            .map(|j| j.reason)
            .unwrap_or_default();
        errln!("error: job {job} did not complete: {reason}");
    }
    Ok(code)
}

/// Resolves once every worker process has exited; names their logs.
async fn all_exited(children: &mut [(Child, PathBuf)]) -> String {
    for (c, _) in children.iter_mut() {
        let _ = c.wait().await;
    }
    children
        .iter()
        .map(|(_, log)| log.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_shared_out_and_never_zero() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads_per_worker(1), cores);
        assert_eq!(threads_per_worker(10_000), 1);
    }

    #[test]
    fn workers_take_gpus_round_robin_or_the_cpu() {
        let devs: Vec<String> = (0..5).map(|k| worker_device(k, 2, Devices::Gpu)).collect();
        assert_eq!(devs, ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]);
        assert_eq!(worker_device(3, 8, Devices::Gpu), "cuda:3");
        assert_eq!(worker_device(0, 0, Devices::Gpu), "cpu");
        assert_eq!(worker_device(1, 8, Devices::Cpu), "cpu");
    }

    #[test]
    fn visible_gpus_follow_cuda_visible_devices_then_nvidia_smi() {
        let smi = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\n\
                   GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)\n  MIG 1g.10gb Device 0: (UUID: MIG-x)\n";
        assert_eq!(visible_gpus(None, Some(smi)), 2);
        assert_eq!(visible_gpus(Some("3,5,7"), Some(smi)), 3);
        assert_eq!(visible_gpus(Some("GPU-b"), Some(smi)), 1);
        assert_eq!(visible_gpus(Some(""), Some(smi)), 0);
        assert_eq!(visible_gpus(Some("-1"), Some(smi)), 0);
        assert_eq!(visible_gpus(Some("0,-1,1"), Some(smi)), 1);
        assert_eq!(visible_gpus(None, None), 0);
    }

    #[test]
    fn a_missing_worker_binary_says_how_to_build_it() {
        if std::env::var_os("ACCRUE_WORKER_BIN").is_some() {
            return;
        }
        // The coordinator's test binary lives in target/*/deps, without a worker.
        if let Err(e) = worker_binary() {
            let msg = e.to_string();
            assert!(
                msg.starts_with("accrue-worker not found next to accrue"),
                "{msg}"
            );
            assert!(msg.ends_with("run scripts/setup.sh"), "{msg}");
        }
    }
}
