//! `accrue-worker`: one training process. Registers with the coordinator,
//! runs the step plans it is sent, and exits when released.

use accrue_worker::runner::{self, RunnerConfig};
use accrue_worker::session::{self, SessionConfig};
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    accrue_worker::init_tracing();
    if let Some(n) = args.threads {
        tch::set_num_threads(n.max(1));
    }
    let (listener, advertised) = session::bind_collective(&args.collective_listen)?;
    let mut cfg = SessionConfig::new(&args.coordinator);
    cfg.collective_addr = advertised;
    cfg.exit_on_release = args.exit_on_release;
    cfg.peak_flops = session::peak_flops(args.peak_tflops);
    let mut parts = RunnerConfig::new(runner::default_factory());
    parts.listener = Some(listener);
    session::run(cfg, parts).await
}
