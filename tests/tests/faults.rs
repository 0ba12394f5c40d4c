//! Fault injection (issue 6 "Done means"): a real `accrue-coordinator` and
//! 2–3 real `accrue-worker` processes on 127.0.0.1 train a tiny Llama
//! (hidden 64, 2 layers, fp32) while the test kills, freezes, adds or drains
//! workers, or kills the coordinator. For every case the job must complete,
//! every document of the epoch must be trained exactly once (from the
//! coordinator's per-step manifests), and the final parameters must equal
//! those of an uninterrupted run of the same job: per tensor
//! ‖a − b‖ ≤ 1e-5·‖b‖.
//!
//! Faults land at exact points through the worker's `ACCRUE_FAULT` hook: the
//! worker stops itself (SIGSTOP) at the named point and the test then sends
//! SIGKILL (or SIGCONT). The processes are heavy for a 2-core machine, so the
//! cases run one at a time (a global lock).
//!
//! Needs the venv with torch (scripts/setup.sh) and `scripts/env.sh` sourced
//! for the worker build (scripts/test.sh does both).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use accrue_coordinator::manifest::{check_exactly_once, Expectation, StepManifest};

mod real;

use real::{bin_dir, write_tiny_config};

/// One case at a time: each runs 3–4 processes on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill -{sig} {pid} failed");
}

/// The job every case trains: 8 steps of 12 documents over 96 rows (one
/// epoch), checkpoints every 3 steps, workers lost after 2 s of silence.
fn write_job(d: &Path, name: &str, sharding: &str, max_workers: u32) -> PathBuf {
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 7
steps = 8
output_dir = "out/{name}"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["data/arith-sft.jsonl"]
format = "sft"
max_tokens = 256
[batch]
docs_per_step = 12
[optimizer]
lr = 3e-3
warmup_steps = 1
eps = 1e-6
[parallel]
sharding = "{sharding}"
min_workers = 1
max_workers = {max_workers}
[checkpoint]
every_steps = 3
"#
    );
    let path = d.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// A coordinator, its workers and a working directory holding the data, the
/// job specs, the outputs and every process's log.
struct Cluster {
    dir: tempfile::TempDir,
    /// The coordinator's `--heartbeat-timeout-ms` (None: its 2 s default).
    heartbeat_ms: Option<u64>,
    coord: Option<Child>,
    addr: String,
    workers: Vec<Child>,
}

impl Cluster {
    fn new() -> Cluster {
        Self::with_heartbeat(None)
    }

    fn with_heartbeat(heartbeat_ms: Option<u64>) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("logs")).unwrap();
        write_tiny_config(d);
        let synth = ["data", "synth", "--task", "arithmetic", "--out", "data"];
        let out = Command::new(bin_dir().join("accrue"))
            .args(synth)
            .args(["--rows", "96"])
            .current_dir(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "data synth: {out:?}");
        let mut c = Cluster {
            dir,
            heartbeat_ms,
            coord: None,
            addr: "127.0.0.1:0".into(),
            workers: Vec::new(),
        };
        c.start_coordinator();
        c
    }

    fn d(&self) -> &Path {
        self.dir.path()
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts the coordinator on the cluster's state dir (on its previous
    /// address after a restart, so workers find it again).
    fn start_coordinator(&mut self) {
        let n = std::fs::read_dir(self.d().join("logs")).unwrap().count();
        let log =
            std::fs::File::create(self.d().join(format!("logs/coordinator-{n}.log"))).unwrap();
        let mut cmd = Command::new(bin_dir().join("accrue-coordinator"));
        if let Some(ms) = self.heartbeat_ms {
            cmd.args(["--heartbeat-timeout-ms", &ms.to_string()]);
        }
        let mut child = cmd
            .args(["--listen", &self.addr, "--state-dir"])
            .arg(self.d().join("state"))
            .env("RUST_LOG", "info")
            .current_dir(self.d())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("starting accrue-coordinator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        self.addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        self.coord = Some(child);
    }

    fn kill_coordinator(&mut self) {
        let mut c = self.coord.take().expect("a running coordinator");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Starts a worker (index = its position in `workers`), with an
    /// `ACCRUE_FAULT` hook if given. Its log is logs/worker-<i>.log.
    fn start_worker(&mut self, fault: Option<&str>) -> usize {
        let i = self.workers.len();
        let log = std::fs::File::create(self.log_path(i)).unwrap();
        let mut cmd = Command::new(bin_dir().join("accrue-worker"));
        cmd.args([
            "--coordinator",
            &self.url(),
            "--threads",
            "1",
            "--peak-tflops",
            "1",
        ])
        .env("RUST_LOG", "info")
        .env("ACCRUE_COLLECTIVE_TIMEOUT_S", "20")
        .current_dir(self.d())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
        if let Some(f) = fault {
            cmd.env("ACCRUE_FAULT", f);
        }
        self.workers
            .push(cmd.spawn().expect("starting accrue-worker"));
        i
    }

    fn log_path(&self, worker: usize) -> PathBuf {
        self.d().join(format!("logs/worker-{worker}.log"))
    }

    fn log(&self, worker: usize) -> String {
        std::fs::read_to_string(self.log_path(worker)).unwrap_or_default()
    }

    /// Waits until worker `i`'s log contains `needle`.
    fn wait_log(&self, i: usize, needle: &str, timeout: Duration) {
        let t0 = Instant::now();
        while !self.log(i).contains(needle) {
            assert!(
                t0.elapsed() < timeout,
                "worker {i} never logged {needle:?} in {timeout:?}:\n{}\n{}",
                self.log(i),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pid(&self, i: usize) -> u32 {
        self.workers[i].id()
    }

    /// `kill -9` of worker `i`.
    fn kill_worker(&mut self, i: usize) {
        self.workers[i].kill().unwrap();
        self.workers[i].wait().unwrap();
    }

    fn accrue(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin_dir().join("accrue"))
            .args(["--coordinator", &self.url()])
            .args(args)
            .current_dir(self.d())
            .output()
            .expect("running accrue")
    }

    fn accrue_ok(&self, args: &[&str]) -> String {
        let out = self.accrue(args);
        assert!(
            out.status.success(),
            "accrue {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until `n` workers are registered (so the job starts at world
    /// `n` rather than growing from the first one).
    fn wait_workers(&self, n: usize) {
        let t0 = Instant::now();
        loop {
            let w: serde_json::Value =
                serde_json::from_str(&self.accrue_ok(&["workers", "--json"])).unwrap();
            let idle = w
                .as_array()
                .unwrap()
                .iter()
                .filter(|w| w["state"] == "idle")
                .count();
            if idle >= n {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "{n} workers: {w}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn submit(&self, spec: &Path) -> String {
        self.wait_workers(self.workers.len());
        self.accrue_ok(&["submit", spec.to_str().unwrap()])
            .trim()
            .to_string()
    }

    fn job(&self, id: &str) -> serde_json::Value {
        let jobs: serde_json::Value =
            serde_json::from_str(&self.accrue_ok(&["jobs", "--json"])).unwrap();
        jobs.as_array()
            .unwrap()
            .iter()
            .find(|j| j["job_id"] == id)
            .unwrap_or_else(|| panic!("job {id} not listed: {jobs}"))
            .clone()
    }

    /// Waits until the job has committed at least `step` steps.
    fn wait_step(&self, id: &str, step: u64, timeout: Duration) {
        let t0 = Instant::now();
        loop {
            let j = self.job(id);
            if j["step"].as_u64().unwrap_or(0) >= step {
                return;
            }
            assert!(
                j["state"] != "failed" && j["state"] != "cancelled",
                "job ended early: {j}\n{}",
                self.logs()
            );
            assert!(
                t0.elapsed() < timeout,
                "step {step} not reached: {j}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the job to end; asserts it completed.
    fn wait_completed(&self, id: &str, timeout: Duration) {
        let t0 = Instant::now();
        loop {
            let j = self.job(id);
            match j["state"].as_str().unwrap() {
                "completed" => return,
                "failed" | "cancelled" => panic!("job ended {j}\n{}", self.logs()),
                _ => {}
            }
            assert!(
                t0.elapsed() < timeout,
                "job not done in {timeout:?}: {j}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every process's log, for failure messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        let mut entries: Vec<_> = std::fs::read_dir(self.d().join("logs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out += &format!("---- {} (last 40 lines)\n", p.display());
            for l in tail.into_iter().rev() {
                out += l;
                out.push('\n');
            }
        }
        out
    }

    /// The coordinator's per-step manifests (`accrue steps --detail --json`).
    fn manifests(&self, id: &str) -> Vec<StepManifest> {
        self.accrue_ok(&["steps", id, "--detail", "--json"])
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// The exactly-once check over the manifests: steps 1..=8, every
    /// document of the epoch trained in exactly one committed step.
    fn assert_exactly_once(&self, id: &str, rows: usize) {
        let m = self.manifests(id);
        assert_eq!(m.len(), 8, "committed steps in the manifests");
        let expect = Expectation {
            universe: Vec::new(),
            complete_epochs: 1,
            partial: false,
        };
        let offenders = check_exactly_once(&m, 1, &expect);
        assert!(offenders.is_empty(), "not exactly once: {offenders:?}");
        let docs: std::collections::BTreeSet<_> = m.iter().flat_map(|s| s.docs()).collect();
        assert_eq!(docs.len(), rows, "documents trained over the epoch");
    }

    fn stop_all(&mut self) {
        for w in &mut self.workers {
            let _ = w.kill();
            let _ = w.wait();
        }
        if let Some(mut c) = self.coord.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}

type Params = BTreeMap<String, Vec<f32>>;

/// The parameters of the job's final checkpoint (all safetensors shards).
fn final_params(out: &Path) -> Params {
    let ck = out.join("checkpoints").join("step-8");
    let mut params = Params::new();
    for e in std::fs::read_dir(&ck).unwrap_or_else(|e| panic!("{}: {e}", ck.display())) {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if !(name.starts_with("model") && name.ends_with(".safetensors")) {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (k, v) in st.tensors() {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{k} in {name}");
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert!(params.insert(k.clone(), vals).is_none(), "{k} twice");
        }
    }
    assert!(!params.is_empty(), "no parameters in {}", ck.display());
    params
}

/// Per tensor ‖a − b‖ ≤ 1e-5·‖b‖.
fn assert_same_params(got: &Params, want: &Params, case: &str) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{case}: tensor names"
    );
    for (k, b) in want {
        let a = &got[k];
        let diff: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
        assert!(
            diff <= 1e-5 * norm,
            "{case}: {k} differs by {diff:e} (‖b‖ = {norm:e}, rel {:e})",
            diff / norm
        );
    }
}

/// The uninterrupted run of the job at one sharding level (2 workers),
/// computed once per test binary.
fn reference(sharding: &str) -> &'static Params {
    static DDP: OnceLock<Params> = OnceLock::new();
    static FSDP: OnceLock<Params> = OnceLock::new();
    let cell = if sharding == "ddp" { &DDP } else { &FSDP };
    cell.get_or_init(|| {
        let mut c = Cluster::new();
        let spec = write_job(c.d(), "reference", sharding, 2);
        c.start_worker(None);
        c.start_worker(None);
        let id = c.submit(&spec);
        c.wait_completed(&id, Duration::from_secs(300));
        c.assert_exactly_once(&id, 96);
        let p = final_params(&c.d().join("out/reference"));
        c.stop_all();
        p
    })
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills worker 1 with `kill -9` when it reaches `point` at step 5 (after
/// the checkpoint of step 3; the checkpoint of step 6 for a checkpoint
/// write); the job must finish on the survivor with the same parameters as
/// an uninterrupted run.
fn kill_at(sharding: &str, point: &str) {
    let step = if point == "in_checkpoint_write" { 6 } else { 5 };
    let _g = lock();
    let want = reference(sharding);
    let mut c = Cluster::new();
    let spec = write_job(c.d(), "job", sharding, 2);
    c.start_worker(None);
    let victim = c.start_worker(Some(&format!("stop:{point}:{step}")));
    let id = c.submit(&spec);
    c.wait_log(victim, "fault point", Duration::from_secs(240));
    c.kill_worker(victim);
    c.wait_completed(&id, Duration::from_secs(240));
    c.assert_exactly_once(&id, 96);
    let got = final_params(&c.d().join("out/job"));
    assert_same_params(&got, want, &format!("{sharding}, kill -9 {point}"));
}

#[test]
fn ddp_worker_killed_before_a_step() {
    kill_at("ddp", "before_step");
}

#[test]
fn ddp_worker_killed_mid_microbatch() {
    kill_at("ddp", "mid_microbatch");
}

#[test]
fn ddp_worker_killed_inside_a_collective() {
    kill_at("ddp", "in_collective");
}

#[test]
fn ddp_worker_killed_while_writing_a_checkpoint() {
    kill_at("ddp", "in_checkpoint_write");
}

#[test]
fn fsdp_worker_killed_before_a_step() {
    kill_at("fsdp", "before_step");
}

#[test]
fn fsdp_worker_killed_mid_microbatch() {
    kill_at("fsdp", "mid_microbatch");
}

#[test]
fn fsdp_worker_killed_inside_a_collective() {
    kill_at("fsdp", "in_collective");
}

#[test]
fn fsdp_worker_killed_while_writing_a_checkpoint() {
    kill_at("fsdp", "in_checkpoint_write");
}

/// A worker frozen inside a collective is declared lost by heartbeat
/// timeout; the job goes on without it; resumed, it is fenced off by
/// generation (its old-generation messages change nothing).
#[test]
fn frozen_worker_is_detected_by_heartbeat_and_fenced_when_resumed() {
    let _g = lock();
    let want = reference("ddp");
    let mut c = Cluster::new();
    let spec = write_job(c.d(), "job", "ddp", 2);
    c.start_worker(None);
    let frozen = c.start_worker(Some("stop:in_collective:4"));
    let id = c.submit(&spec);
    c.wait_log(frozen, "fault point", Duration::from_secs(240));
    // Detected (2 s) and the step re-planned on the survivor.
    c.wait_step(&id, 5, Duration::from_secs(120));
    signal(c.pid(frozen), "CONT");
    c.wait_completed(&id, Duration::from_secs(240));
    c.assert_exactly_once(&id, 96);
    let got = final_params(&c.d().join("out/job"));
    assert_same_params(&got, want, "ddp, SIGSTOP then SIGCONT");
}

/// The world grows from 2 to 3 mid-run: the joiner gets its state from the
/// live members. (The tiny model's steps take milliseconds, so worker 0
/// holds step 3 frozen until the joiner is registered; the heartbeat
/// timeout is raised so the pause is not a loss.)
#[test]
fn a_worker_joins_mid_run() {
    let _g = lock();
    for sharding in ["ddp", "fsdp"] {
        let want = reference(sharding);
        let mut c = Cluster::with_heartbeat(Some(30_000));
        let spec = write_job(c.d(), "job", sharding, 3);
        c.start_worker(Some("stop:before_step:3"));
        c.start_worker(None);
        let id = c.submit(&spec);
        c.wait_log(0, "fault point", Duration::from_secs(240));
        c.start_worker(None);
        c.wait_workers(1);
        signal(c.pid(0), "CONT");
        c.wait_completed(&id, Duration::from_secs(240));
        let worlds: Vec<u32> = c.manifests(&id).iter().map(|m| m.world_size).collect();
        assert_eq!(
            worlds,
            [2, 2, 2, 3, 3, 3, 3, 3],
            "{sharding}: the joiner came in after step 3"
        );
        c.assert_exactly_once(&id, 96);
        let got = final_params(&c.d().join("out/job"));
        assert_same_params(&got, want, &format!("{sharding}, join 2 → 3"));
    }
}

/// A worker drained mid-run (3 → 2) leaves at a step boundary: no step is
/// aborted. (Worker 0 holds step 3 frozen while the drain is requested.)
#[test]
fn a_worker_is_drained_mid_run() {
    let _g = lock();
    for sharding in ["ddp", "fsdp"] {
        let want = reference(sharding);
        let mut c = Cluster::with_heartbeat(Some(30_000));
        let spec = write_job(c.d(), "job", sharding, 3);
        c.start_worker(Some("stop:before_step:3"));
        c.start_worker(None);
        c.start_worker(None);
        let id = c.submit(&spec);
        c.wait_log(0, "fault point", Duration::from_secs(240));
        let workers: serde_json::Value =
            serde_json::from_str(&c.accrue_ok(&["workers", "--json"])).unwrap();
        let victim = workers
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["rank"] == 2)
            .unwrap_or_else(|| panic!("no rank 2: {workers}"))["worker_id"]
            .as_str()
            .unwrap()
            .to_string();
        c.accrue_ok(&["drain", &victim]);
        signal(c.pid(0), "CONT");
        c.wait_completed(&id, Duration::from_secs(240));
        let m = c.manifests(&id);
        let worlds: Vec<u32> = m.iter().map(|m| m.world_size).collect();
        assert_eq!(
            worlds,
            [3, 3, 3, 2, 2, 2, 2, 2],
            "{sharding}: drained after step 3"
        );
        for s in &m {
            assert_eq!(s.attempts, 1, "{sharding}: a drain aborts step {}", s.step);
        }
        c.assert_exactly_once(&id, 96);
        let got = final_params(&c.d().join("out/job"));
        assert_same_params(&got, want, &format!("{sharding}, drain 3 → 2"));
    }
}

/// `kill -9` of the coordinator mid-step, restarted on the same state dir
/// and address: the workers reconnect and the job completes.
#[test]
fn coordinator_killed_mid_step_and_restarted() {
    let _g = lock();
    let want = reference("ddp");
    let mut c = Cluster::new();
    let spec = write_job(c.d(), "job", "ddp", 2);
    // Whichever worker is rank 0 freezes inside step 4.
    c.start_worker(Some("stop:mid_microbatch:4:0"));
    c.start_worker(Some("stop:mid_microbatch:4:0"));
    let id = c.submit(&spec);
    let t0 = Instant::now();
    let frozen = loop {
        if let Some(i) = (0..2).find(|&i| c.log(i).contains("fault point")) {
            break i;
        }
        assert!(t0.elapsed() < Duration::from_secs(240), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(50));
    };
    // The coordinator dies mid-step; rank 0 resumes and finds it gone.
    c.kill_coordinator();
    signal(c.pid(frozen), "CONT");
    c.start_coordinator();
    c.wait_completed(&id, Duration::from_secs(240));
    c.assert_exactly_once(&id, 96);
    let got = final_params(&c.d().join("out/job"));
    assert_same_params(&got, want, "ddp, coordinator kill -9 and restart");
}

/// The newest checkpoint is corrupted on disk, then a worker is lost under
/// fsdp: the restore of step 6 fails verification, the coordinator says so
/// and falls back to the checkpoint of step 3, replaying steps 4–7.
#[test]
fn a_corrupted_newest_checkpoint_falls_back_to_the_previous_one() {
    let _g = lock();
    let want = reference("fsdp");
    let mut c = Cluster::new();
    let spec = write_job(c.d(), "job", "fsdp", 2);
    c.start_worker(None);
    let victim = c.start_worker(Some("stop:before_step:8"));
    let id = c.submit(&spec);
    c.wait_log(victim, "fault point", Duration::from_secs(240));
    let ck = c.d().join("out/job/checkpoints/step-6");
    for f in ["manifest.json", "rank-0.json", "rank-1.json"] {
        assert!(ck.join(f).is_file(), "checkpoint 6 incomplete: no {f}");
    }
    // One flipped byte in the middle of a shard: same size, wrong checksum.
    let shard = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard");
    let mut bytes = std::fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    c.kill_worker(victim);
    c.wait_completed(&id, Duration::from_secs(240));
    let log = std::fs::read_to_string(c.d().join("logs/coordinator-0.log")).unwrap();
    assert!(
        log.contains("checkpoint step-6 failed to restore")
            && log.contains("falling back to step-3"),
        "no fallback logged:\n{}",
        c.logs()
    );
    c.assert_exactly_once(&id, 96);
    let got = final_params(&c.d().join("out/job"));
    assert_same_params(&got, want, "fsdp, corrupted newest checkpoint");
}
