//! The life of a job's steps: dispatching planned steps, collecting
//! results, committing (the cursor moves only here), and finishing. See
//! DESIGN.md "The life of a step".

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{info, warn};

use super::effects::{Effect, Effects, Persist, RankResult, ToWorker, WatchItem};
use super::error::{CoreError, Result};
use super::jobs::{AfterCheckpoint, InFlight, Phase, Work};
use super::machine::Coordinator;
use super::metrics::{self, StepFacts};
use super::planner::{self, Source};
use super::reference;
use super::step::PlannedStep;
use super::types::{
    AbortReason, CommittedStep, End, EventKind, JobState, PlanKind, Why, WorkerErrorKind,
};
use super::workers::{Worker, WorkerState};
use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
use crate::rl::stream::Admission;
use crate::stream::doc::Rollout;

impl Coordinator {
    /// Σ peak FLOP/s of the job's current generation; 0 when any member's
    /// peak is unknown (a partial sum would overstate MFU).
    fn generation_peak_flops(&self, job_id: &str) -> f64 {
        let Some(gen) = self.jobs.get(job_id).and_then(|j| j.gen()) else {
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
    pub(crate) fn on_result(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        result: RankResult,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let Some(active) = self.jobs.get_mut(job_id).and_then(|j| j.active_mut()) else {
            return;
        };
        let gen = &active.gen;
        let Work::InFlight(flight) = &mut active.work else {
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
        let train = flight.planned.kind == PlanKind::Train && !flight.planned.replay;
        if train && !result.sums.is_finite() {
            // Workers refuse a non-finite loss or norm themselves; a result
            // that carries one anyway fails the step the same way.
            let message = format!(
                "rank {rank} reported a non-finite result (loss sum {}, gradient norm {})",
                result.sums.loss_sum, result.sums.grad_norm
            );
            let kind = WorkerErrorKind::NonFinite;
            return self
                .on_worker_error(worker, job_id, generation, step, kind, message, now_ms, fx);
        }
        let disagreement =
            flight
                .planned
                .disagreement(rank, &result.sums, &result.logps, &result.nonfinite);
        if let Some(field) = disagreement {
            // A confused (or hostile) worker would skew every metric (or
            // fail the job on a malformed eval or reference chunk): it is
            // dropped like a failed one and the plan made again.
            let why = Why::new(
                AbortReason::WorkerError,
                format!(
                    "worker {worker} (rank {rank}) sent a result for {} {step} that disagrees with its plan: {field}",
                    flight.planned.kind.noun()
                ),
            );
            return self.lose_worker_because(worker, why, now_ms, fx);
        }
        flight.results.insert(rank, result.sums);
        flight.logps.extend(result.logps);
        flight.nonfinite.insert(rank, result.nonfinite);
        if flight.results.len() < gen.members.len() {
            return;
        }
        let Work::InFlight(flight) = std::mem::replace(&mut active.work, Work::Idle) else {
            unreachable!("matched above")
        };
        let job = self.jobs.get_mut(job_id).expect("a job with a generation");
        job.pace.observe(
            now_ms - flight.started_ms,
            flight.planned.busiest_rank_tokens(),
        );
        match (flight.planned.kind, flight.planned.replay) {
            (PlanKind::Probe, _) => self.probed(job_id, flight, now_ms, fx),
            (PlanKind::Reference, _) => self.commit_reference(job_id, flight, now_ms, fx),
            (PlanKind::Eval, _) => self.commit_eval(job_id, flight, now_ms, fx),
            (PlanKind::Train, true) => self.replayed(job_id, step, now_ms, fx),
            (PlanKind::Train, false) => self.commit(job_id, flight, now_ms, fx),
        }
    }

    /// Rank 0's gathered results of a step: each entry is taken as its
    /// rank's own result (checked against that rank's plan; a disagreeing
    /// one is blamed on that rank's worker). A batch from any other member,
    /// or one that does not hold exactly one result per rank, is a protocol
    /// error: its sender is dropped like a failed worker.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_gathered(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        results: Vec<(u32, RankResult)>,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let Some(gen) = self
            .jobs
            .get(job_id)
            .and_then(|j| j.active())
            .map(|a| &a.gen)
        else {
            return;
        };
        if gen.id != generation {
            warn!(
                worker,
                job = job_id,
                generation,
                step,
                "gathered results for a stale generation, ignored"
            );
            return;
        }
        let world = gen.members.len();
        let refused = if gen.rank_of(worker) != Some(0) {
            Some("it is not the generation's rank 0".to_string())
        } else if results.len() != world || results.iter().any(|(r, _)| *r as usize >= world) {
            let ranks: Vec<u32> = results.iter().map(|(r, _)| *r).collect();
            Some(format!(
                "it holds ranks {ranks:?}, not one result for each of {world} ranks"
            ))
        } else {
            None
        };
        if let Some(why) = refused {
            let why = Why::new(
                AbortReason::WorkerError,
                format!("worker {worker} sent gathered results for step {step} of generation {generation}, refused: {why}"),
            );
            return self.lose_worker_because(worker, why, now_ms, fx);
        }
        let members: Vec<(String, RankResult)> = results
            .into_iter()
            .map(|(r, result)| (gen.members[r as usize].clone(), result))
            .collect();
        for (member, result) in members {
            self.note_result(&member, job_id, generation, step);
            self.on_result(&member, job_id, generation, step, result, now_ms, fx);
        }
    }

    /// Every rank reported its part of an eval chunk: its sums join the
    /// evaluation's; after the last chunk the metrics are written and sent.
    /// Nothing else moves (no cursor, no step).
    fn commit_eval(&mut self, job_id: &str, flight: InFlight, now_ms: i64, fx: &mut Effects) {
        let job = self.jobs.get_mut(job_id).expect("an eval of a known job");
        let (Some(set), Some(run)) = (job.data.eval.as_ref(), job.eval_run.as_mut()) else {
            return;
        };
        let wanted: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let docs: Vec<&crate::stream::doc::Document> =
            set.docs.iter().filter(|d| wanted.contains(&d.id)).collect();
        if let Err(e) = run.add_chunk(set, &docs, &flight.logps, job.data.reference.as_ref()) {
            let why = Why::new(AbortReason::JobFailed, e.to_string());
            self.finish(job_id, End::Failed(why), now_ms, fx);
            return;
        }
        if run.next >= set.docs.len() {
            let m = run.finish(set, now_ms);
            job.eval_run = None;
            info!(
                job = job_id,
                step = m.step,
                loss = m.loss,
                "evaluation done"
            );
            fx.push(Effect::AppendEval {
                job: job_id.to_string(),
                path: job.spec.job.output_dir.join("metrics.jsonl"),
                eval: Box::new(m.clone()),
            });
            fx.push(Effect::Publish {
                job: job_id.to_string(),
                item: WatchItem::Eval(m),
            });
        }
        self.at_boundary(job_id, now_ms, fx);
    }

    /// Every rank reported its part of a reference chunk: the log-probs are
    /// stored (the store write precedes any plan that carries them).
    fn commit_reference(&mut self, job_id: &str, flight: InFlight, now_ms: i64, fx: &mut Effects) {
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        let kind = reference::pass_kind(&job.spec).unwrap_or(reference::PassKind::Pairs);
        let planned: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let lens: BTreeMap<_, _> = job
            .data
            .docs
            .iter()
            .filter(|d| planned.contains(&d.id))
            .map(|d| (d.id, d.tokens() as usize))
            .collect();
        let token_count = |d: &crate::stream::doc::DocId| lens.get(d).copied().unwrap_or(0);
        let entries = match reference::collect_chunk(
            &flight.planned.docs,
            &flight.logps,
            kind,
            token_count,
        ) {
            Ok(e) => e,
            Err(e) => {
                let why = Why::new(
                    AbortReason::JobFailed,
                    format!("chunk {}: {e}", flight.planned.step),
                );
                self.finish(job_id, End::Failed(why), now_ms, fx);
                return;
            }
        };
        let cache = job.data.reference.get_or_insert_with(Default::default);
        cache.chunks += 1;
        cache.logps.extend(entries.iter().cloned());
        let (done, total) = (cache.logps.len(), job.data.docs.len());
        info!(job = job_id, done, total, "reference chunk committed");
        fx.persist(Persist::Reference {
            job: job_id.to_string(),
            entries,
        });
        let what = match kind {
            reference::PassKind::Pairs => "pairs",
            reference::PassKind::Tokens => "rollouts",
        };
        let msg = format!("reference log-probs of {done}/{total} {what} cached");
        fx.push(job.event(EventKind::Reference, msg, now_ms));
        self.at_boundary(job_id, now_ms, fx);
    }

    /// Every rank reported: the step commits, the cursor moves.
    fn commit(&mut self, job_id: &str, flight: InFlight, now_ms: i64, fx: &mut Effects) {
        let peak_flops = self.generation_peak_flops(job_id);
        let job = self.jobs.get_mut(job_id).expect("committing a known job");
        // Per-source metrics for a mixture (one source: the step's own).
        let source_names: Vec<String> = match job.data.sources.len() {
            0 | 1 => Vec::new(),
            _ => job.data.sources.iter().map(|s| s.name.clone()).collect(),
        };
        let active = job.active_mut().expect("committing within a generation");
        let planned = flight.planned.clone();
        active.gen.step = planned.step;
        let (world_size, generation) = (active.gen.world_size(), active.gen.id);
        let ranks: Vec<_> = flight.results.into_values().collect();
        let facts = StepFacts {
            step: planned.step,
            lr: planned.lr,
            world_size,
            generation,
            microbatches: planned.microbatches(),
            step_time_s: (now_ms - flight.started_ms).max(0) as f64 / 1000.0,
            unix_ms: now_ms,
            peak_flops,
            source_names: &source_names,
        };
        let mut m = metrics::aggregate(facts, planned.cursor_after.clone(), &ranks);
        if source_names.is_empty() {
            m.sources.clear();
        }
        if let (Some(s), Some(r)) = (&planned.staleness, &job.data.rollouts) {
            m.extra.insert("staleness/mean".into(), s.mean());
            m.extra.insert("staleness/max".into(), s.max as f64);
            let zv = r.zero_variance_groups as f64;
            m.extra.insert("count/zero_variance_groups".into(), zv);
            let stale = r.rejected_stale as f64;
            m.extra.insert("count/rejected_stale".into(), stale);
        }
        // The RL loop's rounds since the last commit (reward, accuracy,
        // response length, generation speed).
        m.extra
            .extend(std::mem::take(&mut job.data.loop_stats).metrics());
        job.rec.step = planned.step;
        job.rec.cursor = planned.cursor_after.clone();
        job.rec.last_loss = Some(m.loss);
        job.data.history.insert(
            planned.step,
            CommittedStep {
                step: planned.step,
                lr: planned.lr,
                docs: crate::stream::doc::DocIds::new(&planned.docs),
                cursor_after: planned.cursor_after.clone(),
            },
        );
        job.trim_history(None);
        info!(
            job = job_id,
            step = m.step,
            loss = m.loss,
            tokens = m.tokens,
            "step committed"
        );
        let mut manifest = manifest_of(&planned, generation, job.attempts_of(planned.step));
        if !source_names.is_empty() {
            manifest.record_sources(&job.data.file_source, &source_names);
        }
        if let Some(s) = &job.data.stream {
            manifest.groups = trained_groups(s, &planned.docs);
        }
        fx.persist(Persist::Step {
            rec: Box::new(job.rec.clone()),
            metrics: Box::new(m.clone()),
            docs: planned.docs.clone(),
            manifest: Box::new(manifest),
        });
        fx.push(Effect::AppendMetrics {
            job: job_id.to_string(),
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        fx.push(Effect::Publish {
            job: job_id.to_string(),
            item: WatchItem::Step(Box::new(m)),
        });
        let (id, to) = (job.rec.id.clone(), job.rec.cursor.position);
        if let (Some(s), Some(plan)) = (job.data.stream.as_mut(), job.data.rollouts.as_mut()) {
            fx.persist(Persist::Rollouts(Box::new(s.on_commit(plan, &id, to))));
        }

        super::publish::request_if_due(job, fx);
        let every = job.spec.checkpoint.every_steps;
        let finished = job.finished();
        // An evaluation after every `eval.every_steps`-th step and the last
        // (it runs before the next step is planned).
        if let Some(e) = &job.data.eval {
            if job.rec.step.is_multiple_of(e.every_steps.max(1)) || finished {
                job.eval_run = Some(super::eval::EvalRun::new(job.rec.step));
            }
        }
        let due = (every > 0 && job.rec.step.is_multiple_of(every))
            || job.requests.checkpoint
            || finished;
        if due {
            job.requests.checkpoint = false;
            job.request_checkpoint(fx);
        }
        // A final evaluation (or the RL loop's eval prompts) runs first;
        // the job completes after it.
        if finished && job.eval_run.is_none() && !self.eval_due(job_id) {
            self.complete(job_id, "all steps trained", now_ms, fx);
            return;
        }
        self.at_boundary(job_id, now_ms, fx);
    }

    /// The job trained all it will: it completes once the committed
    /// step's checkpoint is durable, so that "completed" always means the
    /// trained model is on disk. Until then the generation waits (a lost
    /// writer re-forms it, and the next generation asks again).
    pub(crate) fn complete(&mut self, job_id: &str, detail: &str, now_ms: i64, fx: &mut Effects) {
        let job = self.jobs.get_mut(job_id).expect("completing a known job");
        if job.step_durable() {
            self.finish(job_id, End::Completed(detail.into()), now_ms, fx);
            return;
        }
        job.request_checkpoint(fx);
        if let Some(a) = job.active_mut() {
            a.work = Work::AwaitingCheckpoint(AfterCheckpoint::Complete(detail.into()));
        }
        let msg = format!(
            "step {} trained ({detail}); completing once its checkpoint is durable",
            job.rec.step
        );
        fx.push(job.event(EventKind::State, msg, now_ms));
    }

    /// A step boundary: a requested pause takes effect, drained workers
    /// leave and joiners come in (both form a new generation).
    pub(crate) fn at_boundary(&mut self, job_id: &str, now_ms: i64, fx: &mut Effects) {
        let job = &self.jobs[job_id];
        let gen = job.gen().expect("a boundary within a generation");
        // Every step, so no copy of the generation and no lookup per
        // member: one pass over the workers, and the membership check only
        // for a draining one (rare).
        let leaving = self
            .workers
            .iter()
            .any(|(id, w)| w.draining && gen.everyone().any(|m| m == id));
        let size = gen.world_size() + gen.generators.len();
        let joining =
            size < job.spec.parallel.max_workers && self.workers.values().any(Worker::available);
        let job = self.jobs.get_mut(job_id).expect("known job");
        if job.requests.pause {
            job.requests.pause = false;
            job.pause_now(now_ms, fx);
        }
        if leaving || joining {
            self.regroup(job_id, now_ms, fx);
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_worker_error(
        &mut self,
        worker: &str,
        job_id: &str,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if kind == WorkerErrorKind::CheckpointWrite {
            // Whatever generation asked for it, a checkpoint that cannot be
            // written means the job's output is not durable: never dropped
            // as stale, never a "completed" without its model.
            if !job.rec.state.is_terminal() {
                let why = Why::new(
                    AbortReason::OutputFailed,
                    format!("checkpoint of step {step} not written on worker {worker}: {message}"),
                );
                self.finish(job_id, End::Failed(why), now_ms, fx);
            }
            return;
        }
        let Some(gen) = job.gen().filter(|g| g.id == generation) else {
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
                let why = Why::new(
                    AbortReason::CollectiveTimeout,
                    format!("collective timeout at step {step} on {worker}: {message}"),
                );
                self.end_generation(job_id, why, false, now_ms, fx);
            }
            WorkerErrorKind::RestoreFailed => {
                self.on_restore_failed(worker, job_id, &message, now_ms, fx)
            }
            WorkerErrorKind::StateSync => {
                let why = Why::new(
                    AbortReason::StateSyncFailed,
                    format!(
                        "state sync failed on {worker}: {message}; restoring from a checkpoint"
                    ),
                );
                warn!(worker, job = job_id, generation, %message, "state sync failed");
                if let Some(w) = self.workers.get_mut(worker) {
                    w.held = None;
                }
                self.end_generation(job_id, why, true, now_ms, fx);
            }
            WorkerErrorKind::NonFinite if self.bisects(job_id, step) => {
                self.start_bisection(job_id, worker, &message, now_ms, fx)
            }
            WorkerErrorKind::NonFinite
            | WorkerErrorKind::InvalidPlan
            | WorkerErrorKind::Internal
            | WorkerErrorKind::OutOfMemory
            | WorkerErrorKind::Data
            | WorkerErrorKind::CheckpointWrite => {
                let why = Why::new(
                    AbortReason::WorkerError,
                    format!(
                        "step {step} failed on worker {worker} ({}): {message}",
                        kind.name()
                    ),
                );
                self.finish(job_id, End::Failed(why), now_ms, fx);
            }
        }
    }

    /// Ends a job: the step in flight is aborted, the members released.
    pub(crate) fn finish(&mut self, job_id: &str, end: End, now_ms: i64, fx: &mut Effects) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let why = end.why();
        let reason = why.detail.clone();
        let mut aborted_step = None;
        if let Phase::Active(active) = std::mem::replace(&mut job.phase, Phase::Ended) {
            let gen = active.gen;
            if let Work::InFlight(flight) = &active.work {
                aborted_step = Some(flight.planned.step);
                for m in &gen.members {
                    fx.push(Effect::Send {
                        worker: m.clone(),
                        msg: ToWorker::Abort {
                            job: job_id.to_string(),
                            generation: gen.id,
                            step: flight.planned.step,
                            why: why.clone(),
                        },
                    });
                }
            }
            for m in gen.everyone() {
                fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: job_id.to_string(),
                        reason: reason.clone(),
                    },
                });
                if let Some(w) = self.workers.get_mut(m) {
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
        job.rec.state = end.state();
        job.rec.reason = reason.clone();
        info!(job = job_id, state = ?job.rec.state, reason, "job finished");
        fx.persist(Persist::Job(Box::new(job.rec.clone())));
        let ended = (!matches!(end, End::Completed(_))).then_some(why.reason);
        fx.push(job.event_ending(EventKind::State, reason, ended, aborted_step, now_ms));
    }

    /// Forms generations for waiting jobs (FIFO) and dispatches the next step
    /// of every ready, running job.
    pub(crate) fn schedule(&mut self, now_ms: i64, fx: &mut Effects) {
        for id in self.job_order.clone() {
            let job = &self.jobs[&id];
            if job.rec.state == JobState::Pending && matches!(job.phase, Phase::Waiting { .. }) {
                self.form_generation(&id, now_ms, fx);
            }
            let job = &self.jobs[&id];
            let idle_and_ready = job
                .active()
                .is_some_and(|a| a.gen.all_ready() && matches!(a.work, Work::Idle));
            if job.rec.state == JobState::Running && idle_and_ready {
                self.dispatch(&id, now_ms, fx);
            }
            // An external engine, or the generator workers, generate
            // while the trainers train.
            if self.jobs[&id].spec.rl.generates_apart() {
                self.engine_tick(&id, now_ms, fx);
            }
        }
    }

    fn dispatch(&mut self, job_id: &str, now_ms: i64, fx: &mut Effects) {
        // The RL loop: nothing goes out while a round is being scored (its
        // rollouts or eval answers are owed first); eval prompts are
        // answered before the first step and after the last.
        if let Some(l) = self.jobs[job_id].data.rollout_loop.as_ref() {
            if l.scoring.is_some() {
                return;
            }
            if self.eval_due(job_id) {
                // The eval answers wait for an engine round out to be
                // scored (one scoring slot).
                if l.engine.as_ref().is_some_and(|e| e.busy()) || self.plan_eval(job_id, now_ms, fx)
                {
                    return;
                }
            }
        }
        let job = self.jobs.get_mut(job_id).expect("known job");
        if !job.replaying() && job.finished() && job.eval_run.is_none() {
            self.complete(job_id, "all steps trained", now_ms, fx);
            return;
        }
        let world = job
            .gen()
            .expect("dispatch within a generation")
            .world_size();
        let next = job.rec.step + 1;
        let planned = match planner::next_source(job) {
            Ok(Source::Stream) => {
                // A streamed job waits until its queue holds a whole step.
                let s = job.data.stream.as_ref().expect("a streamed job");
                let docs = job.settings().at(next).docs_per_step.unwrap_or(1);
                let need = s.step_rollouts(docs);
                if let Some(reason) = s.waiting_reason(need) {
                    // The RL loop makes the rollouts itself.
                    // (An external engine's rounds are planned apart.)
                    let generating =
                        job.data.rollout_loop.is_some() && !job.spec.rl.generates_apart();
                    job.rec.reason = reason;
                    if generating {
                        self.plan_round(job_id, need, now_ms, fx);
                    }
                    return;
                }
                job.rec.reason.clear();
                planner::plan(job, Source::Stream, world)
            }
            Ok(Source::LoadHistory { from, to }) => {
                // The replay reached steps whose documents only the store
                // holds: the shell reads them (off the state lock) and
                // answers with `Event::HistoryLoaded`; dispatch resumes then.
                if job.data.history_loading.is_none() {
                    job.data.history_loading = Some(from);
                    job.rec.reason = format!("replay: reading steps {from}..={to} from the store");
                    fx.push(Effect::LoadHistory {
                        job: job_id.to_string(),
                        from,
                        to,
                    });
                }
                return;
            }
            // The step planned while the last one ran, if the job is where
            // it was planned from.
            Ok(Source::Files) => match planner::take_ahead(job, world) {
                Some(p) => {
                    #[cfg(debug_assertions)]
                    {
                        let fresh = planner::plan(job, Source::Files, world);
                        assert!(
                            matches!(&fresh, Ok(Some(f)) if *f == p),
                            "step {} planned ahead is not the step planned at dispatch: {fresh:?}",
                            p.step
                        );
                    }
                    job.sent_ahead += 1;
                    Ok(Some(p))
                }
                None => planner::plan(job, Source::Files, world),
            },
            Ok(source) => planner::plan(job, source, world),
            Err(e) => Err(e),
        };
        let planned = match planned {
            Ok(Some(p)) if p.kind == PlanKind::Train && !p.replay => {
                let job = &self.jobs[job_id];
                let max = job.spec.faults.max_step_attempts;
                if job.attempts.0 == p.step && job.attempts.1 >= max {
                    let why = Why::new(
                        AbortReason::TooManyAttempts,
                        format!(
                            "step {} was dispatched {max} times without committing (faults.max_step_attempts); the last attempt ended: {}",
                            p.step, job.last_abort
                        ),
                    );
                    self.finish(job_id, End::Failed(why), now_ms, fx);
                    return;
                }
                Arc::new(p)
            }
            Ok(Some(p)) => Arc::new(p),
            Ok(None) => {
                self.complete(job_id, "data exhausted", now_ms, fx);
                return;
            }
            Err(e) => {
                let why = Why::new(AbortReason::JobFailed, e.to_string());
                self.finish(job_id, End::Failed(why), now_ms, fx);
                return;
            }
        };
        self.send_plan(job_id, planned, now_ms, fx);
    }

    /// Plans the step after the one in flight, while it runs (see
    /// `ahead`): the shell asks once that step's plans are out.
    pub(crate) fn plan_ahead(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Some(active) = job.active() else {
            return;
        };
        let Work::InFlight(flight) = &active.work else {
            return;
        };
        let (planned, world, generation) = (
            flight.planned.clone(),
            active.gen.world_size(),
            active.gen.id,
        );
        // Asked twice for the same step (a late ask after the next dispatch).
        if job
            .ahead
            .as_ref()
            .is_some_and(|a| a.follows(&planned, generation))
        {
            return;
        }
        // Nothing planned (an eval chunk, a probe or a replay in flight):
        // the step planned before it is kept; dispatch checks its origin.
        if let Some(ahead) = planner::plan_ahead(job, world, &planned) {
            job.ahead = Some(ahead);
        }
    }

    fn send_plan(
        &mut self,
        job_id: &str,
        planned: Arc<PlannedStep>,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let job = self.jobs.get_mut(job_id).expect("known job");
        let active = job.active_mut().expect("dispatch within a generation");
        let gen = &active.gen;
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
        let last_plan = (gen.id, planned.step, planned.kind);
        active.work = Work::InFlight(InFlight {
            planned: planned.clone(),
            started_ms: now_ms,
            results: BTreeMap::new(),
            logps: Vec::new(),
            nonfinite: BTreeMap::new(),
        });
        job.last_plan = Some(last_plan);
        job.note_dispatch(&planned);
    }

    /// Admits rollouts pushed to a streamed job (see `crate::rl::stream`).
    pub(crate) fn push_rollouts(
        &mut self,
        job_id: &str,
        batch: Vec<Rollout>,
        fx: &mut Effects,
    ) -> Result<()> {
        let job = self.job_mut(job_id)?;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(
                job_id,
                job.rec.state,
                "pushing rollouts",
            ));
        }
        let next = job.rec.step + 1;
        let settings = job.settings().at(next);
        // Against the live limit (`accrue set --max-tokens`), not the
        // submitted one: the next plan packs with it.
        if let Some((index, tokens)) = batch
            .iter()
            .map(|r| r.seq.len() as u64)
            .enumerate()
            .find(|&(_, t)| t > u64::from(settings.max_tokens))
        {
            return Err(CoreError::RolloutTooLong {
                job: job_id.to_string(),
                index,
                tokens,
                max_tokens: settings.max_tokens,
            });
        }
        let docs = settings.docs_per_step.unwrap_or(1);
        let (step, max_staleness) = (job.rec.step, job.spec.rl.max_staleness);
        let pg = job.spec.objective.pg();
        let (Some(s), Some(plan), Some(pg)) =
            (job.data.stream.as_mut(), job.data.rollouts.as_mut(), pg)
        else {
            return Err(CoreError::NotStreamed(job_id.to_string()));
        };
        let at = Admission {
            job: job_id,
            pg: &pg,
            step,
            max_staleness,
            need: s.step_rollouts(docs),
        };
        fx.persist(Persist::Rollouts(Box::new(s.push(plan, at, batch)?)));
        Ok(())
    }
}

/// The groups of a streamed step's documents, in queue order (they are
/// still queued: a commit pops them after its manifest is written).
fn trained_groups(
    s: &crate::rl::stream::RolloutStream,
    docs: &[crate::stream::doc::DocId],
) -> Vec<String> {
    let ids: std::collections::HashSet<_> = docs.iter().collect();
    s.groups()
        .filter_map(|g| g.iter().find(|d| ids.contains(&d.id)))
        .filter_map(|d| match &d.body {
            crate::stream::doc::DocBody::Rollout(r) => Some(r.group.clone()),
            _ => None,
        })
        .collect()
}

/// The manifest of `planned`, committing in `generation` after `attempts`
/// dispatches: the settings it ran with and its exact layout.
fn manifest_of(planned: &PlannedStep, generation: u64, attempts: u32) -> StepManifest {
    let ranks: Vec<Vec<MicrobatchEntry>> = planned
        .ranks
        .iter()
        .map(|mbs| {
            mbs.iter()
                .map(|mb| MicrobatchEntry {
                    tokens: mb.tokens() as u32,
                    seqs: mb
                        .seqs
                        .iter()
                        .zip(mb.cu_seq_lens.windows(2))
                        .map(|(s, w)| SeqEntry(s.doc, s.role, w[1] - w[0]))
                        .collect(),
                })
                .collect()
        })
        .collect();
    StepManifest {
        step: planned.step,
        generation,
        world_size: planned.ranks.len() as u32,
        lr: planned.lr,
        settings: planned.settings,
        epoch: planned.cursor_after.epoch,
        tokens: ranks.iter().flatten().map(|m| u64::from(m.tokens)).sum(),
        attempts,
        replayed: false,
        ranks,
        files: Default::default(),
        sources: Default::default(),
        groups: Vec::new(),
    }
}
