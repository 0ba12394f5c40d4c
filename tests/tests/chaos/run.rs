//! The chaos soak's executor: a cluster running the soak's job, driven
//! through a [`Schedule`] hold by hold, and the checks on the workers that
//! the schedule touched (drained ones leave for good and exit).

use std::path::Path;
use std::time::{Duration, Instant};

use crate::real::cluster::{signal, Cluster};
use crate::schedule::{GateEnd, Hold, Schedule};
use crate::{shape, write_job, PATIENCE};

/// What the coordinators' logs say happened: generations formed, workers
/// lost (by cause), restores from a checkpoint, steps replayed.
pub fn realized(d: &Path) -> String {
    let text = coordinator_logs(d);
    let count = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    let lost = |why: &str| {
        text.lines()
            .filter(|l| l.contains("worker lost") && l.contains(why))
            .count()
    };
    format!(
        "{} generations, workers lost: {} session closed, {} missed heartbeats, {} collective timeout; {} failed state syncs; {} restores from a checkpoint, {} steps replayed",
        count("generation formed"),
        lost("session closed"),
        lost("missed heartbeats"),
        lost("collective timeout"),
        count("state sync failed"),
        count("from checkpoint step-"),
        count("step replayed"),
    )
}

/// A soak in progress: the cluster, the job, and which workers the test
/// expects to be alive.
pub struct Run {
    pub c: Cluster,
    pub id: String,
    /// `seed-<seed>-<sharding>`, naming the kept logs of a failure.
    label: String,
    /// Each hold's `ACCRUE_FAULT`, armed on its gate worker.
    gate_faults: Vec<String>,
    /// Workers drained (they must exit 0 once released).
    drained: Vec<usize>,
    /// For each drained worker, the job's last generation once the drain
    /// was accepted: it must not train in any later one.
    drained_after: Vec<(usize, u64)>,
    /// Workers killed by the test.
    killed: Vec<usize>,
}

impl Run {
    /// Starts the cluster and the initial workers (worker 0 armed with the
    /// first gate) and submits the job.
    pub fn new(s: &Schedule, sharding: &str) -> Run {
        let mut c = Cluster::with_heartbeat(Some(shape().heartbeat_ms));
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
            drained_after: Vec::new(),
            killed: Vec::new(),
        }
    }

    /// Hold `k`: waits for its gate to stop the job, injects its faults,
    /// ends the gate.
    pub fn hold(&mut self, k: usize, h: &Hold) {
        let t0 = Instant::now();
        self.wait_gate(k, h);
        let stopped = Instant::now();
        self.check_alive(k);
        self.check_drained_stayed_out(&format!("hold {}", k + 1));
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
            let generation = self.c.job(&self.id)["generation"].as_u64().unwrap_or(0);
            self.drained_after.push((v, generation));
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
            GateEnd::Lost { then_kill } => {
                self.wait_lost(k, h.gate);
                if then_kill {
                    self.kill(h.gate);
                } else {
                    // Resumed, it finds its session ended and registers
                    // again, to be used like any joiner.
                    let n = self.registrations(h.gate).len();
                    signal(self.c.pid(h.gate), "CONT");
                    self.wait_registered(h.gate, n + 1);
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
                    "hold {}: the job reached step {step} without its gate w{} stopping at {} of step {} (not in the generation?): {j}\n{}\n{}",
                    k + 1,
                    h.gate,
                    h.point.name(),
                    h.step,
                    self.census(),
                    self.c.logs()
                );
                assert!(
                    !matches!(
                        j["state"].as_str(),
                        Some("failed" | "cancelled" | "completed")
                    ),
                    "hold {}: the job ended before its gate: {j}\n{}\n{}",
                    k + 1,
                    self.census(),
                    self.c.logs()
                );
            }
            assert!(
                t0.elapsed() < PATIENCE,
                "hold {}: gate w{} did not stop at {} of step {} in {PATIENCE:?}: {}\n{}\n{}",
                k + 1,
                h.gate,
                h.point.name(),
                h.step,
                self.c.job(&self.id),
                self.census(),
                self.c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the coordinator declares worker `w` lost by missed
    /// heartbeats (it is stopped).
    fn wait_lost(&self, k: usize, w: usize) {
        let needle = format!("{} lost: missed heartbeats", self.worker_id(w));
        let limit = Duration::from_millis(shape().heartbeat_ms) + Duration::from_secs(30);
        let t0 = Instant::now();
        while !coordinator_logs(self.c.d()).contains(&needle) {
            assert!(
                t0.elapsed() < limit,
                "hold {}: w{w}, stopped, was not declared lost in {limit:?}\n{}\n{}",
                k + 1,
                self.census(),
                self.c.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every worker process: what the test did to it, whether it still
    /// runs, and the state the coordinator gives it (for failure messages).
    fn census(&self) -> String {
        let json = self.c.accrue(&["workers", "--json"]).stdout;
        let listed: Vec<serde_json::Value> = serde_json::from_slice(&json).unwrap_or_default();
        let mut out = String::from("workers (test's view | process | coordinator's view):\n");
        for w in 0..self.c.workers.len() {
            let did = if self.killed.contains(&w) {
                "killed"
            } else if self.drained.contains(&w) {
                "drained"
            } else {
                "running"
            };
            let alive = Path::new(&format!("/proc/{}", self.c.pid(w))).exists()
                && !std::fs::read_to_string(format!("/proc/{}/stat", self.c.pid(w)))
                    .unwrap_or_default()
                    .contains(") Z ");
            let id = self.registrations(w).pop().unwrap_or_default();
            let seen = listed
                .iter()
                .find(|x| x["worker_id"] == id.as_str())
                .map_or("not listed".to_string(), |x| {
                    format!("{} rank {}", x["state"], x["rank"])
                });
            out += &format!(
                "  w{w} {id}: {did} | {} | {seen}\n",
                if alive { "alive" } else { "exited" }
            );
        }
        out
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

    /// No drained worker was configured into a generation formed after its
    /// drain (it leaves at the step boundary for good).
    pub fn check_drained_stayed_out(&self, when: &str) {
        for &(w, after) in &self.drained_after {
            let joined: Vec<u64> = self
                .c
                .log(w)
                .lines()
                .filter(|l| l.contains("configured job="))
                .filter_map(|l| l.split(" generation=").nth(1))
                .filter_map(|g| g.split_whitespace().next()?.parse().ok())
                .filter(|&g| g > after)
                .collect();
            assert!(
                joined.is_empty(),
                "{when}: w{w}, drained at generation {after}, was configured into generation(s) {joined:?} after its drain\n{}\n{}",
                self.census(),
                self.c.logs()
            );
        }
    }

    /// Drained workers were released and exited 0.
    pub fn check_drained_exited(&mut self) {
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
    /// On a failure (or always, with `ACCRUE_CHAOS_KEEP_LOGS=1`), keeps
    /// every process's log (the cluster's directory is deleted with it) and
    /// says where.
    fn drop(&mut self) {
        let keep_always = std::env::var("ACCRUE_CHAOS_KEEP_LOGS").is_ok_and(|v| v == "1");
        if !std::thread::panicking() && !keep_always {
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

/// Every coordinator log of the cluster in `d`, without colour codes.
fn coordinator_logs(d: &Path) -> String {
    let mut text = String::new();
    let mut logs: Vec<_> = std::fs::read_dir(d.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("coordinator")
        })
        .collect();
    logs.sort();
    for p in logs {
        text += &std::fs::read_to_string(&p).unwrap_or_default();
    }
    strip_ansi(&text)
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
