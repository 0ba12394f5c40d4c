//! Keeping this coordinator's output markers true (issue 33, finding 8):
//! every [`output::REFRESH_MS`] the markers of its live jobs say they are
//! live, and a job's marker says it ended once it has, so that another
//! coordinator on the same volume leaves the directories of live jobs
//! alone and takes the others at once (see `crate::shell::output`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::{error, warn};

use crate::core::JobId;
use crate::shell::output::{self, Holder, Owner, Refreshed};

/// The markers this coordinator keeps.
pub(super) struct Markers {
    holder: Holder,
    kept: Mutex<Kept>,
}

/// By job: the markers released (the job ended), which a refresh under
/// way must not make live again, and those another coordinator took over
/// (logged once).
#[derive(Default)]
struct Kept {
    released: HashSet<JobId>,
    lost: HashSet<JobId>,
}

impl Markers {
    pub(super) fn new(holder: Holder) -> Markers {
        Markers {
            holder,
            kept: Mutex::default(),
        }
    }

    /// The coordinator the markers name.
    pub(super) fn holder(&self) -> &Holder {
        &self.holder
    }

    /// Rewrites the markers of the `live` jobs (each the marker its
    /// submit wrote, and its directory) with `now_ms` as their liveness.
    pub(super) fn refresh(&self, live: &[(Owner, PathBuf)], now_ms: i64) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        // A job missing here ended before the jobs were read: no later
        // pass names it, so neither set needs it any more.
        let ids: HashSet<&str> = live.iter().map(|(o, _)| o.job.as_str()).collect();
        kept.released.retain(|j| ids.contains(j.as_str()));
        kept.lost.retain(|j| ids.contains(j.as_str()));
        for (owner, dir) in live {
            if kept.released.contains(&owner.job) {
                continue;
            }
            match output::refresh(dir, owner, now_ms) {
                Ok(Refreshed::Done) => {
                    kept.lost.remove(&owner.job);
                }
                Ok(Refreshed::TakenOver(other)) => {
                    if kept.lost.insert(owner.job.clone()) {
                        error!(job = %owner.job, dir = %dir.display(), other_job = %other.job, coordinator = %other.coordinator, state_dir = %other.state_dir.display(), "another job holds this job's output_dir now (a coordinator took it over while this one was away): cancel one of them");
                    }
                }
                Err(e) => warn!(job = %owner.job, %e, "refreshing the output marker failed"),
            }
        }
    }

    /// Marks the marker of `job`, which ended, so: its directory is free
    /// to any coordinator from now on.
    pub(super) fn release(&self, job: &str, dir: &Path, now_ms: i64) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if !kept.released.insert(job.to_string()) {
            return;
        }
        if let Err(e) = output::release(dir, job, &self.holder, now_ms) {
            warn!(%job, %e, "marking the output marker ended failed");
        }
    }
}
