//! `accrue-coordinator`: the coordinator gRPC server.

use std::net::SocketAddr;
use std::path::PathBuf;

use accrue_coordinator::server::{Server, ServerConfig};
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
    let server = Server::bind(config).await?;
    // Machine-readable for scripts and tests that pass port 0.
    println!("listening on {}", server.local_addr());
    let shutdown = accrue_coordinator::shutdown_on_signal();
    server.run(shutdown).await
}
