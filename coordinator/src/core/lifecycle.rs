//! The life of a job's steps: forming generations, dispatching planned
//! steps, collecting results, committing (cursor moves only here), and
//! finishing. See DESIGN.md "The life of a step".

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{info, warn};

use super::jobs::{Generation, InFlight, Job, JobState};
use super::machine::{enter_paused, publish_event, request_checkpoint, Coordinator};
use super::metrics::{self, StepFacts};
use super::recovery::{self, CheckpointEntry, CommittedStep, ReplayError, Situation, Source};
use super::reference::{self, SeqLogp};
use super::step::{self, PlanKind, PlannedStep};
use super::workers::{Worker, WorkerId, WorkerState};
use super::{Effect, HeldState, ToWorker, WatchItem, WorkerErrorKind};
use crate::spec::Sharding;

impl Coordinator {
    /// Σ peak FLOP/s of the job's current generation; 0 when any member's
    /// peak is unknown (a partial sum would overstate MFU).
    fn generation_peak_flops(&self, job_id: &str) -> f64 {
        let Some(gen) = self.jobs.get(job_id).and_then(|j| j.gen.as_ref()) else {
            return 0.0;
        };
        let peaks: Vec<u64> = gen
            .members
            .iter()
            .map(|id| self.worker(id).map_or(0, |w| w.reg.peak_flops))
            .collect();
        if peaks.contains(&0) {
            return 0.0;
        }
        peaks.iter().map(|&p| p as f64).sum()
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_result(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        sums: super::MetricSums,
        logps: Vec<SeqLogp>,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let (Some(gen), Some(flight)) = (job.gen.as_ref(), job.inflight.as_mut()) else {
            return;
        };
        if gen.id != generation || flight.planned.step != step {
            warn!(
                worker,
                job = job_id,
                generation,
                step,
                "result for a stale step, ignored"
            );
            return;
        }
        let Some(rank) = gen.rank_of(worker) else {
            return;
        };
        flight.results.insert(rank, sums);
        flight.logps.extend(logps);
        if flight.results.len() == gen.members.len() {
            if flight.planned.kind == PlanKind::Reference {
                self.commit_reference(job_id, now_ms, fx);
            } else if flight.planned.replay {
                self.replayed(job_id, now_ms, fx);
            } else {
                self.commit(job_id, now_ms, fx);
            }
        }
    }

    /// Every rank re-ran a committed step: the generation moves on, nothing
    /// commits again (no metrics, no cursor move, no manifest rewrite).
    fn replayed(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
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

    /// Every rank reported its part of a reference chunk: the log-probs are
    /// stored (the store write precedes any plan that carries them).
    pub(super) fn commit_reference(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        let flight = job.inflight.take().expect("committing an in-flight chunk");
        let entries = match reference::collect_chunk(&flight.planned.docs, &flight.logps) {
            Ok(e) => e,
            Err(e) => {
                let reason = format!("chunk {}: {e}", flight.planned.step);
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
                return;
            }
        };
        let cache = job.reference.get_or_insert_with(Default::default);
        cache.chunks += 1;
        cache.logps.extend(entries.iter().copied());
        let (done, total) = (cache.logps.len(), job.docs.len());
        info!(job = job_id, done, total, "reference chunk committed");
        fx.push(Effect::StoreReference {
            job: job_id.to_string(),
            entries,
        });
        publish_event(
            fx,
            job,
            "reference",
            format!("reference log-probs of {done}/{total} pairs cached"),
            now_ms,
        );
        self.at_boundary(job_id, now_ms, fx);
    }

    /// Every rank reported: the step commits, the cursor moves.
    pub(super) fn commit(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let peak_flops = self.generation_peak_flops(job_id);
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        let flight = job.inflight.take().expect("committing an in-flight step");
        let gen = job.gen.clone().expect("committing within a generation");
        let planned = &flight.planned;
        let ranks: Vec<_> = flight.results.into_values().collect();
        let facts = StepFacts {
            step: planned.step,
            lr: planned.lr,
            world_size: gen.world_size(),
            generation: gen.id,
            microbatches: planned.microbatches(),
            step_time_s: (now_ms - flight.started_ms).max(0) as f64 / 1000.0,
            unix_ms: now_ms,
            peak_flops,
        };
        let mut m = metrics::aggregate(facts, planned.cursor_after.clone(), &ranks);
        if let (Some(s), Some(r)) = (&planned.staleness, &job.rollouts) {
            m.extra.insert("staleness/mean".into(), s.mean());
            m.extra.insert("staleness/max".into(), s.max as f64);
            let zv = r.zero_variance_groups as f64;
            m.extra.insert("count/zero_variance_groups".into(), zv);
            let stale = r.rejected_stale as f64;
            m.extra.insert("count/rejected_stale".into(), stale);
        }
        job.rec.step = planned.step;
        job.rec.cursor = planned.cursor_after.clone();
        job.rec.last_loss = Some(m.loss);
        if let Some(g) = job.gen.as_mut() {
            g.step = planned.step;
        }
        job.history.insert(
            planned.step,
            CommittedStep {
                step: planned.step,
                lr: planned.lr,
                docs: planned.docs.clone(),
                cursor_after: planned.cursor_after.clone(),
            },
        );
        info!(
            job = job_id,
            step = m.step,
            loss = m.loss,
            tokens = m.tokens,
            "step committed"
        );
        fx.push(Effect::CommitStep {
            rec: Box::new(job.rec.clone()),
            metrics: Box::new(m.clone()),
            docs: planned.docs.clone(),
        });
        fx.push(Effect::AppendMetrics {
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        fx.push(Effect::Publish {
            job: job_id.to_string(),
            item: WatchItem::Step(m),
        });

        let every = job.spec.checkpoint.every_steps;
        let finished = job.finished();
        let due = (every > 0 && job.rec.step.is_multiple_of(every))
            || job.checkpoint_requested
            || finished;
        if due {
            job.checkpoint_requested = false;
            request_checkpoint(job, fx);
        }
        if finished {
            self.finish(job_id, JobState::Completed, "all steps trained", now_ms, fx);
            return;
        }
        self.at_boundary(job_id, now_ms, fx);
    }

    /// A step boundary: a requested pause takes effect, drained workers
    /// leave and joiners come in (both form a new generation).
    fn at_boundary(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let gen = self.jobs[job_id]
            .gen
            .clone()
            .expect("a boundary within a generation");
        let leaving = gen
            .members
            .iter()
            .any(|m| self.workers.get(m).is_some_and(|w| w.draining));
        let max_workers = self.jobs[job_id].spec.parallel.max_workers;
        let joining =
            self.workers.values().any(Worker::available) && gen.world_size() < max_workers;
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.pause_requested {
            job.pause_requested = false;
            enter_paused(job, now_ms, fx);
        }
        if leaving || joining {
            self.regroup(job_id, now_ms, fx);
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_worker_error(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        let Some(gen) = job.gen.as_ref().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = job_id,
                generation,
                "error from a stale generation, ignored"
            );
            return;
        };
        match kind {
            WorkerErrorKind::CollectiveTimeout {
                peer_rank: Some(peer),
            } => {
                // The silent peer is the suspect, not the reporter.
                if let Some(peer_id) = gen.members.get(peer as usize).cloned() {
                    let why = format!("collective timeout reported by {worker}: {message}");
                    self.lose_worker(&peer_id, &why, now_ms, fx);
                }
            }
            WorkerErrorKind::CollectiveTimeout { peer_rank: None } => {
                let reason = format!("collective timeout at step {step} on {worker}: {message}");
                self.dissolve_generation(job_id, &reason, now_ms, fx);
            }
            WorkerErrorKind::RestoreFailed => {
                self.on_restore_failed(worker, job_id, &message, now_ms, fx)
            }
            WorkerErrorKind::StateSync => {
                let reason = format!(
                    "state sync failed on {worker}: {message}; restoring from a checkpoint"
                );
                warn!(worker, job = job_id, generation, %message, "state sync failed");
                self.jobs.get_mut(job_id).expect("known job").force_restore = true;
                if let Some(w) = self.workers.get_mut(worker) {
                    w.held = None;
                }
                self.dissolve_generation(job_id, &reason, now_ms, fx);
            }
            WorkerErrorKind::NonFinite
            | WorkerErrorKind::InvalidPlan
            | WorkerErrorKind::Internal => {
                let reason = format!("step {step} failed on worker {worker}: {message}");
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
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
    fn on_restore_failed(
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

    pub(super) fn finish(
        &mut self,
        job_id: &str,
        state: JobState,
        reason: &str,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if let (Some(gen), Some(flight)) = (&job.gen, &job.inflight) {
            for m in &gen.members {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Abort {
                        job: job_id.to_string(),
                        generation: gen.id,
                        step: flight.planned.step,
                        reason: reason.to_string(),
                    },
                });
            }
        }
        job.inflight = None;
        if let Some(gen) = job.gen.take() {
            for m in gen.members {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: job_id.to_string(),
                        reason: reason.to_string(),
                    },
                });
                if let Some(w) = self.workers.get_mut(&m) {
                    w.job = None;
                    w.rank = None;
                    if w.state != WorkerState::Lost {
                        w.state = if w.draining {
                            WorkerState::Draining
                        } else {
                            WorkerState::Idle
                        };
                    }
                }
            }
        }
        job.rec.state = state;
        job.rec.reason = reason.to_string();
        info!(job = job_id, state = ?state, reason, "job finished");
        fx.push(Effect::PersistJob(job.rec.clone()));
        publish_event(fx, job, "state", reason.to_string(), now_ms);
    }

    /// Forms generations for waiting jobs (FIFO) and dispatches the next step
    /// of every ready, running job.
    pub(super) fn schedule(&mut self, now_ms: i64, fx: &mut Vec<Effect>) {
        for id in self.job_order.clone() {
            let job = &self.jobs[&id];
            if job.rec.state == JobState::Pending && job.gen.is_none() {
                self.form_generation(&id, now_ms, fx);
            }
            let job = &self.jobs[&id];
            let ready = job.gen.as_ref().is_some_and(Generation::all_ready);
            if job.rec.state == JobState::Running
                && ready
                && job.inflight.is_none()
                && !job.regroup_after_checkpoint
            {
                self.dispatch(&id, now_ms, fx);
            }
        }
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

    pub(super) fn dispatch(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.replaying() {
            match replay_next(job) {
                Ok(p) => self.send_plan(job_id, Arc::new(p), now_ms, fx),
                Err(e) => self.finish(job_id, JobState::Failed, &e.to_string(), now_ms, fx),
            }
            return;
        }
        if job.finished() {
            self.finish(job_id, JobState::Completed, "all steps trained", now_ms, fx);
            return;
        }
        let gen = job.gen.as_ref().expect("dispatch within a generation");
        let next = job.rec.step + 1;
        // A DPO job with a cached reference first completes its pass.
        let pending_reference = job
            .reference
            .as_ref()
            .filter(|c| !c.complete(&job.docs))
            .map(|c| reference::plan_chunk(&job.spec, &job.docs, c, gen.world_size()));
        let planned = match pending_reference.unwrap_or_else(|| {
            step::plan_step(
                &job.spec,
                &job.docs,
                &job.rec.cursor,
                next,
                gen.world_size(),
                job.annotations(),
            )
        }) {
            Ok(Some(p)) => Arc::new(p),
            Ok(None) => {
                self.finish(job_id, JobState::Completed, "data exhausted", now_ms, fx);
                return;
            }
            Err(e) => {
                let reason = format!("planning step {next} failed: {e}");
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
                return;
            }
        };
        self.send_plan(job_id, planned, now_ms, fx);
    }

    fn send_plan(
        &mut self,
        job_id: &str,
        planned: Arc<PlannedStep>,
        now_ms: i64,
        fx: &mut Vec<Effect>,
    ) {
        let job = self.jobs.get_mut(job_id).expect("known job");
        let gen = job.gen.as_ref().expect("dispatch within a generation");
        for (rank, m) in gen.members.iter().enumerate() {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Plan {
                    job: job_id.to_string(),
                    generation: gen.id,
                    rank: rank as u32,
                    planned: planned.clone(),
                },
            });
        }
        job.last_plan = Some((gen.id, planned.step, planned.kind));
        job.inflight = Some(InFlight {
            planned,
            started_ms: now_ms,
            results: BTreeMap::new(),
            logps: Vec::new(),
        });
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
fn replay_next(job: &mut Job) -> Result<PlannedStep, ReplayError> {
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
