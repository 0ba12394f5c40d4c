//! Accrue coordinator: owns the data stream, plans steps, tracks jobs and
//! workers, and serves the admin and worker gRPC APIs.
//!
//! One folder per layer, bottom first; a layer imports only those below it
//! (`tests/tests/layering.rs` checks it):
//! - [`job`]: the job spec, its sections and their validation, live
//!   settings, sources, limits;
//! - [`stream`]: documents, the data readers and token cache, the cursor,
//!   mixtures, and the packer;
//! - [`model`]: Hugging Face model folders (config, export);
//! - [`rl`]: the RL loop's state, scoring and engine calls (below the
//!   core) and the core's handlers of its events (above it);
//! - [`core`]: the pure state machine;
//! - [`shell`]: the server, its services, HTTP, the store, auth, TLS,
//!   metrics and tracking, and admission.

pub mod core;
pub mod job;
pub mod model;
pub mod rl;
pub mod shell;
pub mod stream;

pub use accrue_proto::v1 as wire;

/// Installs the `tracing` subscriber (RUST_LOG filter, default `info`).
pub fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // No colour codes in a log file or pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> tokio_util::sync::CancellationToken {
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing a SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown requested");
        t.cancel();
    });
    token
}
