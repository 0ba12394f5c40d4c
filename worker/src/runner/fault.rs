//! Fault injection for the real-process fault suite (issue 6 "Done
//! means"): `ACCRUE_FAULT=stop:<point>:<step>[:<rank>]`, read once at the
//! first check, makes the worker log `fault point <point> reached at step
//! N` and stop itself with SIGSTOP at that point of step N (on every rank,
//! or only on `<rank>`), so the test can `kill -9` it there or resume it
//! with SIGCONT. It fires once per process. Points:
//! - `before_step`: a plan received, nothing of the step run yet;
//! - `mid_microbatch`: the step's first microbatch done, its gradients
//!   accumulated, the rest of the step not run;
//! - `in_collective`: at the accumulation boundary, as the gradient
//!   reduction starts (the peers wait inside it);
//! - `in_checkpoint_write`: a checkpoint of step N has its files written
//!   but not yet its marker (nor, on rank 0, the manifest).
//!
//! Unset, a check is one load of an initialised `OnceLock`.

use std::sync::OnceLock;

use tracing::{error, warn};

/// Where a fault can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    BeforeStep,
    MidMicrobatch,
    InCollective,
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

    fn parse(s: &str) -> Option<Point> {
        [
            Point::BeforeStep,
            Point::MidMicrobatch,
            Point::InCollective,
            Point::InCheckpointWrite,
        ]
        .into_iter()
        .find(|p| p.name() == s)
    }
}

/// A parsed `ACCRUE_FAULT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub point: Point,
    pub step: u64,
    pub rank: Option<u32>,
}

impl Fault {
    /// Parses `stop:<point>:<step>[:<rank>]`; the error names what is wrong.
    pub fn parse(s: &str) -> Result<Fault, String> {
        let parts: Vec<&str> = s.trim().split(':').collect();
        let bad = |why: &str| {
            format!("ACCRUE_FAULT={s:?}: {why} (expected stop:<point>:<step>[:<rank>])")
        };
        match parts.as_slice() {
            ["stop", point, step, rest @ ..] if rest.len() <= 1 => {
                let point = Point::parse(point).ok_or_else(|| {
                    bad("point must be before_step, mid_microbatch, in_collective or in_checkpoint_write")
                })?;
                let step = step.parse().map_err(|_| bad("step is not a number"))?;
                let rank = match rest {
                    [r] => Some(r.parse().map_err(|_| bad("rank is not a number"))?),
                    _ => None,
                };
                Ok(Fault { point, step, rank })
            }
            _ => Err(bad("malformed")),
        }
    }

    /// Whether this fault fires at `point` of `step` on `rank`.
    pub fn matches(&self, point: Point, step: u64, rank: u32) -> bool {
        self.point == point && self.step == step && self.rank.is_none_or(|r| r == rank)
    }
}

fn configured() -> Option<Fault> {
    static FAULT: OnceLock<Option<Fault>> = OnceLock::new();
    *FAULT.get_or_init(|| {
        let s = std::env::var("ACCRUE_FAULT").ok()?;
        match Fault::parse(&s) {
            Ok(f) => {
                warn!(?f, "fault injection armed");
                Some(f)
            }
            Err(e) => {
                error!(%e, "ignoring ACCRUE_FAULT");
                None
            }
        }
    })
}

/// Whether `ACCRUE_FAULT` names this point (it may already have fired).
pub fn armed(point: Point, step: u64, rank: u32) -> bool {
    configured().is_some_and(|f| f.matches(point, step, rank))
}

/// Stops the process (SIGSTOP) if `ACCRUE_FAULT` names this point.
pub fn point(point: Point, step: u64, rank: u32) {
    // Fires once per process: a replay of the same step after recovery
    // must not stop the worker again.
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(f) = configured() else { return };
    if f.matches(point, step, rank) && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        error!(
            point = point.name(),
            step,
            rank,
            "fault point {} reached at step {step}",
            point.name()
        );
        stop_self();
    }
}

#[cfg(unix)]
fn stop_self() {
    // SAFETY: raise(3) takes a signal number and has no other preconditions.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
}

#[cfg(not(unix))]
fn stop_self() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_match() {
        let f = Fault::parse("stop:in_collective:3:1").unwrap();
        assert_eq!(
            f,
            Fault {
                point: Point::InCollective,
                step: 3,
                rank: Some(1)
            }
        );
        assert!(f.matches(Point::InCollective, 3, 1));
        assert!(!f.matches(Point::InCollective, 3, 0));
        assert!(!f.matches(Point::BeforeStep, 3, 1));
        let any = Fault::parse("stop:before_step:2").unwrap();
        assert!(any.matches(Point::BeforeStep, 2, 7));
        for bad in [
            "",
            "stop:nowhere:1",
            "stop:before_step:x",
            "kill:before_step:1",
            "stop:before_step:1:2:3",
        ] {
            assert!(Fault::parse(bad).is_err(), "{bad}");
        }
        assert!(Fault::parse("stop:nowhere:1")
            .unwrap_err()
            .contains("point"));
    }
}
