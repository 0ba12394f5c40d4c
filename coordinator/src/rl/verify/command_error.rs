//! Why a command verifier did not score a batch ([`CommandError`]), apart
//! from running it (`super::command`), so that a sample's score can carry
//! it without importing the runner. Never holds what the program wrote:
//! that is in the coordinator log.

use std::process::ExitStatus;
use std::time::Duration;

/// One of the program's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        })
    }
}

/// Why the program did not score a batch. Never holds what it wrote (see
/// the module doc): that is in the coordinator log.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("cannot start: {0}")]
    Start(std::io::Error),
    #[error("waiting for it: {0}")]
    Wait(std::io::Error),
    #[error("reading its {stream}: {error}")]
    Read {
        stream: Stream,
        error: std::io::Error,
    },
    #[error("exited with {status} ({stderr_bytes} bytes on stderr, in the coordinator log)")]
    Exit {
        status: ExitStatus,
        stderr_bytes: usize,
    },
    #[error(
        "timed out after {:.1}s scoring {completions} completions (rl.verifier.timeout_s)",
        timeout.as_secs_f64()
    )]
    TimedOut {
        timeout: Duration,
        completions: usize,
    },
    #[error("wrote more than {limit} bytes on {stream}, the limit per batch")]
    TooMuchOutput { stream: Stream, limit: usize },
    #[error("wrote {got} score lines for {want} completions (one line per input line expected)")]
    LineCount { got: usize, want: usize },
    #[error("stdout line {line}: {problem} (the line, {bytes} bytes, is in the coordinator log)")]
    BadLine {
        /// 1-based, counting non-blank lines: line n scores sample n - 1.
        line: usize,
        bytes: usize,
        problem: LineProblem,
    },
}

impl CommandError {
    /// The sample (index in the batch) the error is about, if one.
    pub fn sample(&self) -> Option<usize> {
        match self {
            CommandError::BadLine { line, .. } => Some(line - 1),
            _ => None,
        }
    }
}

/// What is wrong with a score line.
#[derive(Debug, thiserror::Error)]
pub enum LineProblem {
    /// serde_json's syntax errors name a position, never the text.
    #[error("not JSON ({0})")]
    NotJson(serde_json::Error),
    #[error("expected a number or an object with \"reward\"")]
    Shape,
    #[error("the reward is not a finite number")]
    Reward,
    #[error("\"correct\" must be true or false")]
    Correct,
    /// The component is not named: its name is the program's output too.
    #[error("a reward component is not a finite number")]
    Component,
}
