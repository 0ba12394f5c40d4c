//! The life of a job's steps: dispatching planned steps, collecting
//! results, committing (the cursor moves only here), and finishing. See
//! DESIGN.md "The life of a step".

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::{info, warn};

use super::ctx::JobCtx;
use super::effects::{Effect, Persist, RankResult, ToWorker, WatchItem};
use super::error::{CoreError, Result};
use super::metrics::{self, StepFacts};
use super::phase::{AfterCheckpoint, InFlight, Phase, Work};
use super::planner::{self, Source};
use super::reference;
use super::step::PlannedStep;
use super::types::{
    AbortReason, CommittedStep, End, EventKind, JobState, PlanKind, Why, WorkerErrorKind,
};
use super::workers::Worker;
use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};
use crate::rl::stream::{Admission, StoredStream};
use crate::stream::doc::Rollout;

impl JobCtx<'_> {
    /// Σ peak FLOP/s of the job's current generation; 0 when any member's
    /// peak is unknown (a partial sum would overstate MFU).
    fn generation_peak_flops(&self) -> f64 {
        let Some(gen) = self.job.gen() else {
            return 0.0;
        };
        let peaks: Vec<u64> = gen
            .members
            .iter()
            .map(|id| self.workers.get(id).map_or(0, |w| w.reg.peak_flops))
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
        generation: u64,
        step: u64,
        result: RankResult,
    ) {
        let Some(active) = self.job.active_mut() else {
            return;
        };
        let gen = &active.gen;
        let Work::InFlight(flight) = &mut active.work else {
            return;
        };
        if gen.id != generation || flight.planned.step != step {
            warn!(
                worker,
                job = %self.id,
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
            return self.on_worker_error(worker, generation, step, kind, message);
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
            return self.lose_member(worker, why);
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
        let job = &mut *self.job;
        job.faults.pace.observe(
            self.now - flight.started_ms,
            flight.planned.busiest_rank_tokens(),
        );
        match (flight.planned.kind, flight.planned.replay) {
            (PlanKind::Probe, _) => self.probed(flight),
            (PlanKind::Reference, _) => self.commit_reference(flight),
            (PlanKind::Eval, _) => self.commit_eval(flight),
            (PlanKind::Train, true) => self.replayed(step),
            (PlanKind::Train, false) => self.commit(flight),
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
        generation: u64,
        step: u64,
        results: Vec<(u32, RankResult)>,
    ) {
        let Some(gen) = self.job.gen() else {
            return;
        };
        if gen.id != generation {
            warn!(
                worker,
                job = %self.id,
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
            return self.lose_member(worker, why);
        }
        let members: Vec<(String, RankResult)> = results
            .into_iter()
            .map(|(r, result)| (gen.members[r as usize].clone(), result))
            .collect();
        for (member, result) in members {
            self.note_result(&member, generation, step);
            self.on_result(&member, generation, step, result);
        }
    }

    /// Every rank reported its part of an eval chunk: its sums join the
    /// evaluation's; after the last chunk the metrics are written and sent.
    /// Nothing else moves (no cursor, no step).
    fn commit_eval(&mut self, flight: InFlight) {
        let job = &mut *self.job;
        let (Some(set), Some(run)) = (job.data.eval.as_ref(), job.eval_run.as_mut()) else {
            return;
        };
        let wanted: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let docs: Vec<&crate::stream::doc::Document> =
            set.docs.iter().filter(|d| wanted.contains(&d.id)).collect();
        if let Err(e) = run.add_chunk(set, &docs, &flight.logps, job.data.reference.as_ref()) {
            let why = Why::new(AbortReason::JobFailed, e.to_string());
            self.finish(End::Failed(why));
            return;
        }
        if run.next >= set.docs.len() {
            let m = run.finish(set, self.now);
            job.eval_run = None;
            info!(
                job = %self.id,
                step = m.step,
                loss = m.loss,
                "evaluation done"
            );
            self.fx.push(Effect::AppendEval {
                job: self.id.clone(),
                path: job.spec.job.output_dir.join("metrics.jsonl"),
                eval: Box::new(m.clone()),
            });
            self.fx.push(Effect::Publish {
                job: self.id.clone(),
                item: WatchItem::Eval(m),
            });
        }
        self.at_boundary();
    }

    /// Every rank reported its part of a reference chunk: the log-probs are
    /// stored (the store write precedes any plan that carries them).
    fn commit_reference(&mut self, flight: InFlight) {
        let job = &mut *self.job;
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
                self.finish(End::Failed(why));
                return;
            }
        };
        let cache = job.data.reference.get_or_insert_with(Default::default);
        cache.chunks += 1;
        cache.logps.extend(entries.iter().cloned());
        let (done, total) = (cache.logps.len(), job.data.docs.len());
        info!(job = %self.id, done, total, "reference chunk committed");
        self.fx.persist(Persist::Reference {
            job: self.id.clone(),
            entries,
        });
        let what = match kind {
            reference::PassKind::Pairs => "pairs",
            reference::PassKind::Tokens => "rollouts",
        };
        let msg = format!("reference log-probs of {done}/{total} {what} cached");
        self.fx.push(job.event(EventKind::Reference, msg, self.now));
        self.at_boundary();
    }

    /// Every rank reported: the step commits, the cursor moves.
    fn commit(&mut self, flight: InFlight) {
        let peak_flops = self.generation_peak_flops();
        let job = &mut *self.job;
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
            step_time_s: (self.now - flight.started_ms).max(0) as f64 / 1000.0,
            unix_ms: self.now,
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
            job = %self.id,
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
        self.fx.persist(Persist::Step {
            rec: Box::new(job.rec.clone()),
            metrics: Box::new(m.clone()),
            docs: planned.docs.clone(),
            manifest: Box::new(manifest),
        });
        self.fx.push(Effect::AppendMetrics {
            job: self.id.clone(),
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        self.fx.push(Effect::Publish {
            job: self.id.clone(),
            item: WatchItem::Step(Box::new(m)),
        });
        let (id, to) = (job.rec.id.clone(), job.rec.cursor.position);
        if let (Some(s), Some(plan)) = (job.data.stream.as_mut(), job.data.rollouts.as_mut()) {
            self.fx
                .persist(Persist::Rollouts(Box::new(s.on_commit(plan, &id, to))));
        }

        super::publish::request_if_due(job, self.fx);
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
            job.request_checkpoint(self.fx);
        }
        // A final evaluation (or the RL loop's eval prompts) runs first;
        // the job completes after it.
        if finished && job.eval_run.is_none() && !self.eval_due() {
            self.complete("all steps trained");
            return;
        }
        self.at_boundary();
    }

    /// The job trained all it will: it completes once the committed
    /// step's checkpoint is durable, so that "completed" always means the
    /// trained model is on disk. Until then the generation waits (a lost
    /// writer re-forms it, and the next generation asks again).
    pub(crate) fn complete(&mut self, detail: &str) {
        let job = &mut *self.job;
        if job.step_durable() {
            self.finish(End::Completed(detail.into()));
            return;
        }
        job.request_checkpoint(self.fx);
        if let Some(a) = job.active_mut() {
            a.work = Work::AwaitingCheckpoint(AfterCheckpoint::Complete(detail.into()));
        }
        let msg = format!(
            "step {} trained ({detail}); completing once its checkpoint is durable",
            job.rec.step
        );
        self.fx.push(job.event(EventKind::State, msg, self.now));
    }

    /// A step boundary: a requested pause takes effect, drained workers
    /// leave and joiners come in (both form a new generation).
    pub(crate) fn at_boundary(&mut self) {
        let job = &*self.job;
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
        if self.job.requests.pause {
            self.job.requests.pause = false;
            self.pause_now();
        }
        if leaving || joining {
            self.regroup();
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_worker_error(
        &mut self,
        worker: &str,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
    ) {
        let job = &*self.job;
        if kind == WorkerErrorKind::CheckpointWrite {
            // Whatever generation asked for it, a checkpoint that cannot be
            // written means the job's output is not durable: never dropped
            // as stale, never a "completed" without its model.
            if !job.rec.state.is_terminal() {
                let why = Why::new(
                    AbortReason::OutputFailed,
                    format!("checkpoint of step {step} not written on worker {worker}: {message}"),
                );
                self.finish(End::Failed(why));
            }
            return;
        }
        let Some(gen) = job.gen().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = %self.id,
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
                    self.lose_member_for(&peer_id, &why);
                }
            }
            WorkerErrorKind::CollectiveTimeout { peer_rank: None } => {
                let why = Why::new(
                    AbortReason::CollectiveTimeout,
                    format!("collective timeout at step {step} on {worker}: {message}"),
                );
                self.end_generation(why, false);
            }
            WorkerErrorKind::RestoreFailed => self.on_restore_failed(worker, &message),
            WorkerErrorKind::StateSync => {
                let why = Why::new(
                    AbortReason::StateSyncFailed,
                    format!(
                        "state sync failed on {worker}: {message}; restoring from a checkpoint"
                    ),
                );
                warn!(worker, job = %self.id, generation, %message, "state sync failed");
                if let Some(w) = self.workers.get_mut(worker) {
                    w.held = None;
                }
                self.end_generation(why, true);
            }
            WorkerErrorKind::NonFinite if self.bisects(step) => {
                self.start_bisection(worker, &message)
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
                self.finish(End::Failed(why));
            }
        }
    }

    /// Forms the job's generation when it waits for one, dispatches its
    /// next step when its generation is ready and idle, and lets its
    /// engine (or generator workers) go on generating.
    pub(crate) fn schedule(&mut self) {
        let job = &*self.job;
        if job.rec.state == JobState::Pending && matches!(job.phase, Phase::Waiting { .. }) {
            self.form_generation();
        }
        let job = &*self.job;
        let idle_and_ready = job
            .active()
            .is_some_and(|a| a.gen.all_ready() && matches!(a.work, Work::Idle));
        if job.rec.state == JobState::Running && idle_and_ready {
            self.dispatch();
        }
        // An external engine, or the generator workers, generate while
        // the trainers train.
        if self.job.spec.rl.generates_apart() {
            self.engine_tick();
        }
    }

    fn dispatch(&mut self) {
        // The RL loop: nothing goes out while a round is being scored (its
        // rollouts or eval answers are owed first); eval prompts are
        // answered before the first step and after the last.
        if let Some(l) = self.job.data.rollout_loop.as_ref() {
            if l.scoring.is_some() {
                return;
            }
            if self.eval_due() {
                // The eval answers wait for an engine round out to be
                // scored (one scoring slot).
                if l.engine.as_ref().is_some_and(|e| e.busy()) || self.plan_eval() {
                    return;
                }
            }
        }
        let job = &mut *self.job;
        if !job.replaying() && job.finished() && job.eval_run.is_none() {
            self.complete("all steps trained");
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
                        self.plan_round(need);
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
                    self.fx.push(Effect::LoadHistory {
                        job: self.id.clone(),
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
                    job.ahead.sent += 1;
                    Ok(Some(p))
                }
                None => planner::plan(job, Source::Files, world),
            },
            Ok(source) => planner::plan(job, source, world),
            Err(e) => Err(e),
        };
        let planned = match planned {
            Ok(Some(p)) if p.kind == PlanKind::Train && !p.replay => {
                let job = &*self.job;
                let max = job.spec.faults.max_step_attempts;
                if job.faults.attempts.0 == p.step && job.faults.attempts.1 >= max {
                    let why = Why::new(
                        AbortReason::TooManyAttempts,
                        format!(
                            "step {} was dispatched {max} times without committing (faults.max_step_attempts); the last attempt ended: {}",
                            p.step, job.faults.last_abort
                        ),
                    );
                    self.finish(End::Failed(why));
                    return;
                }
                Arc::new(p)
            }
            Ok(Some(p)) => Arc::new(p),
            Ok(None) => {
                self.complete("data exhausted");
                return;
            }
            Err(e) => {
                let why = Why::new(AbortReason::JobFailed, e.to_string());
                self.finish(End::Failed(why));
                return;
            }
        };
        self.send_plan(planned);
    }

    /// Plans the step after the one in flight, while it runs (see
    /// `ahead`): the shell asks once that step's plans are out.
    pub(crate) fn plan_ahead(&mut self) {
        let job = &mut *self.job;
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
            .next
            .as_ref()
            .is_some_and(|a| a.follows(&planned, generation))
        {
            return;
        }
        // Nothing planned (an eval chunk, a probe or a replay in flight):
        // the step planned before it is kept; dispatch checks its origin.
        if let Some(ahead) = planner::plan_ahead(job, world, &planned) {
            job.ahead.next = Some(ahead);
        }
    }

    fn send_plan(&mut self, planned: Arc<PlannedStep>) {
        let job = &mut *self.job;
        let active = job.active_mut().expect("dispatch within a generation");
        let gen = &active.gen;
        for (rank, m) in gen.members.iter().enumerate() {
            self.fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Plan {
                    job: self.id.clone(),
                    generation: gen.id,
                    rank: rank as u32,
                    planned: planned.clone(),
                },
            });
        }
        let last_plan = (gen.id, planned.step, planned.kind);
        active.work = Work::InFlight(InFlight {
            planned: planned.clone(),
            started_ms: self.now,
            results: BTreeMap::new(),
            logps: Vec::new(),
            nonfinite: BTreeMap::new(),
        });
        job.last_plan = Some(last_plan);
        job.note_dispatch(&planned);
    }

    /// A streamed job's stored queue, read back after its restore.
    pub(crate) fn restore_rollouts(&mut self, stored: StoredStream) {
        let j = &mut *self.job;
        let cursor = j.rec.cursor.position;
        let pg = j.spec.objective.pg();
        if let (Some(s), Some(plan), Some(pg)) =
            (j.data.stream.as_mut(), j.data.rollouts.as_mut(), pg)
        {
            s.restore(plan, &pg, &self.id, cursor, stored);
        }
    }

    /// Admits rollouts pushed to a streamed job (see `crate::rl::stream`).
    pub(crate) fn push_rollouts(&mut self, batch: Vec<Rollout>) -> Result<()> {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(
                self.id.as_str(),
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
                job: self.id.clone(),
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
            return Err(CoreError::NotStreamed(self.id.clone()));
        };
        let at = Admission {
            job: self.id.as_str(),
            pg: &pg,
            step,
            max_staleness,
            need: s.step_rollouts(docs),
        };
        self.fx
            .persist(Persist::Rollouts(Box::new(s.push(plan, at, batch)?)));
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
