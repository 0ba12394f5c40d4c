//! `accrue-coordinator`: the coordinator gRPC server.

use std::net::SocketAddr;
use std::path::PathBuf;

use accrue_coordinator::server::{Server, ServerConfig};
use anyhow::Context as _;
use clap::Parser;

/// Accrue coordinator: owns the data stream, plans steps, serves workers and admins.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Address to listen on (gRPC: admin and worker services).
    #[arg(long, default_value = "127.0.0.1:7070", env = "ACCRUE_LISTEN")]
    listen: SocketAddr,
    /// Directory for the coordinator's persistent state.
    #[arg(long, env = "ACCRUE_STATE_DIR")]
    state_dir: PathBuf,
    /// A worker silent for this long (ms) is declared lost.
    #[arg(long, default_value_t = 2000)]
    heartbeat_timeout_ms: i64,
    /// Serve Prometheus metrics (GET /metrics) here; port 0 lets the OS
    /// pick, "off" disables. Default 127.0.0.1:9090, skipped with a warning
    /// when taken.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    accrue_coordinator::init_tracing(args.log_json);
    let mut config = ServerConfig::new(args.listen, args.state_dir);
    config.heartbeat_timeout_ms = args.heartbeat_timeout_ms;
    match args.metrics_listen.as_deref() {
        Some("off") => {}
        Some(a) => config.metrics_listen = Some(a.parse().context("--metrics-listen")?),
        None => {
            config.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 9090)));
            config.metrics_optional = true;
        }
    }
    let server = Server::bind(config).await?;
    // Machine-readable for scripts and tests that pass port 0.
    println!("listening on {}", server.local_addr());
    if let Some(a) = server.metrics_addr() {
        // Not println!: a reader that took only the first line may have
        // closed the pipe, and that must not stop the server.
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), "metrics on {a}");
    }
    let shutdown = accrue_coordinator::shutdown_on_signal();
    server.run(shutdown).await
}
