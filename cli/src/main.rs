//! `accrue`: the command-line client of an Accrue coordinator. See
//! `accrue --help`; the commands live in the `accrue_cli` library.

use std::process::ExitCode;

use accrue_cli as cli;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli::run(cli).await {
        Ok(code) => code,
        // The reader of our output has gone (`accrue ... | head`): nothing
        // to report, and no one to report it to.
        Err(e) if cli::output::is_broken_pipe(&e) => ExitCode::from(cli::output::BROKEN_PIPE_EXIT),
        Err(e) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
