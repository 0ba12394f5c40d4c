//! Generations and their state (DESIGN.md "Elasticity", issue 6): forming
//! one (who joins and where its state comes from: [`super::membership`]
//! decides), Ready, re-forming at step boundaries, replaying committed
//! steps after a restore, the checkpoint index (asynchronous acks, `keep`,
//! fallback when a checkpoint fails to restore), and what each worker holds.

use tracing::{info, warn};

use super::ctx::JobCtx;
use super::effects::{Effect, Persist};
use super::formation::{self, Chosen};
use super::membership::{compose, Composition};
use super::phase::{Active, AfterCheckpoint, Phase, Work};
use super::recovery::{self, Source};
use super::types::{
    AbortReason, CheckpointEntry, CommittedStep, End, EventKind, HeldState, JobState, PlanKind, Why,
};
use super::workers::WorkerState;
use crate::job::parallel::Sharding;

impl JobCtx<'_> {
    /// Every rank re-ran a committed step: the generation moves on, nothing
    /// commits again (no metrics, no cursor move, no manifest rewrite).
    pub(crate) fn replayed(&mut self, step: u64) {
        let job = &mut *self.job;
        let active = job.active_mut().expect("replaying within a generation");
        active.gen.step = step;
        active.work = Work::Idle;
        // What was loaded back from the store for this step is not needed
        // again unless the replay starts over (then it is loaded again).
        job.trim_history(Some(step + 1));
        info!(job = %self.id, step, "step replayed");
        if !job.replaying() {
            info!(job = %self.id, step = job.rec.step, "replay complete");
            self.at_boundary();
        }
    }

    /// The shell read steps of `self.id.as_str()`'s history back from the store (a
    /// replay reached them, [`Effect::LoadHistory`]): they join the
    /// in-memory history and dispatch goes on at the next schedule. A store
    /// that cannot give the step the replay needs fails the job, naming it.
    pub(crate) fn history_loaded(
        &mut self,
        from: u64,
        steps: std::result::Result<Vec<CommittedStep>, String>,
    ) {
        let job = &mut *self.job;
        if job.data.history_loading != Some(from) {
            return;
        }
        job.data.history_loading = None;
        job.rec.reason.clear();
        let failure = match steps {
            Ok(steps) => {
                let (lo, hi) = (job.rec.history_from, job.data.history_stored_through);
                let n = steps.len();
                for s in steps.into_iter().filter(|s| s.step > lo && s.step <= hi) {
                    job.data.history.entry(s.step).or_insert(s);
                }
                info!(
                    job = %self.id,
                    from,
                    steps = n,
                    "replay history read from the store"
                );
                (!job.data.history.contains_key(&from))
                    .then(|| format!("replaying step {from}: the store holds no record of it"))
            }
            Err(e) => Some(format!(
                "replaying step {from}: reading its record from the store failed: {e}"
            )),
        };
        if let Some(message) = failure {
            let why = Why::new(AbortReason::JobFailed, message);
            self.finish(End::Failed(why));
        }
    }

    /// Forms a new generation at this boundary. The state comes from the
    /// members' memory where it can (see [`recovery::decide`]); only a
    /// zero2/fsdp drain first writes the current step to disk, because the
    /// leaver's shards would otherwise be lost (no dispatch meanwhile).
    /// During a replay the change waits for the replay's end.
    pub(crate) fn regroup(&mut self) {
        let leaving = self.job.gen().is_some_and(|g| {
            g.everyone()
                .any(|m| self.workers.get(m).is_some_and(|w| w.draining))
        });
        let job = &mut *self.job;
        if job.replaying() {
            return;
        }
        let step = job.rec.step;
        let sharded = job.spec.parallel.sharding != Sharding::Ddp;
        let on_disk = step == 0 || job.rec.checkpoints.iter().any(|c| c.step == step);
        if sharded && leaving && !on_disk {
            job.request_checkpoint(self.fx);
            if let Some(a) = job.active_mut() {
                a.work = Work::AwaitingCheckpoint(AfterCheckpoint::Regroup);
            }
            return;
        }
        // Ending the generation releases its draining members.
        let why = Why::new(
            AbortReason::MembershipChange,
            "membership change at step boundary",
        );
        self.end_generation(why, false);
    }

    /// A rank's part of a checkpoint is durable; once every writer of its
    /// generation reported, the checkpoint joins the job's index (the
    /// oldest beyond `checkpoint.keep` drop out, and the replay history
    /// below the oldest kept one with them).
    pub(crate) fn on_checkpoint_done(&mut self, worker: &str, step: u64) {
        let job = &mut *self.job;
        if !job.acks.checkpoints.ack(&step, worker) {
            return;
        }
        let entry = CheckpointEntry {
            step,
            dir: job.checkpoint_dir(step),
        };
        let keep = job.spec.checkpoint.keep as usize;
        let dropped = recovery::add_checkpoint(&mut job.rec.checkpoints, entry, keep);
        if let Some(oldest) = job.rec.checkpoints.first().filter(|_| !dropped.is_empty()) {
            job.rec.history_from = job.rec.history_from.max(oldest.step);
            // A replay in progress keeps what it loaded for its next steps.
            let replay_next = job.gen().filter(|_| job.replaying()).map(|g| g.step + 1);
            job.trim_history(replay_next);
        }
        job.rec.last_checkpoint = job.rec.checkpoints.last().map(|c| c.step);
        self.fx.persist(Persist::Job(Box::new(job.rec.clone())));
        // Out of the index, a checkpoint is no recovery source any more:
        // its directory goes once the record saying so is durable. Only
        // the job's own (never the checkpoint it resumed from).
        for c in dropped
            .iter()
            .filter(|c| c.dir == job.checkpoint_dir(c.step))
        {
            self.fx.push(Effect::RemoveCheckpoint {
                job: self.id.clone(),
                step: c.step,
                dir: c.dir.clone(),
            });
        }
        let msg = format!("checkpoint of step {step} written");
        self.fx
            .push(job.event(EventKind::Checkpoint, msg, self.now));
        let current = step == job.rec.step;
        let then = match job.active_mut() {
            Some(a) if current => match std::mem::replace(&mut a.work, Work::Idle) {
                Work::AwaitingCheckpoint(then) => Some(then),
                other => {
                    a.work = other;
                    None
                }
            },
            _ => None,
        };
        match then {
            Some(AfterCheckpoint::Regroup) => self.regroup(),
            Some(AfterCheckpoint::Complete(detail)) => self.finish(End::Completed(detail)),
            None => {}
        }
    }

    /// A member could not restore its generation's checkpoint: that
    /// checkpoint is marked bad (never used again, nothing loaded from it
    /// trusted) and the generation re-forms from the next older source,
    /// replaying more.
    pub(crate) fn on_restore_failed(&mut self, worker: &str, message: &str) {
        let job = &mut *self.job;
        let gen = job.gen().cloned().expect("an error within a generation");
        job.faults.last_restore_failure = Some(format!("{worker}: {message}"));
        job.faults.restore_failures += 1;
        let Source::Checkpoint(bad) = &gen.decision.source else {
            let max = job.spec.faults.max_step_attempts;
            if job.faults.restore_failures >= max {
                // The same source (the model init, a peer's memory) failed
                // every time: another try would load it again.
                let why = Why::new(
                    AbortReason::RestoreFailed,
                    format!(
                        "{} generations in a row failed to restore their state (faults.max_step_attempts); the last on {worker}: {message}",
                        job.faults.restore_failures
                    ),
                );
                self.finish(End::Failed(why));
                return;
            }
            // Nothing was to be read from disk: treat it as a failed sync.
            let why = Why::new(
                AbortReason::RestoreFailed,
                format!("restore failed on {worker} without a checkpoint: {message}"),
            );
            self.end_generation(why, true);
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
        let detail = format!(
            "checkpoint step-{} failed to restore on {worker}: {message}; falling back to {next}",
            bad.step
        );
        warn!(job = %self.id, checkpoint = bad.step, worker, "{detail}");
        for m in &gen.members {
            if let Some(w) = self.workers.get_mut(m) {
                if w.held.as_ref().is_some_and(|h| h.generation == gen.id) {
                    w.held = None;
                }
            }
        }
        let why = Why::new(AbortReason::RestoreFailed, detail);
        self.end_generation(why, false);
    }

    /// Forms a generation for a waiting job as [`compose`] decides and
    /// [`formation::plan`] lays out, and configures its members.
    pub(crate) fn form_generation(&mut self) {
        let chosen = match compose(self.now, self.job, self.workers) {
            Composition::Form {
                members,
                generators,
                decision,
                disk_only,
            } => Chosen {
                members,
                generators,
                decision,
                disk_only,
            },
            Composition::Wait(reason) => {
                self.job.rec.reason = reason;
                return;
            }
            Composition::Fail(e) => {
                let detail = match &self.job.faults.last_restore_failure {
                    Some(cause) => format!("{e}; the last restore failed on {cause}"),
                    None => e.to_string(),
                };
                self.fail(AbortReason::JobFailed, detail);
                return;
            }
        };
        let f = formation::plan(self.job, self.workers, self.opts, chosen);
        for (worker, msg) in f.configures {
            self.fx.push(Effect::Send { worker, msg });
        }
        for a in f.assignments {
            let w = self
                .workers
                .get_mut(&a.worker)
                .expect("chosen workers are registered");
            w.follows = a.follows;
            w.job = Some(self.id.clone());
            w.rank = a.rank;
            w.state = WorkerState::Configuring;
            if !a.keeps_held {
                w.held = None;
            }
        }
        let job = &mut *self.job;
        // New generators hold no known policy, and trainer rank 0's
        // snapshot went with the old weight ring: the current step is
        // published and synced before any round.
        if !f.gen.generators.is_empty() {
            if let Some(e) = job.data.engine_mut() {
                e.new_generators();
            }
        }
        job.rec.generation = f.gen.id;
        job.rec.state = JobState::Running;
        job.rec.reason = String::new();
        job.rec.members = f.gen.members.clone();
        info!(
            job = %self.id,
            generation = f.gen.id,
            world_size = f.gen.world_size(),
            generators = f.gen.generators.len(),
            source = %f.gen.decision.describe(),
            "generation formed"
        );
        job.phase = Phase::Active(Box::new(Active {
            gen: f.gen,
            work: Work::Idle,
        }));
        self.persist_job();
        self.event(EventKind::Generation, f.message);
    }

    pub(crate) fn on_ready(&mut self, worker: &str, generation: u64, step: u64) {
        let job = &mut *self.job;
        let Some(active) = job.active_mut().filter(|a| a.gen.id == generation) else {
            warn!(
                worker,
                job = %self.id,
                generation,
                "ready from a stale generation, ignored"
            );
            return;
        };
        let gen = &mut active.gen;
        if let Some(i) = gen.generators.rank_of(worker) {
            gen.generators.mark_ready(i);
            if let Some(w) = self.workers.get_mut(worker) {
                w.state = if w.draining {
                    WorkerState::Draining
                } else {
                    WorkerState::Active
                };
            }
            return;
        }
        let Some(rank) = gen.rank_of(worker) else {
            return;
        };
        if step != gen.step {
            warn!(
                worker,
                job = %self.id,
                generation,
                step,
                configured = gen.step,
                "ready at another step than configured"
            );
        }
        let all_ready = gen.mark_ready(rank);
        let held = HeldState {
            job: self.id.clone(),
            step,
            world_size: gen.world_size(),
            rank,
            generation,
        };
        // Read only at the last Ready: the decision holds a state per rank,
        // and copying it at every Ready made forming a generation O(W²)
        // (~1 s at W = 4096).
        let replay = all_ready
            .then(|| gen.decision.replay().map(|r| (r, gen.decision.describe())))
            .flatten();
        if all_ready {
            job.faults.restore_failures = 0;
            if let Some((r, describe)) = replay {
                let msg = format!(
                    "generation {generation}: {describe}; replayed steps do not commit again"
                );
                info!(
                    job = %self.id,
                    generation,
                    from = r.start(),
                    to = r.end(),
                    "replaying"
                );
                self.fx.push(job.event(EventKind::Replay, msg, self.now));
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
    pub(crate) fn note_result(&mut self, worker: &str, generation: u64, step: u64) {
        let job = &*self.job;
        if job.last_plan != Some((generation, step, PlanKind::Train)) {
            return;
        }
        if let Some(h) = self
            .workers
            .get_mut(worker)
            .and_then(|w| w.held.as_mut())
            .filter(|h| h.job == self.id.as_str() && h.generation == generation)
        {
            h.step = step;
        }
    }
}
