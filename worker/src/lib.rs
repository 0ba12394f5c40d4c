//! Accrue worker: runs the coordinator's step plans (forward/backward over
//! padding-free packed microbatches, exact accumulation, optimizer step) with
//! libtorch through `tch`. The only crate that links libtorch.

pub mod batch;
pub mod collective;
pub mod config;
pub mod convert;
pub mod device;
pub mod error;
pub mod generate;
pub mod gpu_memory;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod objective;
pub mod runner;
pub mod session;
pub mod train;

pub use accrue_proto::v1 as wire;

/// Installs the `tracing` subscriber on stderr (RUST_LOG, default `info`).
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Plain text when logging to a file (accrue local's worker logs).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
