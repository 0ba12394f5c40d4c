//! Generations and their state (DESIGN.md "Elasticity", issue 6): forming
//! one (who joins, and where its state comes from: [`super::recovery`]
//! decides), Ready, re-forming at step boundaries, replaying committed
//! steps after a restore, the checkpoint index (asynchronous acks, `keep`,
//! fallback when a checkpoint fails to restore), and what each worker holds.

use std::sync::Arc;

use tracing::{info, warn};

use super::jobs::{Generation, Job, JobState};
use super::machine::{publish_event, Coordinator};
use super::recovery::{self, CheckpointEntry, ReplayError, Situation, Source};
use super::step::{self, PlannedStep};
use super::workers::{WorkerId, WorkerState};
use super::{Effect, HeldState, ToWorker};
use crate::spec::Sharding;

impl Coordinator {
    /// Every rank re-ran a committed step: the generation moves on, nothing
    /// commits again (no metrics, no cursor move, no manifest rewrite).
    pub(super) fn replayed(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("replaying a known job");
        let flight = job.inflight.take().expect("replaying an in-flight step");
        let gen = job.gen.as_mut().expect("replaying within a generation");
        gen.step = flight.planned.step;
        info!(job = job_id, step = gen.step, "step replayed");
        if !job.replaying() {
            info!(job = job_id, step = job.rec.step, "replay complete");
            self.at_boundary(job_id, now_ms, fx);
        }
    }

    /// Forms a new generation at this boundary. The state comes from the
    /// members' memory where it can (see [`recovery::decide`]); only a
    /// zero2/fsdp drain first writes the current step to disk, because the
    /// leaver's shards would otherwise be lost (no dispatch meanwhile).
    /// During a replay the change waits for the replay's end.
    pub(super) fn regroup(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let leaving = self.jobs[job_id].gen.as_ref().is_some_and(|g| {
            g.members
                .iter()
                .any(|m| self.workers.get(m).is_some_and(|w| w.draining))
        });
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.replaying() {
            return;
        }
        let step = job.rec.step;
        let sharded = job.spec.parallel.sharding != Sharding::Ddp;
        let on_disk = step == 0 || job.rec.checkpoints.iter().any(|c| c.step == step);
        if sharded && leaving && !on_disk {
            request_checkpoint(job, fx);
            job.regroup_after_checkpoint = true;
            return;
        }
        job.regroup_after_checkpoint = false;
        self.release_drained(job_id, fx);
        self.dissolve_generation(job_id, "membership change at step boundary", now_ms, fx);
    }

    /// Sends Release to the draining members of a job's generation.
    pub(super) fn release_drained(&mut self, job_id: &str, fx: &mut Vec<Effect>) {
        let Some(gen) = self.jobs.get(job_id).and_then(|j| j.gen.clone()) else {
            return;
        };
        for m in gen.members {
            if let Some(w) = self.workers.get_mut(&m).filter(|w| w.draining) {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: job_id.to_string(),
                        reason: "drained".into(),
                    },
                });
                w.state = WorkerState::Draining;
            }
        }
    }

    /// A rank's part of a checkpoint is durable; once every writer of its
    /// generation reported, the checkpoint joins the job's index (the
    /// oldest beyond `checkpoint.keep` drop out, and the replay history
    /// below the oldest kept one with them).
    pub(super) fn on_checkpoint_done(
        &mut self,
        worker: &str,
        job_id: &str,
        step: u64,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some(acks) = job.pending_checkpoints.get_mut(&step) else {
            return;
        };
        if let Some(a) = acks.get_mut(worker) {
            *a = true;
        }
        if !acks.values().all(|&a| a) {
            return;
        }
        job.pending_checkpoints.remove(&step);
        let entry = CheckpointEntry {
            step,
            dir: job.checkpoint_dir(step),
        };
        let keep = job.spec.checkpoint.keep as usize;
        if let Some(oldest) = recovery::add_checkpoint(&mut job.rec.checkpoints, entry, keep) {
            job.rec.history_from = job.rec.history_from.max(oldest);
            job.prune_history();
        }
        job.rec.last_checkpoint = job.rec.checkpoints.last().map(|c| c.step);
        fx.push(Effect::PersistJob(job.rec.clone()));
        publish_event(
            fx,
            job,
            "checkpoint",
            format!("checkpoint of step {step} written"),
            now_ms,
        );
        if job.regroup_after_checkpoint && job.gen.is_some() {
            self.regroup(job_id, now_ms, fx);
        }
    }

    /// A member could not restore its generation's checkpoint: that
    /// checkpoint is marked bad (never used again, nothing loaded from it
    /// trusted) and the generation re-forms from the next older source,
    /// replaying more.
    pub(super) fn on_restore_failed(
        &mut self,
        worker: &str,
        job_id: &str,
        message: &str,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let job = self.jobs.get_mut(job_id).expect("known job");
        let gen = job.gen.clone().expect("an error within a generation");
        let Source::Checkpoint(bad) = &gen.decision.source else {
            // Nothing was to be read from disk: treat it as a failed sync.
            job.force_restore = true;
            let reason = format!("restore failed on {worker} without a checkpoint: {message}");
            self.dissolve_generation(job_id, &reason, now_ms, fx);
            return;
        };
        job.rec.checkpoints.retain(|c| c.step != bad.step);
        job.rec.bad_checkpoints.push(bad.step);
        job.rec.last_checkpoint = job.rec.checkpoints.last().map(|c| c.step);
        let committed = job.rec.step;
        let next = match job
            .rec
            .checkpoints
            .iter()
            .rev()
            .find(|c| c.step <= committed)
        {
            Some(c) => format!("step-{}", c.step),
            None if job.rec.init_allowed() => "the model init (step 0)".to_string(),
            None => "nothing: no good checkpoint left".to_string(),
        };
        let reason = format!(
            "checkpoint step-{} failed to restore on {worker}: {message}; falling back to {next}",
            bad.step
        );
        warn!(job = job_id, checkpoint = bad.step, worker, "{reason}");
        for m in &gen.members {
            if let Some(w) = self.workers.get_mut(m) {
                if w.held.as_ref().is_some_and(|h| h.generation == gen.id) {
                    w.held = None;
                }
            }
        }
        self.dissolve_generation(job_id, &reason, now_ms, fx);
    }

    /// Forms a generation from the available workers (holders of the
    /// job's state first) and configures it from the source
    /// [`recovery::decide`] picks.
    pub(super) fn form_generation(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = &self.jobs[job_id];
        let (min, max) = (job.spec.parallel.min_workers, job.spec.parallel.max_workers);
        let mut free: Vec<(WorkerId, u64, Option<HeldState>)> = self
            .workers
            .values()
            .filter(|w| w.available())
            .map(|w| (w.id.clone(), w.seq, w.held_for(job_id).cloned()))
            .collect();
        let missing = job
            .rec
            .members
            .iter()
            .filter(|m| !self.workers.get(*m).is_some_and(|w| w.available()))
            .count();
        let rejoining = job
            .rejoin_deadline_ms
            .filter(|&d| missing > 0 && now_ms < d);
        if let Some(deadline) = rejoining {
            let reason = format!(
                "coordinator restarted; waiting up to {} ms for {missing} member(s) of generation {} to re-register",
                deadline - now_ms,
                job.rec.generation
            );
            self.jobs.get_mut(job_id).expect("known job").rec.reason = reason;
            return;
        }
        if (free.len() as u32) < min {
            let reason = format!(
                "waiting for workers: {} available, min_workers = {min}",
                free.len()
            );
            let job = self.jobs.get_mut(job_id).expect("known job");
            if job.rec.reason != reason {
                job.rec.reason = reason;
            }
            return;
        }
        recovery::member_order(job_id, &mut free);
        free.truncate(max as usize);
        let (members, held): (Vec<WorkerId>, Vec<Option<HeldState>>) =
            free.into_iter().map(|(id, _, h)| (id, h)).unzip();
        let history_from = replayable_from(job);
        let decision = match recovery::decide(&Situation {
            sharding: job.spec.parallel.sharding,
            committed: job.rec.step,
            members: &held,
            checkpoints: &job.rec.checkpoints,
            history_from,
            init_allowed: job.rec.init_allowed() && history_from == 0,
            memory_allowed: !job.force_restore,
        }) {
            Ok(d) => d,
            Err(e) => {
                self.finish(job_id, JobState::Failed, &e.to_string(), now_ms, fx);
                return;
            }
        };
        let peers: Vec<(WorkerId, String)> = members
            .iter()
            .map(|m| (m.clone(), self.workers[m].reg.collective_addr.clone()))
            .collect();
        let world = members.len();
        let priors: Vec<Option<HeldState>> =
            (0..world).map(|i| decision.prior(i).cloned()).collect();
        // Memory a Configure does not overwrite: a ddp holder's (it only
        // sends), or a sharded layout that stays exactly as it was.
        let unchanged_layout = priors.iter().enumerate().all(|(i, p)| {
            p.as_ref()
                .is_some_and(|p| p.rank as usize == i && p.world_size as usize == world)
        });
        let ddp = job.spec.parallel.sharding == Sharding::Ddp;
        let job = self.jobs.get_mut(job_id).expect("known job");
        job.rec.generation += 1;
        job.rec.state = JobState::Running;
        job.rec.reason = String::new();
        job.rec.members = members.clone();
        job.rejoin_deadline_ms = None;
        let gen = Generation {
            id: job.rec.generation,
            members: members.clone(),
            ready: vec![false; world],
            step: decision.step,
            decision: decision.clone(),
        };
        for (rank, m) in members.iter().enumerate() {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Configure {
                    job: job_id.to_string(),
                    generation: gen.id,
                    rank: rank as u32,
                    peers: peers.clone(),
                    priors: priors.clone(),
                    spec_toml: job.rec.spec_toml.clone(),
                    step: decision.step,
                    restore_from: decision.restore_from(),
                },
            });
            let w = self.workers.get_mut(m).expect("member is registered");
            w.job = Some(job_id.to_string());
            w.rank = Some(rank as u32);
            w.state = WorkerState::Configuring;
            let kept = priors[rank].is_some() && (ddp || unchanged_layout);
            if !kept {
                w.held = None;
            }
        }
        let source = decision.describe();
        info!(
            job = job_id,
            generation = gen.id,
            world_size = world,
            %source,
            "generation formed"
        );
        fx.push(Effect::PersistJob(job.rec.clone()));
        let msg = format!(
            "generation {} formed with {world} workers; {source}",
            gen.id
        );
        job.gen = Some(gen);
        publish_event(fx, job, "generation", msg, now_ms);
    }

    pub(super) fn on_ready(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some(gen) = job.gen.as_mut().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = job_id,
                generation,
                "ready from a stale generation, ignored"
            );
            return;
        };
        let Some(rank) = gen.rank_of(worker) else {
            return;
        };
        if step != gen.step {
            warn!(
                worker,
                job = job_id,
                generation,
                step,
                configured = gen.step,
                "ready at another step than configured"
            );
        }
        let was_ready = gen.all_ready();
        gen.ready[rank as usize] = true;
        let held = HeldState {
            job: job_id.to_string(),
            step,
            world_size: gen.world_size(),
            rank,
            generation,
        };
        let all_ready = gen.all_ready() && !was_ready;
        let decision = gen.decision.clone();
        if all_ready && !matches!(decision.source, Source::Memory { .. }) {
            job.force_restore = false;
        }
        if all_ready {
            if let Some(r) = decision.replay() {
                let msg = format!(
                    "generation {generation}: {}; replayed steps do not commit again",
                    decision.describe()
                );
                info!(
                    job = job_id,
                    generation,
                    from = r.start(),
                    to = r.end(),
                    "replaying"
                );
                publish_event(fx, job, "replay", msg, now_ms);
            }
        }
        if let Some(w) = self.workers.get_mut(worker) {
            w.held = Some(held);
            w.state = if w.draining {
                WorkerState::Draining
            } else {
                WorkerState::Active
            };
        }
    }

    /// A step result means the worker applied that step's update, whether
    /// or not its generation is still current: its held state moves on.
    pub(super) fn note_result(&mut self, worker: &str, job_id: &str, generation: u64, step: u64) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if job.last_plan != Some((generation, step, step::PlanKind::Train)) {
            return;
        }
        if let Some(h) = self
            .workers
            .get_mut(worker)
            .and_then(|w| w.held.as_mut())
            .filter(|h| h.job == job_id && h.generation == generation)
        {
            h.step = step;
        }
    }
}

pub(super) fn request_checkpoint(job: &mut Job, fx: &mut Vec<Effect>) {
    let Some(gen) = job.gen.as_ref() else { return };
    if gen.step < job.rec.step {
        // Mid-replay the members do not hold the committed step yet: the
        // checkpoint is taken at the next commit.
        job.checkpoint_requested = true;
        return;
    }
    let step = job.rec.step;
    if job.pending_checkpoints.contains_key(&step)
        || job.rec.checkpoints.iter().any(|c| c.step == step)
    {
        return;
    }
    let dir = job.checkpoint_dir(step);
    for m in &gen.members {
        fx.push(Effect::Send {
            worker: m.clone(),
            msg: ToWorker::Checkpoint {
                job: job.rec.id.clone(),
                step,
                dir: dir.clone(),
                cursor: job.rec.cursor.clone(),
            },
        });
    }
    job.pending_checkpoints.insert(
        step,
        gen.members.iter().map(|m| (m.clone(), false)).collect(),
    );
}

/// Records written before the checkpoint index existed: their last
/// checkpoint becomes the index.
pub(super) fn migrate_checkpoint_index(job: &mut Job) {
    if !job.rec.checkpoints.is_empty() {
        return;
    }
    if let Some(step) = job.rec.last_checkpoint {
        let dir = job.checkpoint_dir(step);
        job.rec.checkpoints.push(CheckpointEntry { step, dir });
    }
}

/// The lowest step `k` such that every committed step after it is in the
/// job's history (so a source at `k` can be replayed up to the committed
/// step).
fn replayable_from(job: &Job) -> u64 {
    let mut k = job.rec.step;
    while k > job.rec.history_from && job.history.contains_key(&k) {
        k -= 1;
    }
    k
}

/// The generation's next replayed step: the committed step's documents and
/// lr, packed for the current world size.
pub(super) fn replay_next(job: &mut Job) -> Result<PlannedStep, ReplayError> {
    let index = job
        .doc_index
        .get_or_insert_with(|| Arc::new(recovery::doc_index(&job.docs)))
        .clone();
    let gen = job.gen.as_ref().expect("replay within a generation");
    let next = gen.step + 1;
    let entry = job
        .history
        .get(&next)
        .ok_or(ReplayError::NoHistory { step: next })?;
    recovery::replay_plan(
        &job.spec,
        &job.docs,
        &index,
        entry,
        gen.world_size(),
        job.annotations(),
    )
}
