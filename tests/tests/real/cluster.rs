//! The real-process cluster of the fault and lifecycle tests (faults.rs,
//! lifecycle.rs): a real `accrue-coordinator` and real `accrue-worker`
//! processes on 127.0.0.1 in a temporary directory, the job they train,
//! and the checks on its outcome (exactly-once manifests, final parameters
//! equal to an uninterrupted run's).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use accrue_coordinator::core::manifest::{check_exactly_once, Expectation, StepManifest};

use super::{bin_dir, write_tiny_config};

/// One case at a time: each runs 3–4 processes on a 2-core machine.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("running kill")
        .success();
    assert!(ok, "kill -{sig} {pid} failed");
}

/// The job every case trains: 8 steps of 12 documents over 96 rows (one
/// epoch), checkpoints every 3 steps, workers lost after 2 s of silence.
pub fn write_job(d: &Path, name: &str, sharding: &str, max_workers: u32) -> PathBuf {
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

/// Issue 16: the job of [`write_job`] over a mixture of three sources cut
/// from its 96 rows (48, 32 and 16 documents at 6, 4 and 2 per step, one
/// epoch each: 8 steps), with an eval source (`held`, 8 of the rows) every
/// 4 steps.
pub fn write_mixture_job(d: &Path, name: &str, sharding: &str, max_workers: u32) -> PathBuf {
    let rows = std::fs::read_to_string(d.join("data/arith-sft.jsonl")).unwrap();
    let lines: Vec<&str> = rows.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 96);
    for (file, range) in [("mix-a", 0..48), ("mix-b", 48..80), ("mix-c", 80..96)] {
        let text: String = lines[range].iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(d.join(format!("data/{file}.jsonl")), text).unwrap();
    }
    let held: String = lines[..8].iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(d.join("data/held.jsonl"), held).unwrap();
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 7
epochs = 1
output_dir = "out/{name}"
[model]
init = "random"
config = "tiny.json"
[data]
format = "sft"
max_tokens = 256
[[data.sources]]
name = "a"
path = "data/mix-a.jsonl"
docs = 6
[[data.sources]]
name = "b"
path = "data/mix-b.jsonl"
docs = 4
[[data.sources]]
name = "c"
path = "data/mix-c.jsonl"
docs = 2
[eval]
every_steps = 4
[[eval.sources]]
name = "held"
path = "data/held.jsonl"
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
pub struct Cluster {
    pub dir: tempfile::TempDir,
    /// The coordinator's `--heartbeat-timeout-ms` (None: its 2 s default).
    pub heartbeat_ms: Option<u64>,
    /// The coordinator's `--relay-min-world` (None: its default, above
    /// these tests' worlds).
    pub relay_min_world: Option<u32>,
    pub coord: Option<Child>,
    pub addr: String,
    pub workers: Vec<Child>,
}

impl Cluster {
    pub fn new() -> Cluster {
        Self::with_heartbeat(None)
    }

    pub fn with_heartbeat(heartbeat_ms: Option<u64>) -> Cluster {
        Self::with_settings(heartbeat_ms, None)
    }

    /// A cluster whose generations of `min_world` workers or more relay
    /// the coordinator's messages through hubs (`--relay-min-world`).
    pub fn relaying(min_world: u32) -> Cluster {
        Self::with_settings(None, Some(min_world))
    }

    fn with_settings(heartbeat_ms: Option<u64>, relay_min_world: Option<u32>) -> Cluster {
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
            relay_min_world,
            coord: None,
            addr: "127.0.0.1:0".into(),
            workers: Vec::new(),
        };
        c.start_coordinator();
        c
    }

    pub fn d(&self) -> &Path {
        self.dir.path()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts the coordinator on the cluster's state dir (on its previous
    /// address after a restart, so workers find it again).
    pub fn start_coordinator(&mut self) {
        let n = std::fs::read_dir(self.d().join("logs")).unwrap().count();
        let log =
            std::fs::File::create(self.d().join(format!("logs/coordinator-{n}.log"))).unwrap();
        let mut cmd = Command::new(bin_dir().join("accrue-coordinator"));
        if let Some(ms) = self.heartbeat_ms {
            cmd.args(["--heartbeat-timeout-ms", &ms.to_string()]);
        }
        if let Some(w) = self.relay_min_world {
            cmd.args(["--relay-min-world", &w.to_string()]);
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

    pub fn kill_coordinator(&mut self) {
        let mut c = self.coord.take().expect("a running coordinator");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Starts a worker (index = its position in `workers`), with an
    /// `ACCRUE_FAULT` hook if given. Its log is logs/worker-<i>.log.
    pub fn start_worker(&mut self, fault: Option<&str>) -> usize {
        self.start_worker_with(fault, &[])
    }

    /// [`Cluster::start_worker`] with more `accrue-worker` flags.
    pub fn start_worker_with(&mut self, fault: Option<&str>, flags: &[&str]) -> usize {
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
        .args(flags)
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

    pub fn log_path(&self, worker: usize) -> PathBuf {
        self.d().join(format!("logs/worker-{worker}.log"))
    }

    pub fn log(&self, worker: usize) -> String {
        std::fs::read_to_string(self.log_path(worker)).unwrap_or_default()
    }

    /// Waits until worker `i`'s log contains `needle`.
    pub fn wait_log(&self, i: usize, needle: &str, timeout: Duration) {
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

    pub fn pid(&self, i: usize) -> u32 {
        self.workers[i].id()
    }

    /// `kill -9` of worker `i`.
    pub fn kill_worker(&mut self, i: usize) {
        self.workers[i].kill().unwrap();
        self.workers[i].wait().unwrap();
    }

    pub fn accrue(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin_dir().join("accrue"))
            .args(["--coordinator", &self.url()])
            .args(args)
            .current_dir(self.d())
            .output()
            .expect("running accrue")
    }

    pub fn accrue_ok(&self, args: &[&str]) -> String {
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
    pub fn wait_workers(&self, n: usize) {
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

    pub fn submit(&self, spec: &Path) -> String {
        self.wait_workers(self.workers.len());
        self.accrue_ok(&["submit", spec.to_str().unwrap()])
            .trim()
            .to_string()
    }

    pub fn job(&self, id: &str) -> serde_json::Value {
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
    pub fn wait_step(&self, id: &str, step: u64, timeout: Duration) {
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
    pub fn wait_completed(&self, id: &str, timeout: Duration) {
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
    pub fn logs(&self) -> String {
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
    pub fn manifests(&self, id: &str) -> Vec<StepManifest> {
        self.accrue_ok(&["steps", id, "--detail", "--json"])
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// The exactly-once check over the manifests: steps 1..=8, every
    /// document of the epoch trained in exactly one committed step.
    pub fn assert_exactly_once(&self, id: &str, rows: usize) {
        self.assert_exactly_once_per_epoch(id, rows, 8, 1);
    }

    /// The exactly-once check of a job of `epochs` epochs of
    /// `steps_per_epoch` steps each (`docs_per_step` divides the `rows`, so
    /// no step spans an epoch boundary): the committed steps are exactly
    /// 1..=epochs·steps_per_epoch, and the steps of each epoch train every
    /// one of the `rows` documents exactly once. Checking each epoch on its
    /// own is stricter than counting over the run: a document trained twice
    /// in one epoch and missing from the next is caught.
    pub fn assert_exactly_once_per_epoch(
        &self,
        id: &str,
        rows: usize,
        steps_per_epoch: u64,
        epochs: u64,
    ) {
        let m = self.manifests(id);
        let steps: Vec<u64> = m.iter().map(|s| s.step).collect();
        let want: Vec<u64> = (1..=steps_per_epoch * epochs).collect();
        assert_eq!(steps, want, "committed steps in the manifests");
        let expect = Expectation {
            universe: Vec::new(),
            complete_epochs: epochs,
            partial: false,
        };
        let offenders = check_exactly_once(&m, 1, &expect);
        assert!(offenders.is_empty(), "not exactly once: {offenders:?}");
        let mut universe = None;
        for (e, epoch) in m.chunks(steps_per_epoch as usize).enumerate() {
            let mut counts: BTreeMap<_, u32> = BTreeMap::new();
            for d in epoch.iter().flat_map(|s| s.docs()) {
                *counts.entry(d).or_default() += 1;
            }
            let twice: Vec<_> = counts.iter().filter(|(_, &n)| n != 1).collect();
            assert!(
                twice.is_empty(),
                "epoch {e} (steps {}..={}) trained documents more than once: {twice:?}",
                epoch[0].step,
                epoch[epoch.len() - 1].step
            );
            assert_eq!(counts.len(), rows, "documents trained in epoch {e}");
            let docs: Vec<_> = counts.into_keys().collect();
            match &universe {
                None => universe = Some(docs),
                Some(u) => assert_eq!(&docs, u, "epoch {e} trained other documents than epoch 0"),
            }
        }
    }

    /// A worker of 3 left after step 3 of the 8-step, 96-document job:
    /// world sizes 3,3,3,2,2,2,2,2, no step aborted (attempts 1), every
    /// document exactly once, and the final parameters of `want`.
    pub fn assert_left_after_step_3(&self, id: &str, want: &Params, case: &str) {
        let m = self.manifests(id);
        let worlds: Vec<u32> = m.iter().map(|m| m.world_size).collect();
        assert_eq!(
            worlds,
            [3, 3, 3, 2, 2, 2, 2, 2],
            "{case}: left after step 3"
        );
        for s in &m {
            assert_eq!(
                s.attempts, 1,
                "{case}: the departure aborted step {}",
                s.step
            );
        }
        self.assert_trained_like(id, want, case);
    }

    /// The 96-document job trained every document exactly once and ended
    /// with the parameters of `want` (an uninterrupted run).
    pub fn assert_trained_like(&self, id: &str, want: &Params, case: &str) {
        self.assert_exactly_once(id, 96);
        let got = final_params(&self.d().join("out/job"));
        assert_same_params(&got, want, case);
    }

    pub fn stop_all(&mut self) {
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

pub type Params = BTreeMap<String, Vec<f32>>;

/// The parameters of the 8-step job's final checkpoint.
pub fn final_params(out: &Path) -> Params {
    final_params_at(out, 8)
}

/// The parameters of the checkpoint of `step` (all safetensors shards).
pub fn final_params_at(out: &Path, step: u64) -> Params {
    let ck = out.join("checkpoints").join(format!("step-{step}"));
    let mut params = Params::new();
    for e in std::fs::read_dir(&ck).unwrap_or_else(|e| panic!("{}: {e}", ck.display())) {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        // A LoRA job's adapters are parameters too.
        let weights = name.starts_with("model") || name.starts_with("adapter_model");
        if !(weights && name.ends_with(".safetensors")) {
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
pub fn assert_same_params(got: &Params, want: &Params, case: &str) {
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
pub fn reference(sharding: &str) -> &'static Params {
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

pub fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
