//! The `command` verifier: a user program scores a batch. It reads one
//! JSON object per line on stdin, `{"prompt", "completion", "reference"}`,
//! and writes one line per input line on stdout, in order: a number (the
//! reward) or an object `{"reward": x, "correct": true|false, <name>: x …}`
//! whose other numeric fields are reward components. The batch fails, with
//! the program and the line named, when the program exits non-zero, runs
//! past its timeout (it is killed), or writes a line that is not a finite
//! reward, or too few or too many lines.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value as Json;

use super::sample::{Sample, Score, VerifyError};

/// Runs `argv` over `batch` (see the module doc).
pub fn run(
    argv: &[String],
    base_dir: Option<&Path>,
    timeout: Duration,
    batch: &[Sample<'_>],
) -> Result<Vec<Score>, VerifyError> {
    let program = argv.first().cloned().unwrap_or_default();
    let err = |message: String| VerifyError::Command {
        program: program.clone(),
        message,
    };
    let mut cmd = Command::new(&program);
    cmd.args(&argv[1.min(argv.len())..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = base_dir {
        cmd.current_dir(d);
    }
    let mut child = cmd.spawn().map_err(|e| err(format!("cannot start: {e}")))?;
    let mut input = Vec::new();
    for s in batch {
        serde_json::to_writer(&mut input, s).expect("samples serialise");
        input.push(b'\n');
    }
    // Feed stdin and drain stdout/stderr on threads: a program that writes
    // before it has read everything must not deadlock against us.
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.stdout.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let mut stderr = child.stderr.take().expect("piped");
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait().map_err(|e| err(e.to_string()))? {
            Some(st) => break st,
            None if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err(format!(
                    "timed out after {:.1}s scoring {} completions (rl.verifier.timeout_s)",
                    timeout.as_secs_f64(),
                    batch.len()
                )));
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let _ = writer.join();
    let stdout = out.join().unwrap_or_default();
    let stderr = errs.join().unwrap_or_default();
    if !status.success() {
        let tail: String = stderr.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        return Err(err(format!("exited with {status}; stderr: {tail}")));
    }
    parse(&stdout, batch.len()).map_err(err)
}

/// Parses the program's stdout: exactly `n` score lines.
pub fn parse(stdout: &str, n: usize) -> Result<Vec<Score>, String> {
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() != n {
        return Err(format!(
            "wrote {} score lines for {n} completions (one line per input line expected)",
            lines.len()
        ));
    }
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| line(l).map_err(|m| format!("stdout line {}: {m}: {l:?}", i + 1)))
        .collect()
}

fn line(l: &str) -> Result<Score, String> {
    let v: Json = serde_json::from_str(l.trim()).map_err(|e| format!("not JSON ({e})"))?;
    let finite = |x: Option<f64>, what: &str| match x {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(format!("{what} is not a finite number")),
    };
    match &v {
        Json::Number(n) => Ok(Score {
            reward: finite(n.as_f64(), "the reward")?,
            ..Default::default()
        }),
        Json::Object(o) => {
            let reward = finite(o.get("reward").and_then(Json::as_f64), "\"reward\"")?;
            let correct = match o.get("correct") {
                None | Some(Json::Null) => None,
                Some(Json::Bool(b)) => Some(*b),
                Some(_) => return Err("\"correct\" must be true or false".into()),
            };
            let mut components = BTreeMap::new();
            for (k, x) in o.iter().filter(|(k, _)| *k != "reward" && *k != "correct") {
                components.insert(k.clone(), finite(x.as_f64(), &format!("\"{k}\""))?);
            }
            Ok(Score {
                reward,
                components,
                correct,
            })
        }
        _ => Err("expected a number or an object with \"reward\"".into()),
    }
}
