//! `[rl.env] kind = "command"` (issue 36): a program of the user's is the
//! environment of a job's episodes. One process per job, started when its
//! first turn is stepped, its episodes multiplexed by id, speaking JSON
//! lines on stdin/stdout:
//!
//! - `{"type": "reset", "episode": ID, "prompt": TEXT, "reference": REF}`
//!   before an episode's first step (no answer): start episode ID afresh;
//! - `{"type": "step", "episode": ID, "turn": N, "content": TEXT}`: the
//!   policy's N-th turn; answered by one line
//!   `{"episode": ID, "messages": [{"role": "tool"|"user", "content": S}, …]}`
//!   to go on, or `{"episode": ID, "done": true}` to end it, with an
//!   optional `"reward": x`, `"correct": bool` and `"components": {name: x}`
//!   (a reward replaces the verifier's for that episode);
//! - `{"type": "close", "episode": ID}` once an episode ended (no answer).
//!
//! Steps may be answered in any order, and other episodes' steps (of the
//! next waves) may come before a slow one is answered: each answer goes
//! to the core as it arrives, so an episode waiting on a slow tool holds
//! no other. What the protocol guarantees: an episode is reset before its
//! first step and stepped once per policy turn, in order; its ID is new
//! for every attempt (a round lost with a worker or with the coordinator
//! starts its episodes again under new IDs, from a reset — never from a
//! half-recorded prefix), so an environment never has to replay anything;
//! an episode abandoned that way is never closed, and a restarted
//! coordinator starts a new process. State that must outlive the process
//! (a sandbox) is the environment's to keep.
//!
//! Fenced like the `command` verifier (`crate::rl::verify::command`): a
//! cleared environment but for `command::BASE_ENV` and `rl.env.env`, a process
//! group of its own killed when the job's scorer goes, a deadline per
//! step (`rl.env.timeout_s`, default 60 s), lines of at most
//! [`MAX_LINE_BYTES`], stderr logged (cut short) and never quoted in an
//! error; an answer that is not JSON, or names an episode not waiting for
//! one (never stepped, or answered already), fails the job naming the
//! episode or the line.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::ChildStdin;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};
use tracing::{debug, warn};

use crate::job::environment::EnvSection;
use crate::rl::verify::command;
use crate::rl::verify::process::Group;
use crate::rl::verify::Score;

/// Longest line the program may write (a step's messages).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Default seconds a turn's steps may take.
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;
/// How long after an answer the answers that follow it are gathered
/// before they go on together ([`CommandEnv::step_each`]).
const ANSWER_LINGER: Duration = Duration::from_millis(10);
/// Lines of the program's stderr the log keeps (each cut to 4 KiB).
const STDERR_LINES_LOGGED: usize = 64;

/// One episode's step, as the environment is asked it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepIn<'a> {
    pub episode: &'a str,
    /// 1 for the first policy turn: the episode is reset first.
    pub turn: u32,
    pub content: &'a str,
    pub prompt: &'a str,
    pub reference: &'a str,
}

/// The environment's answer to a step.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOut {
    /// Go on with these messages (role, content).
    Messages(Vec<(String, String)>),
    /// The episode ended, with the environment's score if it gave one.
    Done(Option<Score>),
}

/// Why the environment program failed a turn.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("environment command {program:?} could not start: {error}")]
    Start {
        program: String,
        error: std::io::Error,
    },
    #[error("environment command {program:?} exited (or closed its stdout) with {waiting} steps unanswered")]
    Exited { program: String, waiting: usize },
    #[error("environment command {program:?} did not answer {waiting} steps within {timeout:?}")]
    TimedOut {
        program: String,
        waiting: usize,
        timeout: Duration,
    },
    /// Two calls stepped one episode at once (the core steps an episode
    /// once per turn: a bug).
    #[error("environment command {program:?}: episode {episode:?} stepped while a step of it waits for its answer")]
    Twice { program: String, episode: String },
    /// A bad answer; `line` counts the program's stdout lines from 1.
    #[error("environment command {program:?}: stdout line {line}: {problem}")]
    BadLine {
        program: String,
        line: u64,
        problem: String,
    },
}

/// A job's environment program.
pub struct CommandEnv {
    argv: Vec<String>,
    env: Vec<String>,
    base_dir: Option<PathBuf>,
    timeout: Duration,
    running: Mutex<Option<Arc<Running>>>,
}

struct Running {
    /// Killed (with whatever it started) when taken or dropped.
    group: Mutex<Option<Group>>,
    /// What to write to the program's stdin, in order, by a thread of its
    /// own: a program that stops reading never blocks the caller (the
    /// step's deadline catches it).
    stdin: mpsc::Sender<Vec<u8>>,
    /// Shared with the thread that reads the program's answers.
    waiting: Arc<Mutex<Waiting>>,
}

/// The steps asked of the program and not answered yet.
#[derive(Default)]
struct Waiting {
    /// By episode: where its answer goes (the asking call).
    by_episode: HashMap<String, mpsc::Sender<Heard>>,
    /// Set once the program broke; every step fails with it.
    broken: Option<Broke>,
}

/// What the reading thread tells a step call.
enum Heard {
    Answer(String, StepOut),
    Broke(Broke),
}

/// How the program broke (its line number counts its stdout from 1).
#[derive(Debug, Clone)]
enum Broke {
    Exited,
    BadLine { line: u64, problem: String },
}

impl CommandEnv {
    pub fn new(section: &EnvSection, base_dir: Option<PathBuf>) -> CommandEnv {
        CommandEnv {
            argv: section.command.clone(),
            env: section.env.clone(),
            base_dir: section.workdir.clone().or(base_dir),
            timeout: Duration::from_secs_f64(section.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S)),
            running: Mutex::new(None),
        }
    }

    fn program(&self) -> String {
        self.argv.first().cloned().unwrap_or_default()
    }

    fn start(&self) -> Result<Running, EnvError> {
        let program = self.program();
        let mut cmd = command::fenced(&self.argv, &self.env, self.base_dir.as_deref());
        let mut child = cmd.spawn().map_err(|error| EnvError::Start {
            program: program.clone(),
            error,
        })?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        let waiting = Arc::new(Mutex::new(Waiting::default()));
        let w = waiting.clone();
        std::thread::spawn(move || dispatch(stdout, &w));
        let name = program.clone();
        std::thread::spawn(move || log_stderr(stderr, &name));
        Ok(Running {
            group: Mutex::new(Some(Group::new(child))),
            stdin: write_lines(stdin),
            waiting,
        })
    }

    /// The running program, started when there is none (or it broke).
    fn running(&self) -> Result<Arc<Running>, EnvError> {
        let mut guard = lock(&self.running);
        let broken = guard
            .as_ref()
            .is_some_and(|r| lock(&r.waiting).broken.is_some());
        if guard.is_none() || broken {
            *guard = Some(Arc::new(self.start()?));
        }
        Ok(guard.as_ref().expect("set above").clone())
    }

    /// Kills `run` (its steps in flight fail) and forgets it.
    fn kill(&self, run: &Arc<Running>) {
        drop(lock(&run.group).take());
        let mut guard = lock(&self.running);
        if guard.as_ref().is_some_and(|r| Arc::ptr_eq(r, run)) {
            *guard = None;
        }
    }

    /// Steps every episode of `steps`; the answers in the same order. Any
    /// failure kills the program (the job fails).
    pub fn step(&self, steps: &[StepIn<'_>]) -> Result<Vec<StepOut>, EnvError> {
        let mut answers: Vec<Option<StepOut>> = vec![None; steps.len()];
        self.step_each(steps, |batch| {
            for (i, out) in batch {
                answers[i] = Some(out);
            }
        })?;
        Ok(answers
            .into_iter()
            .map(|a| a.expect("all answered"))
            .collect())
    }

    /// Steps every episode of `steps`, handing `deliver` the answers as
    /// they arrive (with their index in `steps`; those read together in
    /// one call). Other calls may step other episodes meanwhile. Any
    /// failure kills the program (the job fails).
    pub fn step_each(
        &self,
        steps: &[StepIn<'_>],
        mut deliver: impl FnMut(Vec<(usize, StepOut)>),
    ) -> Result<(), EnvError> {
        let program = self.program();
        let run = self.running()?;
        let (tx, rx) = mpsc::channel();
        {
            let mut w = lock(&run.waiting);
            if let Some(b) = &w.broken {
                return Err(b.clone().into_error(program, steps.len()));
            }
            for s in steps {
                if w.by_episode.contains_key(s.episode) {
                    return Err(EnvError::Twice {
                        program,
                        episode: s.episode.to_string(),
                    });
                }
            }
            for s in steps {
                w.by_episode.insert(s.episode.to_string(), tx.clone());
            }
        }
        drop(tx);
        let mut out = Vec::new();
        for s in steps {
            if s.turn == 1 {
                let reset = json!({"type": "reset", "episode": s.episode, "prompt": s.prompt, "reference": s.reference});
                writeln!(out, "{reset}").expect("to memory");
            }
            let step =
                json!({"type": "step", "episode": s.episode, "turn": s.turn, "content": s.content});
            writeln!(out, "{step}").expect("to memory");
        }
        // The program reads as we write; it may answer before the last
        // step is in (a pipe is bounded): the writer thread writes it. A
        // program that stopped reading or went away shows as a timeout or
        // the end of its stdout below.
        if run.stdin.send(out).is_err() {
            self.kill(&run);
            return Err(EnvError::Exited {
                program,
                waiting: steps.len(),
            });
        }
        let index: HashMap<&str, usize> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.episode, i))
            .collect();
        let mut waiting = steps.len();
        let deadline = Instant::now().checked_add(self.timeout);
        while waiting > 0 {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            let first = match rx.recv_timeout(left) {
                Ok(h) => h,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.kill(&run);
                    return Err(EnvError::TimedOut {
                        program,
                        waiting,
                        timeout: self.timeout,
                    });
                }
                // (The reader tells every waiting call before it goes.)
                Err(mpsc::RecvTimeoutError::Disconnected) => Heard::Broke(Broke::Exited),
            };
            // Answers read within a short while of each other go on
            // together: a wave of one episode each would split the batch
            // the workers decode (answers arriving apart by more than
            // this go in waves of their own, not held back).
            let linger = Instant::now() + ANSWER_LINGER;
            let mut batch = Vec::new();
            let mut next = Some(first);
            while let Some(heard) = next.take() {
                match heard {
                    Heard::Answer(episode, answer) => {
                        batch.push((index[episode.as_str()], answer));
                        waiting -= 1;
                    }
                    Heard::Broke(b) => {
                        self.kill(&run);
                        return Err(b.into_error(program, waiting));
                    }
                }
                if waiting > 0 {
                    let left = linger.saturating_duration_since(Instant::now());
                    next = rx.recv_timeout(left).ok();
                }
            }
            deliver(batch);
        }
        Ok(())
    }

    /// Tells the program these episodes ended (best effort: a program
    /// that went away is found at the next step).
    pub fn close(&self, episodes: &[&str]) {
        let guard = lock(&self.running);
        if let Some(run) = guard.as_ref() {
            let mut out = Vec::new();
            for e in episodes {
                writeln!(out, "{}", json!({"type": "close", "episode": e})).expect("to memory");
            }
            let _ = run.stdin.send(out);
        }
    }
}

impl Broke {
    fn into_error(self, program: String, waiting: usize) -> EnvError {
        match self {
            Broke::Exited => EnvError::Exited { program, waiting },
            Broke::BadLine { line, problem } => EnvError::BadLine {
                program,
                line,
                problem,
            },
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads the program's stdout (lines of at most [`MAX_LINE_BYTES`]) and
/// hands each answer to the call waiting for its episode, until the
/// program breaks: it exits, or writes a line that is not an answer to a
/// waiting step; then every waiting call, and every later one, is told.
fn dispatch(stdout: impl Read, waiting: &Mutex<Waiting>) {
    let mut r = BufReader::new(stdout);
    let mut read = 0u64;
    let broke = loop {
        let mut line = Vec::new();
        let got = (&mut r)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut line);
        read += 1;
        let bad = |problem: String| Broke::BadLine {
            line: read,
            problem,
        };
        match got {
            Ok(0) => break Broke::Exited,
            Ok(_) if line.len() > MAX_LINE_BYTES => {
                break bad(format!("a line longer than {MAX_LINE_BYTES} bytes"))
            }
            Ok(_) => {}
            Err(e) => break bad(e.to_string()),
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let (episode, answer) = match parse_answer(&line) {
            Ok(a) => a,
            Err(problem) => break bad(problem),
        };
        let to = lock(waiting).by_episode.remove(&episode);
        let Some(to) = to else {
            break bad(format!(
                "answers episode {episode:?}, which is not waiting for an answer (never stepped, or answered already)"
            ));
        };
        // A call that gave up (its deadline) is gone: nothing to tell.
        let _ = to.send(Heard::Answer(episode, answer));
    };
    let mut w = lock(waiting);
    w.broken = Some(broke.clone());
    for (_, to) in w.by_episode.drain() {
        let _ = to.send(Heard::Broke(broke.clone()));
    }
}

/// One answer line: (episode, what it says).
fn parse_answer(line: &[u8]) -> Result<(String, StepOut), String> {
    let v: Json = serde_json::from_slice(line).map_err(|e| format!("not JSON ({e})"))?;
    let o = v.as_object().ok_or("not a JSON object")?;
    let episode = o
        .get("episode")
        .and_then(Json::as_str)
        .ok_or("no \"episode\" string")?
        .to_string();
    let at = |m: String| format!("episode {episode:?}: {m}");
    let done = match o.get("done") {
        None | Some(Json::Null) => false,
        Some(Json::Bool(b)) => *b,
        Some(_) => return Err(at("\"done\" must be true or false".into())),
    };
    if done {
        let reward = match o.get("reward") {
            None | Some(Json::Null) => None,
            Some(x) => Some(
                x.as_f64()
                    .filter(|r| r.is_finite())
                    .ok_or_else(|| at("\"reward\" must be a finite number".into()))?,
            ),
        };
        let correct = match o.get("correct") {
            None | Some(Json::Null) => None,
            Some(Json::Bool(b)) => Some(*b),
            Some(_) => return Err(at("\"correct\" must be true or false".into())),
        };
        let mut components = BTreeMap::new();
        if let Some(c) = o.get("components") {
            let c = c
                .as_object()
                .ok_or_else(|| at("\"components\" must be an object of numbers".into()))?;
            for (k, x) in c {
                let x = x
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| at(format!("component {k:?} must be a finite number")))?;
                components.insert(k.clone(), x);
            }
        }
        if reward.is_none() && (correct.is_some() || !components.is_empty()) {
            return Err(at(
                "\"correct\" and \"components\" come with a \"reward\"".into()
            ));
        }
        let score = reward.map(|reward| Score {
            reward,
            components,
            correct,
        });
        return Ok((episode, StepOut::Done(score)));
    }
    let msgs = o.get("messages").and_then(Json::as_array).ok_or_else(|| {
        at(
            "an episode that goes on needs \"messages\" (a list); send \"done\": true to end it"
                .into(),
        )
    })?;
    if msgs.is_empty() {
        return Err(at(
            "\"messages\" is empty: the policy would be asked again with nothing new".into(),
        ));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role").and_then(Json::as_str);
        let content = m.get("content").and_then(Json::as_str);
        match (role, content) {
            (Some(r @ ("tool" | "user" | "system")), Some(c)) => {
                out.push((r.to_string(), c.to_string()))
            }
            _ => {
                return Err(at(format!(
                    "messages[{i}] must be {{\"role\": \"tool\" | \"user\" | \"system\", \"content\": string}}"
                )))
            }
        }
    }
    Ok((episode, StepOut::Messages(out)))
}

/// The program's stdin, written by a thread of its own in the order the
/// buffers are sent; it ends when the pipe breaks or the sender goes.
fn write_lines(mut stdin: ChildStdin) -> mpsc::Sender<Vec<u8>> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        for buf in rx {
            if stdin.write_all(&buf).and_then(|()| stdin.flush()).is_err() {
                return;
            }
        }
    });
    tx
}

/// Logs the first lines of the program's stderr (cut to 4 KiB each),
/// counts the rest.
fn log_stderr(stderr: impl Read, program: &str) {
    let mut r = BufReader::new(stderr);
    let (mut n, mut buf) = (0usize, Vec::new());
    loop {
        buf.clear();
        match (&mut r).take(4096).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                n += 1;
                if n <= STDERR_LINES_LOGGED {
                    debug!(program, line = %String::from_utf8_lossy(&buf).trim_end(), "environment command stderr");
                }
            }
        }
    }
    if n > STDERR_LINES_LOGGED {
        warn!(
            program,
            lines = n,
            "environment command wrote more on stderr than the log keeps"
        );
    }
}

#[cfg(test)]
mod tests;
