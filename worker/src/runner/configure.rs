//! `Configure`: joining a generation of a job (issue 6, "recovery of model
//! state"). Three ways to get the replica, decided from the message alone
//! so every member takes the same path:
//! - `restore_from` set: drop the in-memory state, verify the checkpoint
//!   (complete and intact, `train::checkpoint::marker`), rebuild from it;
//!   a bad one is a `RESTORE_FAILED` naming the file;
//! - some `peers[i].prior` set and a member lacks the state (or, sharded, a
//!   holder's layout changes): state sync over the new collective
//!   (`collective::reshard`). First every member says, in one all-reduce,
//!   whether it can take part: a holder whose own state does not match the
//!   prior the coordinator claims makes every member fail fast with
//!   `STATE_SYNC` instead of waiting out the collective timeout;
//! - otherwise keep a replica already at the configured step that fits the
//!   new rank, or build from the model's init.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use tch::Tensor;
use tracing::info;

use super::thread::{lock, ConfigureError, Held, Peer, Thread};
use crate::collective::reshard::{SyncPlan, DEFAULT_CHUNK};
use crate::collective::{Collective, CollectiveError, Solo};
use crate::config::{JobConfig, Sharding};
use crate::error::classify;
use crate::wire;
use crate::wire::worker_message::Msg;

/// How the replica is obtained.
enum Source {
    Restore(PathBuf),
    Sync(SyncPlan),
    KeepOrInit,
}

/// The members' priors by rank (`None`: no state), if any member has one:
/// from the runs (`Configure.priors`), or from `peers` as an older
/// coordinator sends them.
fn priors(c: &wire::Configure) -> Option<Vec<Option<(usize, usize)>>> {
    let world = c.world_size.max(1) as usize;
    let mut out = vec![None; world];
    let mut any = false;
    for r in &c.priors {
        for i in 0..r.count as usize {
            if let Some(slot) = out.get_mut(r.rank as usize + i) {
                *slot = Some((r.prior_rank as usize + i, r.prior_world_size as usize));
                any = true;
            }
        }
    }
    for p in &c.peers {
        if let (Some(slot), Some(h)) = (out.get_mut(p.rank as usize), &p.prior) {
            *slot = Some((h.rank as usize, h.world_size as usize));
            any = true;
        }
    }
    any.then_some(out)
}

/// The state the coordinator says this worker holds, in either form.
fn own_prior(c: &wire::Configure) -> Option<&wire::HeldState> {
    c.prior.as_ref().or_else(|| {
        c.peers
            .iter()
            .find(|p| p.rank == c.rank)
            .and_then(|p| p.prior.as_ref())
    })
}

fn source(c: &wire::Configure, sharded: bool) -> Source {
    if !c.restore_from.is_empty() {
        return Source::Restore(PathBuf::from(&c.restore_from));
    }
    let Some(priors) = priors(c) else {
        return Source::KeepOrInit;
    };
    let world = priors.len();
    let moves = |(r, p): (usize, &Option<(usize, usize)>)| match p {
        None => true,
        Some(layout) => sharded && *layout != (r, world),
    };
    if priors.iter().enumerate().any(moves) {
        Source::Sync(SyncPlan {
            priors,
            chunk: DEFAULT_CHUNK,
        })
    } else {
        Source::KeepOrInit
    }
}

impl Thread {
    pub(super) fn configure(&mut self, c: wire::Configure) {
        // A checkpoint still being written may be the one to restore from.
        self.writer.wait();
        let cfg = match c.job.as_ref().map(crate::convert::job_config) {
            Some(Ok(cfg)) => JobConfig {
                device: self.device,
                ..cfg
            },
            Some(Err(e)) => {
                let msg = format!("configure: {e}");
                let kind = wire::ErrorKind::InvalidPlan;
                return self.error(&c.job_id, c.generation, c.step, kind, msg, None);
            }
            None => {
                let msg = "configure: job: missing (the coordinator sets every field)".to_string();
                let kind = wire::ErrorKind::InvalidPlan;
                return self.error(&c.job_id, c.generation, c.step, kind, msg, None);
            }
        };
        if c.role() == wire::Role::Generator {
            return self.configure_generator(&c, &cfg);
        }
        self.weight_ring = None;
        let sharded = cfg.sharding != Sharding::Ddp;
        let result = match source(&c, sharded) {
            Source::Restore(dir) => {
                self.drop_replica();
                self.restore(&c, &cfg, &dir).map(|()| "restored")
            }
            Source::Sync(plan) => self.sync(&c, &cfg, &plan).map(|()| "synced"),
            Source::KeepOrInit => self.keep_or_init(&c, &cfg),
        };
        // The replica holds the generation's collective: its
        // context-parallel group joins after it.
        let result = result.and_then(|how| self.join_context(&c, &cfg).map(|()| how));
        let how = match result {
            Ok(how) => how,
            Err((kind, msg, peer)) => {
                self.weight_ring = None;
                self.serve_weights(&c);
                if matches!(
                    kind,
                    wire::ErrorKind::StateSync | wire::ErrorKind::RestoreFailed
                ) {
                    self.drop_replica();
                }
                return self.error_blaming(&c.job_id, c.generation, c.step, kind, msg, peer);
            }
        };
        // ReplicatedTrainer rank 0 of a disaggregated generation serves the policy.
        self.serve_weights(&c);
        let h = self.job.as_mut().expect("configured above");
        h.generation = c.generation;
        h.rank = c.rank;
        h.world_size = c.world_size;
        h.gather_results = c.gather_results;
        h.step = c.step;
        h.exec.zero_grad();
        let held = h.held_state();
        self.progress
            .generation
            .store(c.generation, Ordering::Relaxed);
        self.progress.step.store(c.step, Ordering::Relaxed);
        self.progress.set_held(Some(held));
        self.last_done = std::time::Instant::now();
        info!(job = %c.job_id, generation = c.generation, rank = c.rank, step = c.step, how, "configured");
        self.send(Msg::Ready(wire::Ready {
            job_id: c.job_id,
            generation: c.generation,
            step: c.step,
        }));
    }

    fn drop_replica(&mut self) {
        self.job = None;
        self.progress.set_held(None);
    }

    /// Today's path: keep a replica at the configured step that fits the
    /// new rank (a new generation or a reconnect), else build from init.
    fn keep_or_init(
        &mut self,
        c: &wire::Configure,
        cfg: &JobConfig,
    ) -> Result<&'static str, ConfigureError> {
        let (rank, world) = (c.rank as usize, c.world_size.max(1) as usize);
        if priors(c).is_some() {
            // The coordinator says every member holds the state in place.
            if let Err(msg) = self.check_prior(c) {
                return Err((wire::ErrorKind::StateSync, msg, None));
            }
        }
        let keep = self
            .job
            .as_ref()
            .is_some_and(|h| h.job == c.job_id && h.step == c.step && h.exec.fits(rank, world));
        if !keep {
            // Frees the old replica (and its collective) before joining.
            self.drop_replica();
        }
        let coll = self.connect(c)?;
        match self.job.as_mut() {
            Some(h) => h.exec.set_collective(coll).map_err(|e| {
                let msg = format!("configure: joining generation {}: {e:#}", c.generation);
                (wire::ErrorKind::InvalidPlan, msg, None)
            })?,
            None => {
                if priors(c).is_some() {
                    let msg = "configure: state sync: no member lacks the state, yet this \
                               worker holds none"
                        .to_string();
                    return Err((wire::ErrorKind::StateSync, msg, None));
                }
                self.job = Some(self.build(c, cfg, coll, None)?);
            }
        }
        Ok(if keep { "kept" } else { "built" })
    }

    /// Rebuilds from a verified checkpoint directory.
    fn restore(
        &mut self,
        c: &wire::Configure,
        cfg: &JobConfig,
        dir: &Path,
    ) -> Result<(), ConfigureError> {
        let restore_failed = |msg: String| (wire::ErrorKind::RestoreFailed, msg, None);
        let verified = accrue_checkpoint::verify(dir).map_err(|e| {
            restore_failed(format!(
                "configure: restoring step {} from {}: {e}",
                c.step,
                dir.display()
            ))
        })?;
        if !verified.marked {
            tracing::warn!(dir = %dir.display(), "checkpoint without rank markers (written before markers existed): not verified");
        }
        check_restore_step(dir, c.step).map_err(restore_failed)?;
        let coll = self.connect(c)?;
        let h = self
            .build(c, cfg, coll, Some(dir))
            .map_err(|(_, msg, _)| (wire::ErrorKind::RestoreFailed, msg, None))?;
        self.job = Some(h);
        Ok(())
    }

    /// State sync from the members that hold the configured step.
    fn sync(
        &mut self,
        c: &wire::Configure,
        cfg: &JobConfig,
        plan: &SyncPlan,
    ) -> Result<(), ConfigureError> {
        let mine = plan.priors.get(c.rank as usize).copied().flatten();
        let check = match mine {
            Some(_) => self.check_prior(c),
            None => Ok(()),
        };
        let mut coll = self.connect(c)?;
        let sync_failed = |e: &anyhow::Error, what: &str| {
            let msg = format!(
                "configure: state sync of step {} into generation {}: {what}: {e:#}",
                c.step, c.generation
            );
            (
                wire::ErrorKind::StateSync,
                msg,
                classify(e).1.map(Peer::Rank),
            )
        };
        // Every member says whether it can take part.
        let mut flag = Tensor::from_slice(&[if check.is_ok() { 0f32 } else { 1f32 }]);
        coll.all_reduce_sum(&mut flag)
            .map_err(|e| sync_failed(&anyhow::Error::from(e), "agreeing to sync"))?;
        let failed = f32::try_from(&flag).unwrap_or(1.0);
        if let Err(msg) = check {
            return Err((wire::ErrorKind::StateSync, msg, None));
        }
        if failed > 0.0 {
            let msg = format!(
                "configure: state sync of step {}: {failed} member(s) do not hold the state \
                 the coordinator says they hold",
                c.step
            );
            return Err((wire::ErrorKind::StateSync, msg, None));
        }
        let synced = match mine {
            Some(_) => {
                let h = self.job.as_mut().expect("checked by check_prior");
                h.exec.sync_state(Some(coll), plan)
            }
            None => {
                self.drop_replica();
                let mut h = self.build(c, cfg, coll, None)?;
                let r = h.exec.sync_state(None, plan);
                self.job = Some(h);
                r
            }
        };
        synced.map_err(|e| sync_failed(&e, "receiving the state"))
    }

    /// Whether this worker holds what the coordinator's prior for it says
    /// (job, step, layout); the error names the mismatch.
    fn check_prior(&self, c: &wire::Configure) -> Result<(), String> {
        let Some(prior) = own_prior(c) else {
            return Ok(());
        };
        let claim = format!(
            "the coordinator says this worker holds job {} step {} as rank {} of {}",
            prior.job_id, prior.step, prior.rank, prior.world_size
        );
        let Some(h) = &self.job else {
            return Err(format!(
                "configure: state sync: {claim}, but it holds no state"
            ));
        };
        let layout = h.exec.state_layout();
        let layout_ok =
            layout.is_none_or(|l| l == (prior.rank as usize, prior.world_size as usize));
        if h.job != prior.job_id || h.step != prior.step || prior.step != c.step || !layout_ok {
            let held = match layout {
                Some((r, w)) => format!("job {} step {} as rank {r} of {w}", h.job, h.step),
                None => format!("job {} step {} (whole)", h.job, h.step),
            };
            return Err(format!(
                "configure: state sync to step {}: {claim}, but it holds {held}",
                c.step
            ));
        }
        Ok(())
    }

    /// This rank's collective for the generation `c` describes, and
    /// after it the weight ring when `c` names one (trainer rank 0 of a
    /// disaggregated generation: kept for its weight server).
    fn connect(&mut self, c: &wire::Configure) -> Result<Box<dyn Collective>, ConfigureError> {
        let train = self.connect_training(c)?;
        self.weight_ring = None;
        if c.weights.is_some() {
            let (ring, _) = self.connect_weight_ring(c)?;
            self.weight_ring = Some(ring);
        }
        Ok(train)
    }

    /// The training collective of `c`; its abort handle is kept for
    /// [`super::handle::Runner::submit`].
    fn connect_training(&self, c: &wire::Configure) -> Result<Box<dyn Collective>, ConfigureError> {
        lock(&self.in_flight).collective = None;
        if c.world_size <= 1 {
            return Ok(Box::new(Solo));
        }
        let failed = |e: CollectiveError| {
            let msg = format!(
                "configure: joining the collective of generation {} as rank {} of {}: {e}",
                c.generation, c.rank, c.world_size
            );
            let peer = e.peer().map(|p| Peer::Rank(p as u32));
            (wire::ErrorKind::CollectiveTimeout, msg, peer)
        };
        let coll = self.join_ring(c).map_err(failed)?;
        if (coll.rank(), coll.world_size()) != (c.rank as usize, c.world_size as usize) {
            let msg = format!(
                "configure: the collective says rank {} of {}, the coordinator rank {} of {}",
                coll.rank(),
                coll.world_size(),
                c.rank,
                c.world_size
            );
            return Err((wire::ErrorKind::Internal, msg, None));
        }
        if let Some(abort) = coll.abort_handle() {
            lock(&self.in_flight).collective = Some((c.generation, abort));
        }
        Ok(Box::new(crate::collective::timed::Timed(coll)))
    }

    /// A fresh replica for `c`: the model built from its init or restored.
    fn build(
        &self,
        c: &wire::Configure,
        cfg: &JobConfig,
        coll: Box<dyn Collective>,
        restore: Option<&Path>,
    ) -> Result<Held, ConfigureError> {
        let exec = (self.factory)(cfg, restore, coll).map_err(|e| {
            let from = restore.map_or("the model's init".into(), |p| p.display().to_string());
            let msg = format!("configure: building the model from {from}: {e:#}");
            (wire::ErrorKind::Internal, msg, None)
        })?;
        Ok(Held {
            job: c.job_id.clone(),
            generation: c.generation,
            rank: c.rank,
            world_size: c.world_size,
            gather_results: c.gather_results,
            step: c.step,
            name: cfg.name.clone(),
            exec,
        })
    }
}

/// A replica restored from `dir` must hold the step it is configured at:
/// training on from an older checkpoint while reporting a newer step would
/// silently diverge from the other ranks.
fn check_restore_step(dir: &Path, step: u64) -> Result<(), String> {
    let m = accrue_checkpoint::read_manifest(dir).map_err(|e| format!("configure: {e}"))?;
    if m.step != step {
        return Err(format!(
            "configure: {} holds step {}, but this replica is configured at step {step}; \
             refusing to train from mismatched state",
            dir.join(accrue_checkpoint::MANIFEST).display(),
            m.step
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The O(1) Configure (issue 19): the neighbour, this rank's prior and
    /// the runs say what the full peer list said.
    #[test]
    fn runs_and_next_read_as_the_full_peer_list_did() {
        let c = wire::Configure {
            link_key: vec![9; 32],
            rank: 1,
            world_size: 4,
            next: Some(wire::Peer {
                rank: 2,
                collective_addr: "h:2".into(),
                ..Default::default()
            }),
            priors: vec![
                wire::PriorRun {
                    rank: 0,
                    count: 2,
                    prior_rank: 1,
                    prior_world_size: 3,
                },
                wire::PriorRun {
                    rank: 3,
                    count: 1,
                    prior_rank: 0,
                    prior_world_size: 3,
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            priors(&c),
            Some(vec![Some((1, 3)), Some((2, 3)), None, Some((0, 3))])
        );
        let addrs = super::super::work::ring_addrs(&c).unwrap();
        assert_eq!(addrs, vec!["", "", "h:2", ""]);
        let wrong = wire::Configure {
            link_key: vec![9; 32],
            rank: 2,
            ..c.clone()
        };
        assert!(super::super::work::ring_addrs(&wrong).is_err());
        let none = wire::Configure {
            link_key: vec![9; 32],
            priors: Vec::new(),
            ..c
        };
        assert_eq!(priors(&none), None);
    }
}
