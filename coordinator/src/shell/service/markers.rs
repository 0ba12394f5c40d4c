//! Keeping this coordinator's output markers true (issue 33, finding 8):
//! every [`output::REFRESH_MS`] the markers of its live jobs say they are live,
//! and a job's marker says it ended once it has, so that another
//! coordinator on the same volume leaves the directories of live jobs
//! alone and takes the others at once (see `crate::shell::output`).

use std::collections::HashSet;

use tracing::{error, warn};

use super::shared::{now_ms, Shared};
use crate::core::JobId;
use crate::shell::output::{self, Owner, Refreshed};

/// The markers this coordinator keeps, by job: those it released (the
/// job ended), which a refresh under way must not make live again, and
/// those another coordinator took over (logged once).
#[derive(Default)]
pub(super) struct Markers {
    released: HashSet<JobId>,
    lost: HashSet<JobId>,
}

impl Shared {
    /// Rewrites the markers of the live jobs with `now_ms` as their
    /// liveness. The jobs are read under the state lock, the files written
    /// after it is released.
    pub fn refresh_markers(&self, now_ms: i64) {
        let live: Vec<(Owner, std::path::PathBuf)> = {
            let inner = self.lock();
            inner
                .core
                .jobs()
                .filter(|j| !j.rec.state.is_terminal())
                .map(|j| {
                    let owner = Owner {
                        submitted_unix_ms: j.rec.submitted_unix_ms,
                        ..Owner::new(&j.rec.id, &j.rec.name, &self.holder, now_ms)
                    };
                    (owner, j.spec.job.output_dir.clone())
                })
                .collect()
        };
        let mut markers = self.markers.lock().unwrap_or_else(|p| p.into_inner());
        // A job missing here ended before this pass read the jobs: no
        // later pass names it, so neither list needs it any more.
        let ids: HashSet<&str> = live.iter().map(|(o, _)| o.job.as_str()).collect();
        markers.released.retain(|j| ids.contains(j.as_str()));
        markers.lost.retain(|j| ids.contains(j.as_str()));
        for (owner, dir) in &live {
            if markers.released.contains(&owner.job) {
                continue;
            }
            match output::refresh(dir, owner, now_ms) {
                Ok(Refreshed::Done) => {
                    markers.lost.remove(&owner.job);
                }
                Ok(Refreshed::TakenOver(other)) => {
                    if markers.lost.insert(owner.job.clone()) {
                        error!(job = %owner.job, dir = %dir.display(), other_job = %other.job, coordinator = %other.coordinator, state_dir = %other.state_dir.display(), "another job holds this job's output_dir now (a coordinator took it over while this one was away): cancel one of them");
                    }
                }
                Err(e) => warn!(job = %owner.job, %e, "refreshing the output marker failed"),
            }
        }
    }

    /// Marks the output marker of `job`, which ended, so: its directory
    /// is free to any coordinator from now on.
    pub(super) fn release_marker(&self, job: &str, dir: &std::path::Path) {
        let mut markers = self.markers.lock().unwrap_or_else(|p| p.into_inner());
        if !markers.released.insert(job.to_string()) {
            return;
        }
        if let Err(e) = output::release(dir, job, &self.holder, now_ms()) {
            warn!(%job, %e, "marking the output marker ended failed");
        }
    }
}
