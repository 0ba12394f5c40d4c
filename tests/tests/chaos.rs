//! Chaos soak (issue 14): a seeded random schedule of faults — `kill -9`
//! and SIGSTOP of workers at the worker's fault points, SIGCONT or
//! `kill -9` after, a worker lost by heartbeat and fenced, joins, drains,
//! and `kill -9` + restart of the coordinator — over a 6-epoch, 48-step job
//! of 1–3 real `accrue-worker` processes (max 3), at `ddp` and `fsdp`. The
//! job must complete, every document of each epoch must be trained exactly
//! once (the coordinator's step manifests), and the final parameters must
//! equal those of an uninterrupted run, per tensor ‖a − b‖ ≤ 1e-5·‖b‖.
//!
//! How faults are aimed (the steps take milliseconds) is in
//! `chaos/schedule.rs`; the schedule is printed first. Seeds:
//! `ACCRUE_CHAOS_SEED=N` (one) or `ACCRUE_CHAOS_SEEDS=a,b,c` (several),
//! else a fresh random one. The soak takes minutes, so it is `#[ignore]`d:
//! `scripts/chaos.sh [N]` runs it (N random seeds), or
//! `cargo test -p accrue-tests --test chaos -- --ignored --nocapture`.

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod real;
#[path = "chaos/schedule.rs"]
mod schedule;

use real::cluster::{assert_same_params, final_params_at, lock, signal, Cluster, Params};
use schedule::{GateEnd, Hold, Schedule, Shape};

/// 96 documents, 12 a step: 8 steps an epoch, no step across an epoch's end.
const ROWS: usize = 96;
const DOCS_PER_STEP: u64 = 12;
const EPOCHS: u64 = 6;
const STEPS: u64 = EPOCHS * ROWS as u64 / DOCS_PER_STEP;
const SHAPE: Shape = Shape {
    steps: STEPS,
    checkpoint_every: 4,
    max_workers: 3,
    // Long enough that starting the next gate (a worker's start and
    // registration, a second or two on a busy machine) does not lose a
    // stalled gate; the `Lost` holds outlast it.
    heartbeat_ms: 4_000,
};

/// How long one hold's gate or the job's end may take before the soak
/// fails (a hang is a failure too).
const PATIENCE: Duration = Duration::from_secs(180);

fn write_job(d: &Path, name: &str, sharding: &str) -> std::path::PathBuf {
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 7
epochs = {EPOCHS}
output_dir = "out/{name}"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["data/arith-sft.jsonl"]
format = "sft"
max_tokens = 256
[batch]
docs_per_step = {DOCS_PER_STEP}
[optimizer]
lr = 3e-3
warmup_steps = 1
eps = 1e-6
[parallel]
sharding = "{sharding}"
min_workers = 1
max_workers = {max}
[checkpoint]
every_steps = {every}
"#,
        max = SHAPE.max_workers,
        every = SHAPE.checkpoint_every,
    );
    let path = d.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// The uninterrupted run of the soak's job (2 workers), once per sharding.
fn reference(sharding: &str) -> &'static Params {
    static DDP: OnceLock<Params> = OnceLock::new();
    static FSDP: OnceLock<Params> = OnceLock::new();
    let cell = if sharding == "ddp" { &DDP } else { &FSDP };
    cell.get_or_init(|| {
        let t0 = Instant::now();
        let mut c = Cluster::new();
        let spec = write_job(c.d(), "reference", sharding);
        c.start_worker(None);
        c.start_worker(None);
        let id = c.submit(&spec);
        c.wait_completed(&id, PATIENCE);
        c.assert_exactly_once_per_epoch(&id, ROWS, STEPS / EPOCHS, EPOCHS);
        let p = final_params_at(&c.d().join("out/reference"), STEPS);
        c.stop_all();
        eprintln!("chaos: {sharding} reference run took {:.1?}", t0.elapsed());
        p
    })
}

/// The seeds to run: `ACCRUE_CHAOS_SEEDS=a,b,c`, `ACCRUE_CHAOS_SEED=n`, or
/// one fresh random seed (the same for both shardings of this process).
fn seeds() -> &'static [u64] {
    static SEEDS: OnceLock<Vec<u64>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let parse = |s: &str| -> u64 {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("chaos seed {s:?} is not a number"))
        };
        if let Ok(list) = std::env::var("ACCRUE_CHAOS_SEEDS") {
            list.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(parse)
                .collect()
        } else if let Ok(one) = std::env::var("ACCRUE_CHAOS_SEED") {
            vec![parse(&one)]
        } else {
            vec![u64::from(rand::random::<u32>())]
        }
    })
}

#[test]
#[ignore = "chaos soak: a minute or more of real processes per seed; run scripts/chaos.sh"]
fn chaos_soak_ddp() {
    soak_seeds("ddp");
}

#[test]
#[ignore = "chaos soak: a minute or more of real processes per seed; run scripts/chaos.sh"]
fn chaos_soak_fsdp() {
    soak_seeds("fsdp");
}

/// Runs every seed (a failing one does not stop the rest) and fails if any
/// failed, naming them.
fn soak_seeds(sharding: &str) {
    let mut failed = Vec::new();
    for &seed in seeds() {
        let t0 = Instant::now();
        if let Err(panic) = std::panic::catch_unwind(|| soak(seed, sharding)) {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            let first = msg.lines().next().unwrap_or_default();
            eprintln!(
                "chaos: FAIL seed {seed} {sharding} after {:.1?}: {first}",
                t0.elapsed()
            );
            failed.push(seed);
        }
    }
    assert!(
        failed.is_empty(),
        "{sharding}: chaos seeds failed: {failed:?} (rerun one with ACCRUE_CHAOS_SEED=<seed>)"
    );
}

/// Runs the schedule of `seed` against a fresh cluster and checks the
/// outcome.
fn soak(seed: u64, sharding: &str) {
    let _g = lock();
    let schedule = Schedule::generate(seed, SHAPE);
    eprintln!("chaos: seed {seed}, {sharding}\n{schedule}");
    let want = reference(sharding);
    let t0 = Instant::now();
    let mut run = Run::new(&schedule, sharding);
    for (k, hold) in schedule.holds.iter().enumerate() {
        run.hold(k, hold);
    }
    run.c.wait_completed(&run.id, PATIENCE);
    let took = t0.elapsed();
    let case = format!("seed {seed}, {sharding}");
    run.c
        .assert_exactly_once_per_epoch(&run.id, ROWS, STEPS / EPOCHS, EPOCHS);
    let got = final_params_at(&run.c.d().join("out/job"), STEPS);
    assert_same_params(&got, want, &case);
    let manifests = run.c.manifests(&run.id);
    let aborted: u32 = manifests.iter().map(|m| m.attempts - 1).sum();
    let worlds: Vec<u32> = manifests.iter().map(|m| m.world_size).collect();
    eprintln!(
        "chaos: seed {seed} {sharding}: exactly once per epoch, parameters within {:.1e} of the reference; world sizes {worlds:?}; {aborted} aborted step attempts; {}",
        max_rel_diff(&got, want),
        realized(run.c.d())
    );
    run.check_drained_exited();
    eprintln!(
        "chaos: PASS seed {seed} {sharding} in {took:.1?} ({} faults): {}",
        schedule.faults().len(),
        schedule.faults().join("; ")
    );
}

/// The largest per-tensor ‖a − b‖ / ‖b‖.
fn max_rel_diff(got: &Params, want: &Params) -> f64 {
    want.iter()
        .map(|(k, b)| {
            let a = &got[k];
            let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            (d / n).sqrt()
        })
        .fold(0.0, f64::max)
}

/// What the coordinators' logs say happened: generations formed, workers
/// lost (by cause), restores from a checkpoint, steps replayed.
fn realized(d: &Path) -> String {
    let mut text = String::new();
    for e in std::fs::read_dir(d.join("logs")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("coordinator")
        {
            text += &std::fs::read_to_string(&p).unwrap_or_default();
        }
    }
    let text = strip_ansi(&text);
    let count = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    format!(
        "{} generations, workers lost: {} session closed, {} missed heartbeats, {} collective timeout; {} restores from a checkpoint, {} steps replayed",
        count("generation formed"),
        count("lost: session closed"),
        count("lost: missed heartbeats"),
        count("collective timeout reported"),
        count("from checkpoint step-"),
        count("step replayed"),
    )
}

/// A soak in progress: the cluster, the job, and which workers the test
/// expects to be alive.
struct Run {
    c: Cluster,
    id: String,
    /// `seed-<seed>-<sharding>`, naming the kept logs of a failure.
    label: String,
    /// Each hold's `ACCRUE_FAULT`, armed on its gate worker.
    gate_faults: Vec<String>,
    /// Workers drained (they must exit 0 once released).
    drained: Vec<usize>,
    /// Workers killed by the test.
    killed: Vec<usize>,
}

impl Run {
    /// Starts the cluster and the initial workers (worker 0 armed with the
    /// first gate) and submits the job.
    fn new(s: &Schedule, sharding: &str) -> Run {
        let mut c = Cluster::with_heartbeat(Some(SHAPE.heartbeat_ms));
        let spec = write_job(c.d(), "job", sharding);
        c.start_worker(Some(&s.holds[0].fault()));
        for _ in 1..s.initial_workers {
            c.start_worker(None);
        }
        let id = c.submit(&spec);
        Run {
            c,
            id,
            label: format!("seed-{}-{sharding}", s.seed),
            gate_faults: s.holds.iter().map(Hold::fault).collect(),
            drained: Vec::new(),
            killed: Vec::new(),
        }
    }

    /// Hold `k`: waits for its gate to stop the job, injects its faults,
    /// ends the gate.
    fn hold(&mut self, k: usize, h: &Hold) {
        let t0 = Instant::now();
        self.wait_gate(k, h);
        let stopped = Instant::now();
        self.check_alive(k);
        let mut started = Vec::new();
        if let Some(g) = h.next_gate {
            let next = self.gate_faults[k + 1].clone();
            assert_eq!(self.c.start_worker(Some(&next)), g, "worker numbering");
            started.push(g);
        }
        for &w in &h.joins {
            assert_eq!(self.c.start_worker(None), w, "worker numbering");
            started.push(w);
        }
        for &w in &started {
            self.wait_registered(w, 1);
        }
        if let Some(v) = h.kill_peer {
            self.kill(v);
        }
        if let Some(v) = h.drain {
            let wid = self.worker_id(v);
            self.c.accrue_ok(&["drain", &wid]);
            self.drained.push(v);
        }
        if let Some(down) = h.coordinator_down_ms {
            let back: Vec<(usize, usize)> = self
                .alive()
                .into_iter()
                .filter(|&w| w != h.gate)
                .map(|w| (w, self.registrations(w).len()))
                .collect();
            self.c.kill_coordinator();
            std::thread::sleep(Duration::from_millis(down));
            self.c.start_coordinator();
            // Every running worker is back before the gate ends, so the new
            // generation (after the coordinator's rejoin wait for the gate)
            // has them all, the next gate included.
            for (w, n) in back {
                self.wait_registered(w, n + 1);
            }
        }
        match h.end {
            GateEnd::Kill => self.kill(h.gate),
            GateEnd::Cont { ms } => {
                sleep_until(stopped + Duration::from_millis(ms));
                signal(self.c.pid(h.gate), "CONT");
            }
            GateEnd::Lost { ms, then_kill } => {
                sleep_until(stopped + Duration::from_millis(ms));
                if then_kill {
                    self.kill(h.gate);
                } else {
                    signal(self.c.pid(h.gate), "CONT");
                }
            }
        }
        eprintln!(
            "chaos: hold {} done: gate w{} stopped {:.1?} after the previous hold, held {:.1?}; {h}",
            k + 1,
            h.gate,
            stopped - t0,
            stopped.elapsed()
        );
    }

    /// Waits for hold `k`'s gate worker to stop at its point. Fails if the
    /// job moves past the gate's step without it (the gate worker was not
    /// in the generation), ends, or hangs.
    fn wait_gate(&self, k: usize, h: &Hold) {
        let t0 = Instant::now();
        let mut last_poll = Instant::now() - Duration::from_secs(1);
        loop {
            if self.c.log(h.gate).contains("fault point") {
                return;
            }
            if last_poll.elapsed() >= Duration::from_millis(500) {
                last_poll = Instant::now();
                let j = self.c.job(&self.id);
                let step = j["step"].as_u64().unwrap_or(0);
                assert!(
                    step <= h.step,
                    "hold {}: the job reached step {step} without its gate w{} stopping at {} of step {} (not in the generation?): {j}\n{}",
                    k + 1,
                    h.gate,
                    h.point.name(),
                    h.step,
                    self.c.logs()
                );
                assert!(
                    !matches!(
                        j["state"].as_str(),
                        Some("failed" | "cancelled" | "completed")
                    ),
                    "hold {}: the job ended before its gate: {j}\n{}",
                    k + 1,
                    self.c.logs()
                );
            }
            assert!(
                t0.elapsed() < PATIENCE,
                "hold {}: gate w{} did not stop at {} of step {} in {PATIENCE:?}: {}\n{}",
                k + 1,
                h.gate,
                h.point.name(),
                h.step,
                self.c.job(&self.id),
                self.c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The worker ids worker `w` registered as, one per registration.
    fn registrations(&self, w: usize) -> Vec<String> {
        self.c
            .log(w)
            .lines()
            .filter_map(|l| l.split(" registered worker=").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
            .collect()
    }

    fn worker_id(&self, w: usize) -> String {
        self.registrations(w)
            .pop()
            .unwrap_or_else(|| panic!("w{w} never registered:\n{}", self.c.log(w)))
    }

    /// Waits until worker `w` has registered `n` times.
    fn wait_registered(&self, w: usize, n: usize) {
        let t0 = Instant::now();
        while self.registrations(w).len() < n {
            assert!(
                t0.elapsed() < PATIENCE,
                "w{w} did not register (#{n}):\n{}",
                self.c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self, w: usize) {
        self.c.kill_worker(w);
        self.killed.push(w);
    }

    /// The workers neither killed nor drained.
    fn alive(&self) -> Vec<usize> {
        (0..self.c.workers.len())
            .filter(|w| !self.killed.contains(w) && !self.drained.contains(w))
            .collect()
    }

    /// No worker the test did not kill or drain has exited.
    fn check_alive(&mut self, k: usize) {
        for w in self.alive() {
            if let Some(status) = self.c.workers[w].try_wait().unwrap() {
                panic!(
                    "hold {}: w{w} exited ({status}) unasked:\n{}\n{}",
                    k + 1,
                    self.c.log(w),
                    self.c.logs()
                );
            }
        }
    }

    /// Drained workers were released and exited 0.
    fn check_drained_exited(&mut self) {
        for &w in &self.drained {
            let t0 = Instant::now();
            let status = loop {
                if let Some(s) = self.c.workers[w].try_wait().unwrap() {
                    break s;
                }
                if t0.elapsed() > Duration::from_secs(60) {
                    let id = self.worker_id(w);
                    let workers: serde_json::Value =
                        serde_json::from_str(&self.c.accrue_ok(&["workers", "--json"])).unwrap();
                    let seen = workers
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|x| x["worker_id"] == id.as_str())
                        .cloned();
                    panic!(
                        "drained w{w} ({id}) still running a minute after the job completed; the coordinator lists it as {seen:?}; its log:\n{}",
                        self.c.log(w)
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            assert!(
                status.success(),
                "drained w{w} exited {status}:\n{}",
                self.c.log(w)
            );
        }
    }
}

impl Drop for Run {
    /// On a failure, keeps every process's log (the cluster's directory is
    /// deleted with it) and says where.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let keep = std::env::temp_dir().join(format!("accrue-chaos-{}", self.label));
        let _ = std::fs::remove_dir_all(&keep);
        let copied = std::fs::create_dir_all(&keep).and_then(|()| {
            for e in std::fs::read_dir(self.c.d().join("logs"))? {
                let p = e?.path();
                std::fs::copy(&p, keep.join(p.file_name().unwrap()))?;
            }
            Ok(())
        });
        match copied {
            Ok(()) => eprintln!("chaos: logs kept in {}", keep.display()),
            Err(e) => eprintln!("chaos: could not keep the logs in {}: {e}", keep.display()),
        }
    }
}

/// `text` without its terminal colour codes (the coordinator logs in colour).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters final-byte
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn sleep_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
}
