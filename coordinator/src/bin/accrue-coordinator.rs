//! `accrue-coordinator`: the coordinator gRPC server.

use std::net::SocketAddr;
use std::path::PathBuf;

use accrue_coordinator::shell::auth;
use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::shell::tls::ServerTls;
use clap::Parser;

/// Accrue coordinator: owns the data stream, plans steps, serves workers and admins.
#[derive(Parser)]
#[command(version, after_help = accrue_coordinator::job::locate::CACHE_ENV_HELP)]
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
    /// Generations of at least this many workers relay the coordinator's
    /// messages through hub workers (one message per hub instead of one
    /// per worker), when every member can; 0: never.
    #[arg(long, default_value_t = accrue_coordinator::core::RELAY_MIN_WORLD)]
    relay_min_world: u32,
    /// Serve Prometheus metrics (GET /metrics) here; port 0 lets the OS
    /// pick, "off" disables. Default 127.0.0.1:9090, skipped with a warning
    /// when taken.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Serve the OpenAI-compatible endpoint of jobs with [rl.serve] here
    /// (/jobs/JOB/v1/chat/completions; port 0 lets the OS pick). Off by
    /// default.
    #[arg(long, value_name = "ADDR")]
    serve_listen: Option<std::net::SocketAddr>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
    #[command(flatten)]
    security: SecurityArgs,
}

/// Tokens, TLS and limits (README "Security").
#[derive(clap::Args)]
struct SecurityArgs {
    /// File holding the admin token (wins over $ACCRUE_ADMIN_TOKEN).
    #[arg(long, value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// File holding the worker token (wins over $ACCRUE_WORKER_TOKEN).
    #[arg(long, value_name = "FILE")]
    worker_token_file: Option<PathBuf>,
    /// Serve without tokens on a non-loopback --listen address.
    #[arg(long)]
    insecure_no_auth: bool,
    /// PEM certificate chain: serve TLS (with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA bundle: require client certificates it signed (mutual TLS).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Largest gRPC message accepted or sent, in MiB.
    #[arg(long, value_name = "MB", default_value_t = auth::DEFAULT_MAX_MESSAGE_MB,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    max_message_mb: usize,
}

impl SecurityArgs {
    fn into_security(self) -> anyhow::Result<auth::Security> {
        let env = |k: &str| std::env::var(k).ok();
        let tokens = auth::Tokens {
            admin: auth::resolve_token(
                auth::ADMIN_TOKEN_ENV,
                env(auth::ADMIN_TOKEN_ENV).as_deref(),
                self.admin_token_file.as_deref(),
            )?,
            worker: auth::resolve_token(
                auth::WORKER_TOKEN_ENV,
                env(auth::WORKER_TOKEN_ENV).as_deref(),
                self.worker_token_file.as_deref(),
            )?,
        };
        let tls = match (self.tls_cert, self.tls_key) {
            (Some(cert), Some(key)) => Some(ServerTls {
                cert,
                key,
                client_ca: self.tls_client_ca,
            }),
            _ => None,
        };
        Ok(auth::Security {
            tokens,
            insecure_no_auth: self.insecure_no_auth,
            tls,
            max_message_bytes: self.max_message_mb << 20,
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    accrue_coordinator::init_tracing(args.log_json);
    let mut config = ServerConfig::new(args.listen, args.state_dir);
    config.heartbeat_timeout_ms = args.heartbeat_timeout_ms;
    config.relay_min_world = args.relay_min_world;
    config.security = args.security.into_security()?;
    config.metrics_from_flag(args.metrics_listen.as_deref())?;
    config.serve_listen = args.serve_listen;
    let server = Server::bind(config).await?;
    // Machine-readable for scripts and tests that pass port 0. Not
    // println!: stdout may be closed or a pipe whose reader has gone (a
    // supervisor that took the first line), and that must not stop the
    // server (println! panics on EPIPE); the logs on stderr say the same.
    {
        use std::io::Write as _;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on {}", server.local_addr());
        if let Some(a) = server.metrics_addr() {
            let _ = writeln!(out, "metrics on {a}");
        }
        if let Some(a) = server.serve_addr() {
            let _ = writeln!(out, "endpoint on {a}");
        }
    }
    let shutdown = accrue_coordinator::shutdown_on_signal();
    server.run(shutdown).await
}
