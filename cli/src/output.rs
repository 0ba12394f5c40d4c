//! Where the CLI prints. `println!` panics when stdout is a pipe whose
//! reader has gone (`accrue steps JOB --detail --json | head -1`: Rust
//! ignores SIGPIPE, so the write fails with EPIPE instead of killing the
//! process). Every command prints through `outln!` and `out!`, which
//! return the write error; `main` ends quietly with
//! [`BROKEN_PIPE_EXIT`] when [`is_broken_pipe`] says the reader has gone.
//! Diagnostics go through `errln!`, which drops what it cannot write
//! (there is nowhere left to say so).

/// The exit status of a command whose reader stopped reading: 128 +
/// SIGPIPE, what a shell reports for `yes | head -1`. Not 0: the command
/// did not run to its end (a `watch` did not see the job finish).
pub const BROKEN_PIPE_EXIT: u8 = 141;

/// `writeln!` to stdout, returning `std::io::Result<()>`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `write!` to stdout, returning `std::io::Result<()>`.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `writeln!` to stderr; a failed write is dropped.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

pub(crate) use {errln, out, outln};

/// True when `e` comes from writing to a pipe whose reader has gone.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_pipe_is_recognised_through_context() {
        let e = anyhow::Error::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
            .context("printing the steps");
        assert!(is_broken_pipe(&e));
        let other = anyhow::Error::from(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(!is_broken_pipe(&other));
        assert!(!is_broken_pipe(&anyhow::anyhow!("broken pipe")));
    }
}
