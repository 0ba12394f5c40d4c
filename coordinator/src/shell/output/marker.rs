//! The ownership marker a job writes in its output directory at submit
//! (issue 14), and what keeps two coordinators on one volume apart (issue
//! 33, finding 8): the marker names the coordinator running the job (an
//! id its state dir keeps) and when it last said the job was live. That
//! coordinator rewrites the markers of its live jobs every
//! [`REFRESH_MS`] and marks a job's ended when it ends; another
//! coordinator leaves a directory alone while its marker is fresh, and
//! takes over one whose coordinator stopped refreshing it (with a
//! warning). A job of the same coordinator is judged by the core instead
//! (`Coordinator::check_output_free`), which knows which are live.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::real_path::real_path;
use crate::core::Nesting;

/// The marker's file name inside `job.output_dir`.
pub const MARKER: &str = ".accrue-job.json";

/// How often a coordinator rewrites the markers of its live jobs.
pub const REFRESH_MS: i64 = 30_000;

/// A marker refreshed longer ago than this is stale: its coordinator
/// missed four refreshes, so it is gone (or cut off from the volume).
pub const FRESH_MS: i64 = 120_000;

/// This coordinator, as its markers name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Generated once per state dir and kept there (`Store::coordinator_id`).
    pub id: String,
    /// Where that state is, for an operator a refusal points at.
    pub state_dir: PathBuf,
}

/// Who owns an output directory: written at submit, refreshed while the
/// job is live, read to name the owner when another job asks for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub job: String,
    pub name: String,
    pub submitted_unix_ms: i64,
    /// The coordinator running the job ([`Holder::id`]); empty in markers
    /// written before coordinators had one, which nobody refreshes.
    #[serde(default)]
    pub coordinator: String,
    #[serde(default)]
    pub state_dir: PathBuf,
    /// When that coordinator last said the job was live.
    #[serde(default)]
    pub alive_unix_ms: i64,
    /// When it saw the job end: from then on the directory is free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_unix_ms: Option<i64>,
}

impl Owner {
    /// The marker of job `job` (`name`) submitted now to `holder`.
    pub fn new(job: &str, name: &str, holder: &Holder, now_ms: i64) -> Owner {
        Owner {
            job: job.to_string(),
            name: name.to_string(),
            submitted_unix_ms: now_ms,
            coordinator: holder.id.clone(),
            state_dir: holder.state_dir.clone(),
            alive_unix_ms: now_ms,
            ended_unix_ms: None,
        }
    }

    /// Whether coordinator `me` must leave this marker's directory alone
    /// at `now_ms`: another coordinator's job, not ended, refreshed
    /// within [`FRESH_MS`] (a clock ahead of ours counts as fresh).
    pub fn held_against(&self, me: &str, now_ms: i64) -> bool {
        !self.coordinator.is_empty()
            && self.coordinator != me
            && self.ended_unix_ms.is_none()
            && now_ms - self.alive_unix_ms < FRESH_MS
    }
}

/// Why an output directory cannot be used or written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("job.output_dir {dir}: {what}: {source}")]
    Io {
        dir: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("job.output_dir {dir} exists and is not a directory")]
    NotADirectory { dir: PathBuf },
    #[error("job.output_dir {dir} is {nesting} {held}, the output directory of job {} ({}) on another coordinator (state dir {}), live {age_s}s ago: give this job another output_dir, or end that job there (a marker not refreshed for {}s is taken over)", .owner.job, .owner.name, .owner.state_dir.display(), FRESH_MS / 1000)]
    HeldElsewhere {
        dir: PathBuf,
        nesting: Nesting,
        held: PathBuf,
        owner: Box<Owner>,
        age_s: i64,
    },
}

/// The owner recorded in `dir`, if a readable marker is there.
pub fn owner(dir: &Path) -> Option<Owner> {
    let bytes = std::fs::read(dir.join(MARKER)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Claims `dir` for `owner`: refused when a live job of another
/// coordinator holds it or a directory above it; else creates it and
/// writes the marker. An unwritable directory is refused here, before the
/// job exists. (A live job of another coordinator *below* `dir` is not
/// looked for: that would walk the whole tree.)
pub fn claim(dir: &Path, owner: &Owner, now_ms: i64) -> Result<(), OutputError> {
    if dir.exists() && !dir.is_dir() {
        return Err(OutputError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    let real = real_path(dir);
    for held in real.ancestors() {
        let Some(previous) = self::owner(held) else {
            continue;
        };
        if previous.held_against(&owner.coordinator, now_ms) {
            return Err(OutputError::HeldElsewhere {
                dir: dir.to_path_buf(),
                nesting: Nesting::of(&real, held).unwrap_or(Nesting::Inside),
                held: held.to_path_buf(),
                age_s: (now_ms - previous.alive_unix_ms) / 1000,
                owner: Box::new(previous),
            });
        }
        if held != real {
            continue;
        }
        let foreign = !previous.coordinator.is_empty() && previous.coordinator != owner.coordinator;
        if foreign && previous.ended_unix_ms.is_none() {
            tracing::warn!(job = %owner.job, previous = %previous.job, coordinator = %previous.coordinator, state_dir = %previous.state_dir.display(), dir = %dir.display(), "output_dir taken over from a coordinator that stopped refreshing its marker");
        } else {
            tracing::info!(job = %owner.job, previous = %previous.job, dir = %dir.display(), "output_dir taken over from an ended or unknown job");
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| OutputError::Io {
        dir: dir.to_path_buf(),
        what: "cannot create it",
        source,
    })?;
    write(dir, owner)
}

/// What refreshing a live job's marker found.
#[derive(Debug, PartialEq, Eq)]
pub enum Refreshed {
    /// The marker says the job is live as of now.
    Done,
    /// Another job's marker is there now (another coordinator took the
    /// directory over while this one was away): left as it is.
    TakenOver(Owner),
}

/// Rewrites the marker of a live job with `now_ms` as its liveness:
/// `expected` is the marker it wrote at submit, written again when the
/// marker is missing or unreadable; one naming another job is left alone.
pub fn refresh(dir: &Path, expected: &Owner, now_ms: i64) -> Result<Refreshed, OutputError> {
    let mut marker = match owner(dir) {
        Some(m) if !(m.job == expected.job && m.coordinator == expected.coordinator) => {
            return Ok(Refreshed::TakenOver(m))
        }
        Some(m) => m,
        None => expected.clone(),
    };
    marker.alive_unix_ms = now_ms;
    write(dir, &marker).map(|()| Refreshed::Done)
}

/// Marks job `job` of `holder` ended in `dir`'s marker, freeing the
/// directory for any coordinator at once; a marker naming another job is
/// left alone.
pub fn release(dir: &Path, job: &str, holder: &Holder, now_ms: i64) -> Result<(), OutputError> {
    match owner(dir) {
        Some(mut m) if m.job == job && m.coordinator == holder.id && m.ended_unix_ms.is_none() => {
            m.ended_unix_ms = Some(now_ms);
            write(dir, &m)
        }
        _ => Ok(()),
    }
}

/// Writes `owner` as `dir`'s marker through a temporary file and a rename,
/// so a reader never sees half of it (the temporary file is this
/// process's own: another coordinator may write beside it).
fn write(dir: &Path, owner: &Owner) -> Result<(), OutputError> {
    let io = |source| OutputError::Io {
        dir: dir.to_path_buf(),
        what: "cannot write its ownership marker",
        source,
    };
    let tmp = dir.join(format!("{MARKER}.{}.tmp", std::process::id()));
    let body = serde_json::to_vec_pretty(owner).expect("the marker serialises");
    std::fs::write(&tmp, body).map_err(io)?;
    std::fs::rename(&tmp, dir.join(MARKER)).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(id: &str) -> Holder {
        Holder {
            id: id.into(),
            state_dir: PathBuf::from(format!("/state/{id}")),
        }
    }

    #[test]
    fn a_claim_writes_a_marker_naming_the_job_and_its_coordinator() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out/run");
        let a = Owner::new("a", "n", &holder("c1"), 1);
        claim(&out, &a, 1).unwrap();
        assert_eq!(owner(&out), Some(a));
        claim(&out, &Owner::new("b", "n", &holder("c1"), 2), 2).unwrap();
        let b = owner(&out).unwrap();
        assert_eq!((b.job.as_str(), b.coordinator.as_str()), ("b", "c1"));
    }

    #[test]
    fn an_output_dir_that_is_a_file_or_unwritable_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let a = Owner::new("a", "n", &holder("c1"), 1);
        let e = claim(&file, &a, 1).unwrap_err();
        assert!(matches!(e, OutputError::NotADirectory { .. }), "{e}");
        let e = claim(&file.join("sub"), &a, 1).unwrap_err();
        assert!(
            matches!(
                e,
                OutputError::Io {
                    what: "cannot create it",
                    ..
                }
            ),
            "{e}"
        );
    }

    /// Issue 33 (8): a second coordinator on the volume took a live job's
    /// directory over. A marker another coordinator refreshed within
    /// FRESH_MS refuses the claim, for the directory and any inside it,
    /// naming the job and that coordinator's state dir; a stale one, an
    /// ended job's, one of our own and one written before coordinators
    /// had ids are taken over.
    #[test]
    fn another_live_coordinators_marker_refuses_the_claim_until_stale_or_ended() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("run");
        let theirs = Owner::new("theirs", "their-job", &holder("c2"), 1_000);
        claim(&out, &theirs, 1_000).unwrap();
        let ours = |now| Owner::new("ours", "our-job", &holder("c1"), now);
        let now = 1_000 + FRESH_MS - 1;
        for dir in [out.clone(), out.join("checkpoints")] {
            let e = claim(&dir, &ours(now), now).unwrap_err();
            let OutputError::HeldElsewhere { ref owner, .. } = e else {
                panic!("{e}");
            };
            assert_eq!(owner.job, "theirs");
            let msg = e.to_string();
            assert!(
                msg.contains("/state/c2") && msg.contains("their-job"),
                "{msg}"
            );
        }
        assert!(
            !out.join("checkpoints").exists(),
            "a refusal creates nothing"
        );
        // Our own marker, or an unnamed coordinator's, never holds.
        assert!(!theirs.held_against("c2", now));
        let legacy = Owner {
            coordinator: String::new(),
            ..theirs.clone()
        };
        assert!(!legacy.held_against("c1", now));
        // Ended: free at once.
        release(&out, "theirs", &holder("c2"), now).unwrap();
        claim(&out, &ours(now), now).unwrap();
        assert_eq!(owner(&out).unwrap().job, "ours");
        // Stale: taken over.
        write(&out, &theirs).unwrap();
        let later = 1_000 + FRESH_MS;
        claim(&out, &ours(later), later).unwrap();
        assert_eq!(owner(&out).unwrap().job, "ours");
    }

    #[test]
    fn a_refresh_keeps_the_marker_fresh_unless_another_job_took_it() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("run");
        let me = holder("c1");
        let submitted = Owner::new("j", "n", &me, 5);
        claim(&out, &submitted, 5).unwrap();
        assert_eq!(refresh(&out, &submitted, 50).unwrap(), Refreshed::Done);
        assert_eq!(owner(&out).unwrap().alive_unix_ms, 50);
        // A deleted marker is written again, keeping the submit time.
        std::fs::remove_file(out.join(MARKER)).unwrap();
        refresh(&out, &submitted, 60).unwrap();
        let m = owner(&out).unwrap();
        assert_eq!((m.submitted_unix_ms, m.alive_unix_ms), (5, 60));
        // Taken over by another coordinator: left alone.
        let theirs = Owner::new("k", "n", &holder("c2"), 70);
        claim(&out, &theirs, 70 + FRESH_MS).unwrap();
        assert_eq!(
            refresh(&out, &submitted, 80).unwrap(),
            Refreshed::TakenOver(theirs.clone())
        );
        release(&out, "j", &me, 90).unwrap();
        assert_eq!(owner(&out), Some(theirs));
    }
}
