//! `accrue-worker`: one training process. Registers with the coordinator,
//! runs the step plans it is sent, and exits when released.

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
    /// Address peers reach this worker's collective endpoint on.
    #[arg(long, default_value = "")]
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
    let mut cfg = SessionConfig::new(&args.coordinator);
    cfg.collective_addr = args.collective_listen;
    cfg.exit_on_release = args.exit_on_release;
    cfg.peak_flops = session::peak_flops(args.peak_tflops);
    session::run(cfg, accrue_worker::runner::default_factory()).await
}
