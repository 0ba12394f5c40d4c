//! `accrue-worker`: one training process. Registers with the coordinator,
//! runs the step plans it is sent, and exits when released.

use accrue_worker::device;
use accrue_worker::runner::{self, RunnerConfig};
use accrue_worker::session::{self, SessionConfig};
use std::path::PathBuf;

use clap::Parser;

/// Accrue worker: trains on the step plans an accrue-coordinator sends.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The coordinator's URL (http://host:port).
    #[arg(
        long,
        env = "ACCRUE_COORDINATOR",
        default_value = "http://127.0.0.1:7070"
    )]
    coordinator: String,
    /// Where this worker listens for its peers' collective connections
    /// (port 0: any free port; the bound address is advertised).
    #[arg(long, default_value = "127.0.0.1:0")]
    collective_listen: String,
    /// Address peers dial for this worker's collective endpoint, instead of
    /// the bound one: `host:port`, or a bare host that takes the bound port
    /// (in Kubernetes: `$(POD_IP):7071`, as pod hostnames do not resolve).
    #[arg(long, value_name = "ADDR", env = "ACCRUE_COLLECTIVE_ADVERTISE")]
    collective_advertise: Option<String>,
    /// Where this worker listens for the relay connections of the workers
    /// it relays the coordinator's messages to, in generations large
    /// enough to relay (the coordinator's --relay-min-world): "auto" (the
    /// collective listener's host, any free port), "off" (never relay), or
    /// host:port.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "auto",
        env = "ACCRUE_RELAY_LISTEN"
    )]
    relay_listen: String,
    /// Address other workers dial for this worker's relay: host:port, or a
    /// bare host that takes the bound port (default with "auto": the
    /// --collective-advertise host).
    #[arg(long, value_name = "ADDR", env = "ACCRUE_RELAY_ADVERTISE")]
    relay_advertise: Option<String>,
    /// Device to train on: auto (LOCAL_RANK, else the first free visible
    /// GPU, else the CPU), cpu, cuda (like auto, GPUs only) or cuda:N.
    #[arg(long, env = "ACCRUE_DEVICE", default_value = "auto")]
    device: accrue_worker::device::DeviceRequest,
    /// Run one worker process per GPU of this machine (all, or the first
    /// N): each with LOCAL_RANK and --device cuda:i, its ports shifted by
    /// 100·i; signals are forwarded, the first failure's code is returned.
    #[arg(long, value_name = "all|N")]
    gpus: Option<accrue_worker::launch::Gpus>,
    /// Ask the gRPC health service at ADDR whether this worker is alive
    /// (exit 0 if SERVING, 1 otherwise) and exit: the image's HEALTHCHECK.
    #[arg(long, value_name = "ADDR")]
    health_check: Option<String>,
    /// Print what this worker can use as one JSON line (libtorch loaded,
    /// CUDA devices, the cuda/NCCL build) and exit; `accrue doctor` runs it.
    #[arg(long)]
    probe: bool,
    /// libtorch intra-op threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Peak TFLOP/s of this worker's device, for MFU (default: a table of
    /// GPUs by name, or a short matmul probe on CPU).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Exit when the coordinator releases this worker (job done, cancelled, drained).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    exit_on_release: bool,
    /// The worker token (sent as a bearer token on every call).
    #[arg(long, env = "ACCRUE_WORKER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the worker token (wins over --token).
    #[arg(long, value_name = "FILE", env = "ACCRUE_WORKER_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM CA bundle that signed the coordinator's certificate: connect with TLS.
    #[arg(long, value_name = "FILE", env = "ACCRUE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Name to check the coordinator's certificate against (default: URL host).
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    tls_domain: Option<String>,
    /// Client certificate (PEM) for a coordinator requiring mutual TLS.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics on HTTP `GET /metrics` at this address
    /// (off by default; port 0: any free port, printed as "metrics on ADDR").
    #[arg(long, value_name = "ADDR", env = "ACCRUE_WORKER_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Serve gRPC health here (e.g. 0.0.0.0:7072): service "" is liveness,
    /// "accrue.v1.Worker" readiness (registered, not draining). Default: off.
    #[arg(long, value_name = "ADDR", env = "ACCRUE_HEALTH_LISTEN")]
    health_listen: Option<String>,
    /// After SIGTERM (drain), exit non-zero if not released within this long.
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    drain_timeout_s: u64,
    /// Largest gRPC message accepted or sent, in MiB.
    #[arg(long, value_name = "MB", default_value_t = session::secure::DEFAULT_MAX_MESSAGE_MB)]
    max_message_mb: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    accrue_worker::init_tracing();
    if let Some(addr) = &args.health_check {
        let serving = session::lifecycle::check_alive(addr).await;
        std::process::exit(if serving { 0 } else { 1 });
    }
    if args.probe {
        let gpus = accrue_worker::device::probe();
        let line = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "libtorch": true,
            "cuda_devices": gpus.visible,
            "cuda_busy": gpus.busy,
            "cuda_build": cfg!(feature = "cuda"),
            "threads": tch::get_num_threads(),
        });
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), "{line}");
        return Ok(());
    }
    if let Some(gpus) = args.gpus {
        let n = accrue_worker::launch::count(gpus).map_err(anyhow::Error::msg)?;
        let code = accrue_worker::launch::run(n).await?;
        std::process::exit(i32::from(code));
    }
    if let Some(n) = args.threads {
        tch::set_num_threads(n.max(1));
    }
    if let Some(addr) = &args.metrics_listen {
        let bound = accrue_worker::metrics::spawn(addr)
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-listen {addr}: {e}"))?;
        // Not println!: a reader that took only the first line may be gone.
        let _ = std::io::Write::write_all(
            &mut std::io::stdout(),
            format!("metrics on {bound}\n").as_bytes(),
        );
    }
    let (listener, advertised) = session::bind_collective(
        &args.collective_listen,
        args.collective_advertise.as_deref(),
    )?;
    let relay = session::bind_relay(
        &args.relay_listen,
        args.relay_advertise.as_deref(),
        &args.collective_listen,
        args.collective_advertise.as_deref(),
    )?;
    let local_rank = std::env::var("LOCAL_RANK").ok();
    let choice = device::choose(args.device, local_rank.as_deref(), &device::probe())?;
    let info = device::describe(choice.device);
    tracing::info!(device = %info, why = choice.why, "training device");
    let mut cfg = SessionConfig::new(&args.coordinator);
    cfg.collective_addr = advertised;
    cfg.relay = relay.map(|(l, a)| (std::sync::Arc::new(l), a));
    cfg.exit_on_release = args.exit_on_release;
    cfg.peak_flops = session::peak_flops(args.peak_tflops, &info);
    cfg.device = info;
    cfg.security = session::secure::Security {
        token: session::secure::resolve_token(args.token.as_deref(), args.token_file.as_deref())?,
        tls: args.tls_ca.map(|ca| session::secure::TlsFiles {
            ca,
            domain: args.tls_domain,
            identity: args.tls_cert.zip(args.tls_key),
        }),
        max_message_bytes: args.max_message_mb.max(1) << 20,
    };
    if let Some(addr) = &args.health_listen {
        cfg.health = session::lifecycle::Health::serve(addr).await?.0;
    }
    let drain_timeout = std::time::Duration::from_secs(args.drain_timeout_s);
    cfg.drain = session::lifecycle::drain_on_sigterm(drain_timeout)?;
    let mut parts = RunnerConfig::on(runner::default_factory(), choice.device);
    parts.listener = Some(listener);
    session::run(cfg, parts).await
}
