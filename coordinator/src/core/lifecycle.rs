//! The life of a job's steps: forming generations, dispatching planned
//! steps, collecting results, committing (cursor moves only here), and
//! finishing. See DESIGN.md "The life of a step".

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{info, warn};

use super::generations::replay_next;
use super::jobs::{Generation, InFlight, JobState};
use super::machine::{enter_paused, publish_event, request_checkpoint, Coordinator};
use super::metrics::{self, StepFacts};
use super::recovery::CommittedStep;
use super::reference::{self, SeqLogp};
use super::step::{self, PlanKind, PlannedStep};
use super::workers::{Worker, WorkerState};
use super::{Effect, ToWorker, WatchItem, WorkerErrorKind};

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

    /// Every rank reported its part of a reference chunk: the log-probs are
    /// stored (the store write precedes any plan that carries them).
    pub(super) fn commit_reference(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        let flight = job.inflight.take().expect("committing an in-flight chunk");
        let kind = reference::pass_kind(&job.spec).unwrap_or(reference::PassKind::Pairs);
        let planned: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let lens: std::collections::BTreeMap<_, _> = job
            .docs
            .iter()
            .filter(|d| planned.contains(&d.id))
            .map(|d| (d.id, d.tokens() as usize))
            .collect();
        let token_count = |d: &crate::doc::DocId| lens.get(d).copied().unwrap_or(0);
        let entries = match reference::collect_chunk(
            &flight.planned.docs,
            &flight.logps,
            kind,
            token_count,
        ) {
            Ok(e) => e,
            Err(e) => {
                let reason = format!("chunk {}: {e}", flight.planned.step);
                self.finish(job_id, JobState::Failed, &reason, now_ms, fx);
                return;
            }
        };
        let cache = job.reference.get_or_insert_with(Default::default);
        cache.chunks += 1;
        cache.logps.extend(entries.iter().cloned());
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
            format!(
                "reference log-probs of {done}/{total} {} cached",
                match kind {
                    reference::PassKind::Pairs => "pairs",
                    reference::PassKind::Tokens => "rollouts",
                }
            ),
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
            manifest: Box::new(job.manifest_of(planned, gen.id)),
        });
        fx.push(Effect::AppendMetrics {
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        fx.push(Effect::Publish {
            job: job_id.to_string(),
            item: WatchItem::Step(m),
        });
        super::stream::on_commit(job, fx);

        super::publish::request_if_due(job, fx);
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
    pub(super) fn at_boundary(&mut self, job_id: &str, now_ms: i64, fx: &mut Vec<Effect>) {
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
        // A streamed job waits until its queue holds a whole step.
        if let Some(s) = &job.stream {
            job.rec.reason = s.waiting_reason().unwrap_or_default();
            if !job.rec.reason.is_empty() {
                return;
            }
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
            if job.stream.is_some() {
                return super::stream::plan_step(job, gen.world_size());
            }
            step::plan_step(
                &crate::manifest::spec_at(&job.spec, &job.rec.changes, next),
                &job.docs,
                &job.rec.cursor,
                next,
                gen.world_size(),
                job.annotations(),
            )
        }) {
            Ok(Some(p)) => Arc::new(job.with_schedule_lr(p)),
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
        job.note_dispatch(&planned);
        job.inflight = Some(InFlight {
            planned,
            started_ms: now_ms,
            results: BTreeMap::new(),
            logps: Vec::new(),
        });
    }
}
