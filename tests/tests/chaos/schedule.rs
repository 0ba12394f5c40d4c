//! The chaos soak's fault schedule: a pure function of a seed (ChaCha8),
//! printed before the run so a failure reproduces with
//! `ACCRUE_CHAOS_SEED=<seed>`.
//!
//! The tiny model trains a step in tens of milliseconds, far too fast to
//! aim a fault by the clock, so every fault lands while a **gate** holds
//! the job: a worker started with `ACCRUE_FAULT=stop:<point>:<step>` stops
//! itself (SIGSTOP) at that point of that step, the rest of the generation
//! waits on it, and the schedule's faults for that hold are injected while
//! the job is mid-step. Each worker process carries at most one gate (the
//! hook fires once per process), so every hold but the last starts the
//! next hold's gate worker — a join — and the schedule simulates the
//! population to keep it within `max_workers` once the hold's victims are
//! gone, so that every gate worker is in the generation when its step
//! comes.

use std::fmt;

use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The job's shape, which the schedule has to fit.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub steps: u64,
    pub checkpoint_every: u64,
    pub max_workers: usize,
    pub heartbeat_ms: u64,
}

/// Where a gate worker stops (the worker's `ACCRUE_FAULT` points).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    BeforeStep,
    MidMicrobatch,
    InCollective,
    /// Only at checkpoint steps; the generation then waits on the gate in
    /// the next step.
    InCheckpointWrite,
}

impl Point {
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeStep => "before_step",
            Point::MidMicrobatch => "mid_microbatch",
            Point::InCollective => "in_collective",
            Point::InCheckpointWrite => "in_checkpoint_write",
        }
    }
}

/// What becomes of the gate worker once it is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateEnd {
    /// `kill -9` at the point.
    Kill,
    /// SIGCONT once it has been stopped `ms` (under the heartbeat timeout:
    /// a stall, nothing is lost).
    Cont { ms: u64 },
    /// Stopped until the coordinator declares it lost (missed heartbeats),
    /// then at once SIGCONT (its old generation is fenced off) or `kill -9`.
    /// (At once: the job goes on without it, and the next gate may stop
    /// soon after.)
    Lost { then_kill: bool },
}

/// One hold: the gate stops, the faults are injected, the gate ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub step: u64,
    pub point: Point,
    /// The worker (index in start order) that carries this hold's gate.
    pub gate: usize,
    /// Started while the gate is stopped, each waited for until registered:
    /// the next hold's gate (armed with its `ACCRUE_FAULT`), then unarmed
    /// joiners.
    pub next_gate: Option<usize>,
    pub joins: Vec<usize>,
    /// `kill -9` of another worker, stopped wherever it waits for the gate.
    pub kill_peer: Option<usize>,
    /// `accrue drain` of a worker (another one, or the gate itself): it
    /// leaves at the step boundary and exits.
    pub drain: Option<usize>,
    /// `kill -9` of the coordinator with the gate stopped, a restart after
    /// `down_ms` on the same state and address, and the workers' return;
    /// only then does the gate end.
    pub coordinator_down_ms: Option<u64>,
    pub end: GateEnd,
}

impl Hold {
    /// The `ACCRUE_FAULT` that arms this hold's gate worker.
    pub fn fault(&self) -> String {
        format!("stop:{}:{}", self.point.name(), self.step)
    }

    /// The workers this hold removes for good.
    pub fn removed(&self) -> Vec<usize> {
        let mut out: Vec<usize> = self.kill_peer.into_iter().chain(self.drain).collect();
        if matches!(
            self.end,
            GateEnd::Kill
                | GateEnd::Lost {
                    then_kill: true,
                    ..
                }
        ) {
            out.push(self.gate);
        }
        out
    }

    /// One line per fault, for the run's summary.
    pub fn faults(&self) -> Vec<String> {
        let g = self.gate;
        let mut out = vec![format!(
            "step {} {}: w{g} SIGSTOP",
            self.step,
            self.point.name()
        )];
        out.extend(self.next_gate.map(|w| format!("w{w} joins (next gate)")));
        out.extend(self.joins.iter().map(|w| format!("w{w} joins")));
        out.extend(self.kill_peer.map(|w| format!("w{w} kill -9")));
        out.extend(self.drain.map(|w| format!("w{w} drained")));
        out.extend(
            self.coordinator_down_ms
                .map(|ms| format!("coordinator kill -9, down {ms} ms, restarted")),
        );
        out.push(match self.end {
            GateEnd::Kill => format!("w{g} kill -9"),
            GateEnd::Cont { ms } => format!("w{g} SIGCONT after {ms} ms"),
            GateEnd::Lost { then_kill } => format!(
                "w{g} lost by heartbeat, then {}",
                if then_kill { "kill -9" } else { "SIGCONT" }
            ),
        });
        out
    }
}

impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.faults().join("; "))
    }
}

/// A whole soak: the workers to start before submitting (worker 0 carries
/// the first gate) and the holds in step order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub seed: u64,
    pub initial_workers: usize,
    pub holds: Vec<Hold>,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos schedule, seed {} (reproduce: ACCRUE_CHAOS_SEED={}): start w0..w{} (w0 armed with {})",
            self.seed,
            self.seed,
            self.initial_workers - 1,
            self.holds[0].fault()
        )?;
        for (i, h) in self.holds.iter().enumerate() {
            writeln!(f, "  hold {}: {h}", i + 1)?;
        }
        Ok(())
    }
}

impl Schedule {
    /// The schedule of `seed` for a job of `shape`: 7–9 holds on steps at
    /// least 4 apart, every kind of fault at least once (gate killed, gate
    /// stalled and resumed, gate lost by heartbeat, a peer killed, a drain,
    /// a join, a coordinator kill). Drafts that miss a kind are redrawn
    /// from the same generator, so a seed always gives the same schedule.
    pub fn generate(seed: u64, shape: Shape) -> Schedule {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        loop {
            let s = draft(&mut rng, seed, shape);
            if s.covers_every_kind() {
                return s;
            }
        }
    }

    fn covers_every_kind(&self) -> bool {
        let h = &self.holds;
        h.iter().any(|h| h.end == GateEnd::Kill)
            && h.iter().any(|h| matches!(h.end, GateEnd::Cont { .. }))
            && h.iter().any(|h| matches!(h.end, GateEnd::Lost { .. }))
            && h.iter().any(|h| h.kill_peer.is_some())
            && h.iter().any(|h| h.drain.is_some())
            && h.iter().any(|h| h.coordinator_down_ms.is_some())
    }

    /// Every fault, in order.
    pub fn faults(&self) -> Vec<String> {
        self.holds.iter().flat_map(Hold::faults).collect()
    }
}

/// One draw of a schedule (it may lack a kind of fault).
fn draft(rng: &mut ChaCha8Rng, seed: u64, shape: Shape) -> Schedule {
    let n = rng.random_range(7..=9usize);
    // Steps 3..=steps-4, at least 4 apart: the next gate, started during a
    // hold, joins at the boundary after the held step (or after the next
    // one for a checkpoint-write gate) and must be a member by its own.
    let (first, last) = (3, shape.steps - 4);
    let slack = last - first - 4 * (n as u64 - 1);
    let mut offsets: Vec<u64> = (0..n).map(|_| rng.random_range(0..=slack)).collect();
    offsets.sort_unstable();
    let steps: Vec<u64> = (0..n).map(|k| first + 4 * k as u64 + offsets[k]).collect();
    let coordinator_kills: Vec<usize> = {
        let mut idx: Vec<usize> = (1..n - 1).collect();
        idx.shuffle(rng);
        let two = rng.random_bool(0.25);
        idx.truncate(if two { 2 } else { 1 });
        idx
    };
    let initial_workers = rng.random_range(2..=shape.max_workers.min(3));
    let mut alive: Vec<usize> = (0..initial_workers).collect();
    let mut next_worker = initial_workers;
    let mut gate = 0;
    let mut holds = Vec::with_capacity(n);
    for (k, &step) in steps.iter().enumerate() {
        let last_hold = k == n - 1;
        let mut points = vec![Point::BeforeStep, Point::MidMicrobatch, Point::InCollective];
        if step % shape.checkpoint_every == 0 {
            points.push(Point::InCheckpointWrite);
        }
        let point = *points.choose(rng).unwrap();
        let coordinator_down_ms = coordinator_kills
            .contains(&k)
            .then(|| rng.random_range(0..=2_000));
        let hb = shape.heartbeat_ms;
        let mut end = match rng.random_range(0..4) {
            0 => GateEnd::Kill,
            1 => GateEnd::Cont {
                ms: rng.random_range(100..=hb / 2),
            },
            r => GateEnd::Lost { then_kill: r == 3 },
        };
        if coordinator_down_ms.is_some() && matches!(end, GateEnd::Lost { .. }) {
            // A restarted coordinator has no heartbeat history to lose it by.
            end = GateEnd::Cont {
                ms: rng.random_range(100..=hb / 2),
            };
        }
        let peers: Vec<usize> = alive.iter().copied().filter(|&w| w != gate).collect();
        let mut victims = peers.clone();
        victims.shuffle(rng);
        let mut kill_peer = None;
        if rng.random_bool(0.35) {
            kill_peer = victims.pop();
        }
        let mut drain = None;
        // A drain is not combined with a coordinator kill (the request
        // would die with the coordinator), nor aimed at a gate that will
        // not come back.
        if coordinator_down_ms.is_none() && rng.random_bool(0.35) {
            let gate_ok = matches!(end, GateEnd::Cont { .. });
            drain = if gate_ok && rng.random_bool(0.3) {
                Some(gate)
            } else {
                victims.pop()
            };
        }
        let mut joins = usize::from(rng.random_bool(0.25));
        let adds = usize::from(!last_hold);
        // Fit the population into 1..=max_workers once the hold is over
        // (2 or more where there is room, so there is a collective).
        loop {
            let h = Hold {
                step,
                point,
                gate,
                next_gate: None,
                joins: Vec::new(),
                kill_peer,
                drain,
                coordinator_down_ms,
                end,
            };
            let after = alive.len() + adds + joins - h.removed().len();
            if after > shape.max_workers {
                if joins > 0 {
                    joins -= 1;
                } else if kill_peer.is_none() && !victims.is_empty() {
                    kill_peer = victims.pop();
                } else if drain.is_none() && coordinator_down_ms.is_none() && !victims.is_empty() {
                    drain = victims.pop();
                } else {
                    end = GateEnd::Kill;
                    if drain == Some(gate) {
                        drain = None;
                    }
                }
            } else if after < 2 && after < shape.max_workers {
                joins += 1;
            } else {
                break;
            }
        }
        let next_gate = (!last_hold).then(|| {
            next_worker += 1;
            next_worker - 1
        });
        let joins: Vec<usize> = (0..joins)
            .map(|_| {
                next_worker += 1;
                next_worker - 1
            })
            .collect();
        let hold = Hold {
            step,
            point,
            gate,
            next_gate,
            joins,
            kill_peer,
            drain,
            coordinator_down_ms,
            end,
        };
        let removed = hold.removed();
        alive.retain(|w| !removed.contains(w));
        alive.extend(hold.next_gate.iter().chain(&hold.joins));
        if let Some(g) = hold.next_gate {
            gate = g;
        }
        holds.push(hold);
    }
    Schedule {
        seed,
        initial_workers,
        holds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        steps: 48,
        checkpoint_every: 4,
        max_workers: 3,
        heartbeat_ms: 4_000,
    };

    /// Replays a schedule's population: every gate is alive when its hold
    /// comes, no victim is a later gate, and the population stays within
    /// 1..=max_workers after every hold.
    fn check(s: &Schedule) {
        let mut alive: Vec<usize> = (0..s.initial_workers).collect();
        let mut prev = 0;
        for (k, h) in s.holds.iter().enumerate() {
            assert!(h.step >= prev + 4 || k == 0, "{s}");
            assert!(h.step + 4 <= SHAPE.steps, "{s}");
            if h.point == Point::InCheckpointWrite {
                assert_eq!(h.step % SHAPE.checkpoint_every, 0, "{s}");
            }
            prev = h.step;
            assert!(alive.contains(&h.gate), "hold {k}: gate not alive\n{s}");
            for v in h.kill_peer.iter().chain(&h.drain) {
                assert!(alive.contains(v), "hold {k}: victim w{v} not alive\n{s}");
            }
            assert_ne!(h.kill_peer, Some(h.gate), "{s}");
            assert!(h.kill_peer.is_none() || h.kill_peer != h.drain, "{s}");
            let removed = h.removed();
            alive.retain(|w| !removed.contains(w));
            alive.extend(h.next_gate.iter().chain(&h.joins));
            assert!(
                (1..=SHAPE.max_workers).contains(&alive.len()),
                "hold {k}: {} workers after\n{s}",
                alive.len()
            );
            if let Some(g) = h.next_gate {
                assert_eq!(s.holds[k + 1].gate, g, "{s}");
            }
        }
        assert!(s.holds.last().unwrap().next_gate.is_none());
    }

    #[test]
    fn schedules_are_reproducible_feasible_and_cover_every_fault() {
        for seed in 0..500 {
            let s = Schedule::generate(seed, SHAPE);
            assert_eq!(s, Schedule::generate(seed, SHAPE), "seed {seed}");
            assert!(s.covers_every_kind());
            check(&s);
        }
    }
}
