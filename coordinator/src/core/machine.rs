//! The coordinator state machine. Each handler mutates state and returns the
//! effects to carry out; `schedule` then forms generations for waiting jobs
//! and dispatches steps to ready generations. The handlers live beside this
//! file by concern (`lifecycle`, `generations`, `control`, `publish`).

use std::collections::BTreeMap;

use tracing::{info, warn};

use super::effects::{Effect, Effects, Event, JobStart, Persist, RankResult, ToWorker};
use super::error::{CoreError, Result};
use super::jobs::{Job, JobData, Phase, Work};
use super::liveness::Liveness;
use super::planner;
use super::record::JobRecord;
use super::types::{
    AbortReason, CheckpointEntry, EventKind, JobId, JobState, PlanKind, Why, WorkerId,
};
use super::workers::{Registration, Worker, WorkerState};
use crate::job::spec::JobSpec;
use crate::stream::doc::Document;

/// Tunables of the state machine.
#[derive(Debug, Clone)]
pub struct CoordinatorOptions {
    /// A worker silent for this long is declared lost.
    pub heartbeat_timeout_ms: i64,
    /// After a restart, how long a job waits for the members of its last
    /// generation to re-register (they may still hold its state in memory)
    /// before forming a generation without them.
    pub rejoin_grace_ms: i64,
    /// Generations of at least this many ranks relay their messages
    /// through hubs (`super::relay`) when every member can; 0: never.
    pub relay_min_world: u32,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        Self {
            heartbeat_timeout_ms: 2_000,
            rejoin_grace_ms: 10_000,
            relay_min_world: RELAY_MIN_WORLD,
        }
    }
}

/// The default [`CoordinatorOptions::relay_min_world`]: below it the
/// messages saved do not pay for the extra hop.
pub const RELAY_MIN_WORLD: u32 = 64;

/// Lost workers whose records stay for operators (`accrue workers`,
/// ListWorkers); older ones are forgotten, so workers that come and go (a
/// restarted pod registers under a new id) do not grow the registry and
/// every listing without bound. A forgotten worker that comes back
/// registers again, under its old id if it asks for it.
pub const LOST_WORKERS_KEPT: usize = 256;

/// All jobs and workers, and the rules that move them.
#[derive(Debug, Default)]
pub struct Coordinator {
    pub(crate) opts: CoordinatorOptions,
    pub(crate) jobs: BTreeMap<JobId, Job>,
    /// Submission order, for FIFO scheduling.
    pub(crate) job_order: Vec<JobId>,
    pub(crate) workers: BTreeMap<WorkerId, Worker>,
    pub(crate) next_worker_seq: u64,
    /// Lost workers, least recently lost first, each once: the oldest
    /// records beyond [`LOST_WORKERS_KEPT`] are forgotten.
    pub(crate) lost: std::collections::VecDeque<WorkerId>,
    /// The coordinator's own delays in hearing workers (stalls, a
    /// backlog), not held against them.
    pub(crate) liveness: Liveness,
}

impl Coordinator {
    pub fn new(opts: CoordinatorOptions) -> Self {
        Self {
            opts,
            ..Default::default()
        }
    }

    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.job_order.iter().filter_map(|id| self.jobs.get(id))
    }

    pub fn job(&self, id: &str) -> Result<&Job> {
        self.jobs
            .get(id)
            .ok_or_else(|| CoreError::JobNotFound(id.to_string()))
    }

    pub(crate) fn job_mut(&mut self, id: &str) -> Result<&mut Job> {
        self.jobs
            .get_mut(id)
            .ok_or_else(|| CoreError::JobNotFound(id.to_string()))
    }

    /// How late heartbeats are read now (see `liveness`).
    pub fn heartbeat_backlog_ms(&self) -> i64 {
        self.liveness.backlog_ms()
    }

    pub fn workers(&self) -> impl Iterator<Item = &Worker> {
        let mut w: Vec<&Worker> = self.workers.values().collect();
        w.sort_by_key(|w| w.seq);
        w.into_iter()
    }

    pub fn worker(&self, id: &str) -> Option<&Worker> {
        self.workers.get(id)
    }

    /// Applies one event. Admin errors leave the state unchanged.
    pub fn handle(&mut self, event: Event, now_ms: i64) -> Result<Effects> {
        let mut fx = Effects::default();
        match event {
            Event::RegisterWorker { id, reg } => {
                if self
                    .workers
                    .get(&id)
                    .is_some_and(|w| w.state != WorkerState::Lost)
                {
                    return Err(CoreError::WorkerIdInUse(id));
                }
                self.register(id, reg, now_ms)
            }
            Event::SessionOpened { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.state = WorkerState::Idle;
                    w.heard = self.liveness.heard(now_ms, None);
                    w.job = None;
                    w.rank = None;
                }
            }
            Event::SessionClosed { worker } => {
                self.lose_worker(&worker, "session closed", now_ms, &mut fx)
            }
            Event::Heartbeat { worker, lag_ms } => {
                // Liveness only: it can make no job formable or dispatchable,
                // so nothing to schedule (issue 19: composing a waiting job's
                // generation on each of 4096 workers' heartbeats starved them).
                self.heard_from(&worker, now_ms, lag_ms);
                return Ok(fx);
            }
            Event::Heartbeats { beats } => {
                for b in beats {
                    self.heard_from(&b.worker, b.at_ms.min(now_ms), b.lag_ms);
                }
                return Ok(fx);
            }
            Event::Ready {
                worker,
                job,
                generation,
                step,
            } => {
                self.seen(&worker, now_ms);
                self.on_ready(&worker, &job, generation, step, now_ms, &mut fx);
            }
            Event::StepResult {
                worker,
                job,
                generation,
                step,
                sums,
                logps,
                nonfinite,
            } => {
                self.seen(&worker, now_ms);
                self.note_result(&worker, &job, generation, step);
                let result = RankResult {
                    sums,
                    logps,
                    nonfinite,
                };
                self.on_result(&worker, &job, generation, step, result, now_ms, &mut fx);
            }
            Event::HistoryLoaded { job, from, steps } => {
                self.history_loaded(&job, from, steps, now_ms, &mut fx)
            }
            Event::PlanAhead { job } => {
                // Changes nothing a schedule could act on.
                self.plan_ahead(&job);
                return Ok(fx);
            }
            Event::StepResults {
                worker,
                job,
                generation,
                step,
                results,
            } => {
                self.seen(&worker, now_ms);
                self.on_gathered(&worker, &job, generation, step, results, now_ms, &mut fx);
            }
            Event::WorkerError {
                worker,
                job,
                generation,
                step,
                kind,
                message,
            } => {
                self.seen(&worker, now_ms);
                self.on_worker_error(
                    &worker, &job, generation, step, kind, message, now_ms, &mut fx,
                );
            }
            Event::CheckpointDone { worker, job, step } => {
                self.seen(&worker, now_ms);
                self.on_checkpoint_done(&worker, &job, step, now_ms, &mut fx);
            }
            Event::PolicyPublished { worker, job, step } => {
                self.seen(&worker, now_ms);
                self.on_policy_published(&worker, &job, step, now_ms, &mut fx);
            }
            Event::SubmitJob {
                id,
                spec,
                spec_toml,
                docs,
                start,
            } => {
                if self.jobs.contains_key(&id) {
                    return Err(CoreError::DuplicateJob(id));
                }
                self.check_output_free(&spec.job.output_dir)?;
                let rec = new_record(&id, &spec, spec_toml, &docs, start, now_ms);
                info!(job = %id, name = %rec.name, docs = docs.len(), "job submitted");
                let data = JobData::new(&id, &spec, docs, None, rec.step);
                let mut job = Job::new(rec, spec, data);
                job.rec.total_steps =
                    planner::total_steps(&job.spec, &job.data.docs, job.data.rollouts.as_ref());
                fx.persist(Persist::Job(Box::new(job.rec.clone())));
                self.job_order.push(id.clone());
                self.jobs.insert(id, job);
            }
            Event::RestoreJob {
                rec,
                spec,
                docs,
                reference,
                history,
            } => {
                let mut rec = *rec;
                if rec.state == JobState::Running {
                    // No generation survives a restart; workers re-join.
                    rec.state = JobState::Pending;
                    rec.reason = "coordinator restarted; waiting for workers".into();
                }
                migrate_checkpoint_index(&mut rec, &spec);
                let id = rec.id.clone();
                let data = JobData::new(&id, &spec, docs, Some(reference), rec.step);
                let mut job = Job::new(rec, spec, data);
                if let Phase::Waiting {
                    rejoin_until_ms, ..
                } = &mut job.phase
                {
                    if !job.rec.members.is_empty() {
                        *rejoin_until_ms = Some(now_ms + self.opts.rejoin_grace_ms);
                    }
                }
                job.data.history = history.into_iter().map(|h| (h.step, h)).collect();
                // The shell loads only the window (`Job::history_window_start`);
                // the steps before it are in the store.
                job.trim_history(None);
                self.job_order.push(id.clone());
                self.jobs.insert(id, job);
            }
            Event::CancelJob { job } => self.cancel(&job, now_ms, &mut fx)?,
            Event::PauseJob { job } => self.pause(&job, now_ms, &mut fx)?,
            Event::ResumeJob { job } => self.resume(&job, now_ms, &mut fx)?,
            Event::DrainWorker { worker } => self.drain(&worker, now_ms, &mut fx)?,
            Event::TriggerCheckpoint { job } => self.trigger_checkpoint(&job, &mut fx)?,
            Event::UpdateJob { job, update } => self.update_job(&job, update, now_ms, &mut fx)?,
            Event::ReleaseQuarantine { job, docs } => {
                self.release_quarantine(&job, docs.as_deref(), now_ms, &mut fx)?;
            }
            Event::Tick { stalled_ms } => {
                let timeout = self.opts.heartbeat_timeout_ms;
                self.liveness.tick(now_ms, stalled_ms, timeout);
                self.tick(now_ms, &mut fx);
            }
            Event::PushRollouts { job, rollouts } => {
                self.push_rollouts(&job, rollouts, &mut fx)?;
            }
            Event::OutputFailed { job, what } => {
                let state = self.job(&job)?.rec.state;
                if !state.is_terminal() {
                    let why = Why::new(
                        AbortReason::OutputFailed,
                        format!("writing the job's output failed: {what}"),
                    );
                    self.finish(&job, super::types::End::Failed(why), now_ms, &mut fx);
                }
            }
            Event::PersistFailed { jobs, error } => {
                for job in jobs {
                    self.persist_failed(&job, &error, now_ms, &mut fx);
                }
            }
            Event::LoadPrompts { job, inputs } => self.load_prompts(&job, inputs)?,
            Event::GenerateResult {
                worker,
                job,
                generation,
                round,
                completions,
                seconds,
            } => {
                self.seen(&worker, now_ms);
                let answer = (completions, seconds);
                self.on_generated(&worker, &job, generation, round, answer, now_ms, &mut fx);
            }
            Event::RoundScored {
                job,
                round,
                rollouts,
                stats,
            } => self.on_scored(&job, round, rollouts, stats, now_ms, &mut fx)?,
            Event::RoundFailed { job, round, error } => {
                self.on_score_failed(&job, round, error, now_ms, &mut fx)
            }
            Event::EngineGenerated { job, round, result } => {
                self.on_engine_generated(&job, round, result, now_ms, &mut fx)
            }
            Event::WeightsSynced {
                worker,
                job,
                generation,
                version,
            } => {
                self.seen(&worker, now_ms);
                self.on_weights_synced(&worker, &job, generation, version, now_ms, &mut fx);
            }
            Event::EngineReloaded { job, step, result } => {
                self.on_engine_reloaded(&job, step, result, now_ms, &mut fx)
            }
            Event::RestoreRollouts { job, stored } => {
                if let Some(j) = self.jobs.get_mut(&job) {
                    let id = j.rec.id.clone();
                    let cursor = j.rec.cursor.position;
                    let pg = j.spec.objective.pg();
                    if let (Some(s), Some(plan), Some(pg)) =
                        (j.data.stream.as_mut(), j.data.rollouts.as_mut(), pg)
                    {
                        s.restore(plan, &pg, &id, cursor, stored);
                    }
                }
            }
        }
        self.schedule(now_ms, &mut fx);
        let jobs = &self.jobs;
        let current = |job: &str| jobs.get(job)?.active().map(|a| a.gen.id);
        super::routing::route(fx.then_mut(), &self.workers, current);
        Ok(fx)
    }

    /// The store refused `job_id`'s writes: the job ends here, in memory
    /// only. Nothing is written (the store is what failed; its last
    /// durable state is what a restarted coordinator resumes the job
    /// from), and its members are released.
    fn persist_failed(&mut self, job_id: &str, error: &str, now_ms: i64, fx: &mut Effects) {
        if self
            .jobs
            .get(job_id)
            .is_none_or(|j| j.rec.state.is_terminal())
        {
            return;
        }
        let why = Why::new(
            AbortReason::OutputFailed,
            format!(
                "the coordinator's store refused the job's state ({error}); a restarted coordinator resumes it from its last durable step"
            ),
        );
        let mut ended = Effects::default();
        self.finish(job_id, super::types::End::Failed(why), now_ms, &mut ended);
        let (_unwritable, then) = ended.into_parts();
        for e in then {
            fx.push(e);
        }
    }

    /// The job an operator means by `arg`: its id; else its `job.name`
    /// (the live job of that name, or the latest submitted when none is
    /// live); else a unique id prefix. Several live jobs of one name, or a
    /// prefix of several ids, are refused listing them.
    pub fn resolve_job(&self, arg: &str) -> Result<JobId> {
        if self.jobs.contains_key(arg) {
            return Ok(arg.to_string());
        }
        let ambiguous = |ids: Vec<&Job>| CoreError::AmbiguousJob {
            arg: arg.to_string(),
            candidates: ids.iter().map(|j| j.rec.id.clone()).collect(),
        };
        let named: Vec<&Job> = self.jobs().filter(|j| j.rec.name == arg).collect();
        let live: Vec<&Job> = named
            .iter()
            .copied()
            .filter(|j| !j.rec.state.is_terminal())
            .collect();
        match (live.len(), named.last()) {
            (1, _) => return Ok(live[0].rec.id.clone()),
            (0, Some(latest)) => return Ok(latest.rec.id.clone()),
            (0, None) => {}
            _ => return Err(ambiguous(live)),
        }
        let prefixed: Vec<&Job> = self.jobs().filter(|j| j.rec.id.starts_with(arg)).collect();
        match prefixed.len() {
            0 => Err(CoreError::JobNotFound(arg.to_string())),
            1 => Ok(prefixed[0].rec.id.clone()),
            _ => Err(ambiguous(prefixed)),
        }
    }

    /// The live (not ended) job named `name`, if any: a submit of the same
    /// name and spec returns it instead of starting a second one.
    pub fn live_job_named(&self, name: &str) -> Option<&Job> {
        self.jobs()
            .find(|j| !j.rec.state.is_terminal() && j.rec.name == name)
    }

    /// Refuses an output directory a live job writes to.
    pub fn check_output_free(&self, dir: &std::path::Path) -> Result<()> {
        let owner = self
            .jobs
            .values()
            .find(|j| !j.rec.state.is_terminal() && j.spec.job.output_dir == dir);
        match owner {
            Some(j) => Err(CoreError::OutputInUse {
                dir: dir.to_path_buf(),
                owner: j.rec.id.clone(),
                name: j.rec.name.clone(),
                state: j.rec.state.name().to_string(),
            }),
            None => Ok(()),
        }
    }

    /// The step at whose boundary a triggered checkpoint lands.
    pub fn checkpoint_step(&self, job: &str) -> Result<u64> {
        let j = self.job(job)?;
        Ok(j.inflight()
            .filter(|f| f.planned.kind == PlanKind::Train)
            .map_or(j.rec.step, |f| f.planned.step))
    }

    /// The id a registering worker that held `previous` gets back: that
    /// one when no live registration holds it (unknown here, or lost),
    /// else none (it takes a fresh id). A registration not yet followed by
    /// its session holds its id too: two processes claiming one id (a
    /// worker restarted twice, a duplicated pod) must not share a record.
    /// Decided and applied under one lock (the shell's), with
    /// [`Event::RegisterWorker`].
    pub fn reusable_id(&self, previous: &str) -> Option<WorkerId> {
        let taken = self
            .workers
            .get(previous)
            .is_some_and(|w| w.state != WorkerState::Lost);
        (!previous.is_empty() && !taken).then(|| previous.to_string())
    }

    fn register(&mut self, id: WorkerId, reg: Registration, now_ms: i64) {
        self.next_worker_seq += 1;
        info!(worker = %id, host = %reg.hostname, device = %reg.device, held = ?reg.held, "worker registered");
        let held = reg.held.clone();
        self.workers.insert(
            id.clone(),
            Worker {
                id,
                reg,
                state: WorkerState::Registered,
                heard: self.liveness.heard(now_ms, None),
                job: None,
                rank: None,
                draining: false,
                seq: self.next_worker_seq,
                held,
                follows: None,
            },
        );
    }

    /// A worker's rank among the generators of its job's generation
    /// (disaggregated RL), if it is one.
    pub fn generator_rank(&self, w: &Worker) -> Option<u32> {
        let job = self.jobs.get(w.job.as_deref()?)?;
        job.gen()?.generators.rank_of(&w.id)
    }

    pub(crate) fn seen(&mut self, worker: &str, now_ms: i64) {
        self.heard_from(worker, now_ms, None);
    }

    /// A message from `worker` read `lag_ms` late (see `liveness`). Every
    /// heartbeat's delay is evidence of the backlog, a lost worker's too.
    fn heard_from(&mut self, worker: &str, now_ms: i64, lag_ms: Option<i64>) {
        let heard = self.liveness.heard(now_ms, lag_ms);
        if let Some(w) = self.workers.get_mut(worker) {
            // A queued heartbeat applied after a newer message keeps the
            // newer time.
            if w.state != WorkerState::Lost && heard.at_ms >= w.heard.at_ms {
                w.heard = heard;
            }
        }
    }

    fn tick(&mut self, now_ms: i64, fx: &mut Effects) {
        let timeout = self.opts.heartbeat_timeout_ms;
        let live = &self.liveness;
        let silent: Vec<WorkerId> = self
            .workers
            .values()
            .filter(|w| w.connected() && live.silent_ms(&w.heard, now_ms) > timeout)
            .map(|w| w.id.clone())
            .collect();
        for w in silent {
            self.lose_worker(&w, "missed heartbeats", now_ms, fx);
        }
        // Members alive but silent on a plan past its deadline (a hung
        // trainer thread still heartbeats) are lost as well.
        let mut overdue = Vec::new();
        for job in self.jobs.values() {
            let (Some(deadline), Some(a), Some(f)) =
                (job.step_deadline_ms(), job.active(), job.inflight())
            else {
                continue;
            };
            if now_ms <= deadline {
                continue;
            }
            let waited_s = (now_ms - f.started_ms) as f64 / 1000.0;
            for (rank, m) in a.gen.members.iter().enumerate() {
                if !f.results.contains_key(&(rank as u32)) {
                    let detail = format!(
                        "worker {m} (rank {rank}) gave no result for step {} in {waited_s:.0} s (the step deadline)",
                        f.planned.step
                    );
                    overdue.push((m.clone(), detail));
                }
            }
        }
        // The same for a generation round (a hung sampler).
        for job in self.jobs.values() {
            let (Some(deadline), Some((r, workers))) = (job.round_deadline_ms(), job.round_on())
            else {
                continue;
            };
            if now_ms <= deadline {
                continue;
            }
            let waited_s = (now_ms - r.started_ms) as f64 / 1000.0;
            for (rank, m) in workers.iter().enumerate() {
                if !r.answers.contains_key(&(rank as u32)) {
                    let detail = format!(
                        "worker {m} (rank {rank}) gave no completions for generation round {} in {waited_s:.0} s (the step deadline)",
                        r.id
                    );
                    overdue.push((m.clone(), detail));
                }
            }
        }
        for (w, detail) in overdue {
            let why = Why::new(AbortReason::StepDeadline, detail);
            self.lose_worker_because(&w, why, now_ms, fx);
        }
    }

    /// A worker is gone: its generation's in-flight step is aborted and the
    /// job waits for a new generation, re-planning from the same cursor.
    pub(crate) fn lose_worker(&mut self, worker: &str, why: &str, now_ms: i64, fx: &mut Effects) {
        let why = Why::new(
            AbortReason::WorkerLost,
            format!("worker {worker} lost: {why}"),
        );
        self.lose_worker_because(worker, why, now_ms, fx);
    }

    /// [`Self::lose_worker`] with the reason its generation ends for.
    pub(crate) fn lose_worker_because(
        &mut self,
        worker: &str,
        why: Why,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let Some(w) = self.workers.get_mut(worker) else {
            return;
        };
        if w.state == WorkerState::Lost {
            return;
        }
        // Losing a worker mid-job costs a step; one that was released or
        // idle leaving is routine.
        if w.job.is_some() {
            warn!(worker, reason = %why, "worker lost");
        } else {
            info!(worker, reason = %why, "worker left");
        }
        w.state = WorkerState::Lost;
        // Whatever it held is gone with it (a re-registration reports anew).
        w.held = None;
        // A worker lost while its session is open (stopped, partitioned, or
        // hung past a deadline) may still be running: ending the session
        // makes it reconnect and register again instead of heartbeating
        // into a state that ignores it.
        fx.push(Effect::EndSession {
            worker: worker.to_string(),
            why: why.detail.clone(),
        });
        let job = w.job.take();
        w.rank = None;
        // Checkpoints it had not yet written will never be whole.
        for j in self.jobs.values_mut() {
            j.pending_checkpoints
                .retain(|_, acks| acks.get(worker).is_none_or(|&done| done));
        }
        if let Some(job) = job {
            self.end_generation(&job, why, false, now_ms, fx);
        }
        self.remember_lost(worker);
    }

    /// Notes `worker` as the most recently lost and forgets the records of
    /// the least recently lost beyond [`LOST_WORKERS_KEPT`] (one that came
    /// back since is not lost and stays).
    fn remember_lost(&mut self, worker: &str) {
        self.lost.retain(|w| w != worker);
        self.lost.push_back(worker.to_string());
        while self.lost.len() > LOST_WORKERS_KEPT {
            let Some(old) = self.lost.pop_front() else {
                break;
            };
            let forget = self
                .workers
                .get(&old)
                .is_some_and(|w| w.state == WorkerState::Lost && w.job.is_none());
            if forget {
                self.workers.remove(&old);
            }
        }
    }

    /// Ends a job's generation: aborts its in-flight step (the cursor has
    /// not moved, so the same documents are re-planned) and frees its
    /// members. With `disk_only` the next generation must restore from disk.
    pub(crate) fn end_generation(
        &mut self,
        job_id: &str,
        why: Why,
        disk_only: bool,
        now_ms: i64,
        fx: &mut Effects,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let Phase::Active(active) = std::mem::replace(
            &mut job.phase,
            Phase::Waiting {
                rejoin_until_ms: None,
                disk_only,
            },
        ) else {
            return;
        };
        let gen = active.gen;
        // A disk-only generation that never became ready passes the
        // restriction on.
        if gen.disk_only && !gen.all_ready() {
            job.phase = Phase::Waiting {
                rejoin_until_ms: None,
                disk_only: true,
            };
        }
        let aborted = match active.work {
            Work::InFlight(f) => Some(f.planned.step),
            Work::Idle | Work::Generating(_) | Work::AwaitingCheckpoint(_) => None,
        };
        // Checkpoints its members are still writing go on (they count once
        // every writer reports); one missing a lost writer was dropped.
        // (Generators run no step: they take no abort.)
        let trainers = gen.members.len();
        for (i, m) in gen.everyone().enumerate() {
            if let Some(w) = self.workers.get_mut(m) {
                if w.state == WorkerState::Lost {
                    continue;
                }
                if let Some(step) = aborted.filter(|_| i < trainers) {
                    fx.push(Effect::Send {
                        worker: m.clone(),
                        msg: ToWorker::Abort {
                            job: job_id.to_string(),
                            generation: gen.id,
                            step,
                            why: why.clone(),
                        },
                    });
                }
                w.job = None;
                w.rank = None;
                w.state = if w.draining {
                    // Its boundary will not come in this generation and a
                    // drained worker joins no other: it leaves now.
                    fx.push(Effect::Send {
                        worker: m.clone(),
                        msg: ToWorker::Release {
                            job: job_id.to_string(),
                            reason: "drained".into(),
                        },
                    });
                    WorkerState::Draining
                } else {
                    WorkerState::Idle
                };
            }
        }
        if aborted.is_some() {
            job.last_abort = why.detail.clone();
        }
        if !job.rec.state.is_terminal() && job.rec.state != JobState::Paused {
            job.rec.state = JobState::Pending;
            job.rec.reason = why.detail.clone();
        }
        fx.persist(Persist::Job(Box::new(job.rec.clone())));
        let message = match aborted {
            Some(step) => format!("generation {} ended, step {step} aborted: {why}", gen.id),
            None => format!("generation {} ended: {why}", gen.id),
        };
        let event = job.event_ending(
            EventKind::Generation,
            message,
            Some(why.reason),
            aborted,
            now_ms,
        );
        fx.push(event);
    }
}

/// The record of a job submitted now (from `start` when it resumes a
/// checkpoint of ours).
fn new_record(
    id: &str,
    spec: &JobSpec,
    spec_toml: String,
    docs: &[Document],
    start: Option<JobStart>,
    now_ms: i64,
) -> JobRecord {
    JobRecord {
        id: id.to_string(),
        name: spec.job.name.clone(),
        spec_toml,
        state: JobState::Pending,
        reason: "waiting for workers".into(),
        step: start.as_ref().map_or(0, |s| s.step),
        cursor: start.as_ref().map(|s| s.cursor.clone()).unwrap_or_default(),
        generation: 0,
        submitted_unix_ms: now_ms,
        last_loss: None,
        documents: docs.len() as u64,
        total_steps: 0,
        last_checkpoint: None,
        history_from: start.as_ref().map_or(0, |s| s.step),
        checkpoints: start
            .as_ref()
            .map(|s| CheckpointEntry {
                step: s.step,
                dir: s.dir.clone(),
            })
            .into_iter()
            .collect(),
        bad_checkpoints: Vec::new(),
        members: Vec::new(),
        quarantine: Vec::new(),
        resumed_from: start.map(|s| s.dir),
        changes: Vec::new(),
    }
}

/// Records written before the checkpoint index existed: their last
/// checkpoint becomes the index.
fn migrate_checkpoint_index(rec: &mut JobRecord, spec: &JobSpec) {
    if !rec.checkpoints.is_empty() {
        return;
    }
    if let Some(step) = rec.last_checkpoint {
        let dir = spec
            .job
            .output_dir
            .join("checkpoints")
            .join(format!("step-{step}"));
        rec.checkpoints.push(CheckpointEntry { step, dir });
    }
}
