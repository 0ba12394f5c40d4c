//! The `command` verifier: a user program scores a batch. It reads one
//! JSON object per line on stdin, `{"prompt", "completion", "reference"}`,
//! and writes one line per input line on stdout, in order: a number (the
//! reward) or an object `{"reward": x, "correct": true|false, <name>: x …}`
//! whose other numeric fields are reward components. The batch fails, with
//! the program and the line named, when the program exits non-zero, runs
//! past its timeout, writes more than [`MAX_OUTPUT_BYTES`] on stdout or
//! stderr, or writes a line that is not a finite reward, or too few or too
//! many lines.
//!
//! The program is whatever the spec names, run by the coordinator, so it
//! gets nothing of the coordinator's it was not given:
//! - its environment is [`BASE_ENV`] plus the names in `rl.verifier.env`
//!   (never `ACCRUE_*`: the coordinator's tokens live there), nothing else;
//! - it runs in a process group of its own (`super::process`), killed
//!   whole when the batch ends, so neither a timeout nor a grandchild that
//!   keeps the output pipe open can hang the scoring thread, and nothing it
//!   started outlives its batch;
//! - the timeout covers everything: the program's exit and reading its
//!   output to the end;
//! - what it writes never goes into an error (errors become job reasons,
//!   shown on the unauthenticated status page): errors name the line, the
//!   exit status and byte counts; stderr and bad lines go to the
//!   coordinator log, cut short.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value as Json;
use tracing::{debug, warn};

pub use super::command_error::{CommandError, LineProblem, Stream};
use super::process::{self, Group};
use super::sample::{Sample, Score};
use crate::job::env_names;

/// Variables every program sees, when the coordinator has them: where
/// programs are found and how text is decoded, nothing that holds a
/// secret. Anything else (`PYTHONPATH`, `CUDA_VISIBLE_DEVICES`, a key) is
/// named in `rl.verifier.env`.
pub const BASE_ENV: [&str; 7] = ["PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ"];

/// Bytes a program may write on stdout, and on stderr, per batch: scores
/// are a line each, so this is thousands of lines of room.
pub const MAX_OUTPUT_BYTES: usize = 1 << 20;

/// Bytes of stderr (its end) and of a bad stdout line the log keeps.
const LOG_EXCERPT_BYTES: usize = 4096;

/// How to run the program.
#[derive(Debug, Clone, Copy)]
pub struct Invocation<'a> {
    /// The program and its arguments.
    pub argv: &'a [String],
    /// Variables passed through besides [`BASE_ENV`] (`rl.verifier.env`).
    pub env: &'a [String],
    /// Where a relative program is found (the spec's directory).
    pub base_dir: Option<&'a Path>,
    /// How long a batch may take, output read to its end.
    pub timeout: Duration,
}

/// Runs the program over `batch` (see the module doc).
pub fn run(inv: &Invocation<'_>, batch: &[Sample<'_>]) -> Result<Vec<Score>, CommandError> {
    let program = inv.argv.first().map_or("", String::as_str);
    let mut cmd = fenced(inv.argv, inv.env, inv.base_dir);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(CommandError::Start)?;
    let timed_out = CommandError::TimedOut {
        timeout: inv.timeout,
        completions: batch.len(),
    };
    // A deadline past what an Instant holds is never reached.
    let deadline = start.checked_add(inv.timeout);
    let mut input = Vec::new();
    for s in batch {
        serde_json::to_writer(&mut input, s).expect("samples serialise");
        input.push(b'\n');
    }
    // Feed stdin and drain stdout/stderr on threads: a program that writes
    // before it has read everything must not deadlock against us. They are
    // never joined: one blocked on a pipe that something outside the group
    // holds open must not block us; killing the group closes the rest.
    let mut stdin = child.stdin.take().expect("piped");
    std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let (tx, rx) = mpsc::channel();
    drain(
        child.stdout.take().expect("piped"),
        Stream::Stdout,
        tx.clone(),
    );
    drain(child.stderr.take().expect("piped"), Stream::Stderr, tx);
    let mut group = Group::new(child);
    let left = || {
        deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        })
    };
    // Both streams to their end, then the exit, all before the deadline;
    // any early return drops `group`, which kills it.
    let (mut stdout, mut stderr) = (None, None);
    while stdout.is_none() || stderr.is_none() {
        let (stream, read) = match rx.recv_timeout(left()) {
            Ok(got) => got,
            Err(_) => return Err(timed_out),
        };
        let bytes = read.map_err(|error| CommandError::Read { stream, error })?;
        if bytes.len() > MAX_OUTPUT_BYTES {
            return Err(CommandError::TooMuchOutput {
                stream,
                limit: MAX_OUTPUT_BYTES,
            });
        }
        match stream {
            Stream::Stdout => stdout = Some(bytes),
            Stream::Stderr => stderr = Some(bytes),
        }
    }
    while !group.exited().map_err(CommandError::Wait)? {
        if left().is_zero() {
            return Err(timed_out);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = group.end().map_err(CommandError::Wait)?;
    let (stdout, stderr) = (stdout.unwrap_or_default(), stderr.unwrap_or_default());
    if !status.success() {
        warn!(program, %status, stderr = %excerpt(&stderr, true), "verifier command failed");
        return Err(CommandError::Exit {
            status,
            stderr_bytes: stderr.len(),
        });
    }
    if !stderr.is_empty() {
        debug!(program, stderr = %excerpt(&stderr, true), "verifier command wrote on stderr");
    }
    let stdout = String::from_utf8_lossy(&stdout);
    parse(&stdout, batch.len()).inspect_err(|e| {
        if let CommandError::BadLine { line, .. } = e {
            let text = stdout
                .lines()
                .filter(|l| !l.trim().is_empty())
                .nth(line - 1);
            let text = excerpt(text.unwrap_or_default().as_bytes(), false);
            warn!(program, line, %text, error = %e, "verifier command wrote a bad score line");
        }
    })
}

/// A user program (`argv`) ready to spawn fenced: piped stdin, stdout
/// and stderr, an environment of [`BASE_ENV`] and `env` alone (never
/// `ACCRUE_*`), run from `base_dir`, in a process group of its own. The
/// verifier and an environment program (`crate::rl::env_command`) start
/// alike.
pub fn fenced(argv: &[String], env: &[String], base_dir: Option<&Path>) -> Command {
    let mut cmd = Command::new(argv.first().map_or("", String::as_str));
    cmd.args(argv.get(1..).unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_clear();
    // Refused names are checked at submit too; a stored spec from before
    // that check must not reach them either.
    let names = BASE_ENV
        .iter()
        .copied()
        .chain(env.iter().map(String::as_str));
    for name in names.filter(|n| env_names::refused(n).is_none()) {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    if let Some(d) = base_dir {
        cmd.current_dir(d);
    }
    process::isolate(&mut cmd);
    cmd
}

/// Reads `r` to its end on a thread, at most one byte over the limit (so
/// that going over shows), and sends what it read.
fn drain(
    r: impl Read + Send + 'static,
    stream: Stream,
    tx: mpsc::Sender<(Stream, std::io::Result<Vec<u8>>)>,
) {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let read = r
            .take(MAX_OUTPUT_BYTES as u64 + 1)
            .read_to_end(&mut buf)
            .map(|_| buf);
        let _ = tx.send((stream, read));
    });
}

/// At most [`LOG_EXCERPT_BYTES`] of `bytes` for the log: the end (where
/// a traceback's error is) or the start.
fn excerpt(bytes: &[u8], end: bool) -> String {
    let n = bytes.len().min(LOG_EXCERPT_BYTES);
    let cut = if end {
        &bytes[bytes.len() - n..]
    } else {
        &bytes[..n]
    };
    String::from_utf8_lossy(cut).into_owned()
}

/// Parses the program's stdout: exactly `n` score lines.
pub fn parse(stdout: &str, n: usize) -> Result<Vec<Score>, CommandError> {
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() != n {
        return Err(CommandError::LineCount {
            got: lines.len(),
            want: n,
        });
    }
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            line(l).map_err(|problem| CommandError::BadLine {
                line: i + 1,
                bytes: l.len(),
                problem,
            })
        })
        .collect()
}

fn line(l: &str) -> Result<Score, LineProblem> {
    let v: Json = serde_json::from_str(l.trim()).map_err(LineProblem::NotJson)?;
    let finite = |x: Option<f64>, problem: LineProblem| match x {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(problem),
    };
    match &v {
        Json::Number(n) => Ok(Score {
            reward: finite(n.as_f64(), LineProblem::Reward)?,
            ..Default::default()
        }),
        Json::Object(o) => {
            let reward = finite(o.get("reward").and_then(Json::as_f64), LineProblem::Reward)?;
            let correct = match o.get("correct") {
                None | Some(Json::Null) => None,
                Some(Json::Bool(b)) => Some(*b),
                Some(_) => return Err(LineProblem::Correct),
            };
            let mut components = BTreeMap::new();
            for (k, x) in o.iter().filter(|(k, _)| *k != "reward" && *k != "correct") {
                components.insert(k.clone(), finite(x.as_f64(), LineProblem::Component)?);
            }
            Ok(Score {
                reward,
                components,
                correct,
            })
        }
        _ => Err(LineProblem::Shape),
    }
}
