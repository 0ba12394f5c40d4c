//! Carrying out the core's effects: the writes first, then (only once
//! every write succeeded) the messages, watch items, output files and
//! calls that follow them; and what a call leaves to do after them.

use std::path::Path;
use std::time::Instant;

use tonic::Status;
use tracing::{error, warn};

use super::shared::{handle_timed, Inner, Shared, Timing};
use crate::core::{Effect, Effects, Event, EventKind, JobId, Persist, ToWorker, WatchItem};
use crate::shell::store::{StepRecord, Store};

/// What carrying out a call's effects leaves for after them.
#[derive(Default)]
struct After {
    /// Outputs that could not be written fail their job, after this
    /// call's effects (the core hears of it as an event); so does a
    /// history read that could not start.
    failed_outputs: Vec<Event>,
    /// Per job with a plan among the effects: when its last plan was queued.
    dispatched: Vec<(JobId, Instant)>,
}

impl After {
    fn dispatched(&mut self, job: JobId) {
        let now = Instant::now();
        match self.dispatched.iter_mut().find(|(j, _)| *j == job) {
            Some((_, t)) => *t = now,
            None => self.dispatched.push((job, now)),
        }
    }
}

impl Shared {
    /// Feeds the exporter what one state-machine call did: aborted steps
    /// and completed checkpoints (committed steps and dispatched plans are
    /// observed while their effects are carried out).
    fn observe_effects(&self, inner: &Inner, effects: &[Effect]) {
        let mut aborted: Vec<&str> = Vec::new();
        for e in effects {
            let (job, reason) = match e {
                Effect::Send {
                    msg: ToWorker::Abort { job, why, .. },
                    ..
                } => (job, why.reason),
                // A generation whose members were all lost sends no Abort.
                Effect::Publish {
                    job,
                    item:
                        WatchItem::Event {
                            reason: Some(reason),
                            aborted_step: Some(_),
                            ..
                        },
                } => (job, *reason),
                Effect::Publish {
                    job,
                    item:
                        WatchItem::Event {
                            kind: EventKind::Checkpoint,
                            unix_ms,
                            ..
                        },
                } => {
                    let step = inner.core.job(job).ok().and_then(|j| j.rec.last_checkpoint);
                    self.metrics.observe_checkpoint(job, step, *unix_ms);
                    continue;
                }
                _ => continue,
            };
            // One abort per job and call, however many members were told.
            if !aborted.contains(&job.as_str()) {
                aborted.push(job);
                self.metrics.observe_abort(job, reason);
            }
        }
    }

    /// Writes a metrics line to the job's TensorBoard files when its spec
    /// asks for them; `Err` names the file that could not be written.
    fn track(
        &self,
        inner: &Inner,
        job: &JobId,
        prefix: &str,
        step: u64,
        unix_ms: i64,
        line: &impl serde::Serialize,
    ) -> Result<(), String> {
        let Ok(j) = inner.core.job(job) else {
            return Ok(());
        };
        if !j.spec.tracking.tensorboard {
            return Ok(());
        }
        let out = Path::new(&j.spec.job.output_dir);
        self.tensorboard
            .write(job, out, prefix, step, unix_ms, line)
            .map_err(|err| {
                error!(%job, %err, "writing TensorBoard events failed");
                format!("{}/tb: {err}", out.display())
            })
    }

    /// One durable write; Err names the job and what failed.
    fn persist(&self, inner: &mut Inner, p: Persist) -> Result<(), (JobId, String)> {
        let job = p.job().to_string();
        let result = match p {
            Persist::Job(rec) => {
                // A state change may end a waiting push (cancelled job).
                self.rollouts.wake();
                let written = inner
                    .store
                    .put_job(&rec)
                    .map_err(|e| format!("persisting job {job}: {e}"));
                // An ended job's directory is free to another coordinator
                // at once, not only once its marker goes stale.
                if written.is_ok() && rec.state.is_terminal() {
                    if let Ok(j) = inner.core.job(&job) {
                        self.markers
                            .release(&job, &j.spec.job.output_dir, super::now_ms());
                    }
                    // Its prompts and verifier go, and an environment
                    // program it ran ends with them (killed with its group).
                    self.scorers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&job);
                    // Its endpoint's waiting calls end with an error.
                    self.drop_endpoint(&job);
                }
                written
            }
            Persist::Step {
                rec,
                metrics,
                docs,
                manifest,
            } => {
                let step = metrics.step;
                let m = (*metrics).clone();
                let record = StepRecord {
                    metrics: *metrics,
                    docs,
                    manifest: Some(*manifest),
                };
                let written = inner.store.commit_step(&rec, record);
                if written.is_ok() {
                    self.metrics.observe_step(&job, &m);
                    cool_off_lock(&inner.store, &job, step);
                }
                written.map_err(|e| format!("persisting step {step} of job {job}: {e}"))
            }
            Persist::Reference { entries, .. } => inner
                .store
                .put_reference(&job, &entries)
                .map_err(|e| format!("persisting reference log-probs of job {job}: {e}")),
            Persist::Rollouts(w) => {
                let written = inner.store.put_rollouts(&w);
                if written.is_ok() {
                    if let Some(c) = &w.counts {
                        self.metrics.observe_rollouts(&job, c);
                    }
                }
                if !w.remove.is_empty() {
                    self.rollouts.wake();
                }
                written.map_err(|e| format!("persisting rollouts of job {job}: {e}"))
            }
        };
        result.map_err(|what| {
            error!(%job, %what, "a write to the store failed");
            (job, what)
        })
    }

    /// Some of a call's writes failed: what followed them (`withheld`
    /// effects) is dropped, and the core ends the jobs written for without
    /// writing again (their last durable state stays in the store).
    fn persist_failed(
        &self,
        inner: &mut Inner,
        failed: Vec<(JobId, String)>,
        withheld: usize,
    ) -> Status {
        let error = failed
            .iter()
            .map(|(_, what)| what.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        let mut jobs: Vec<JobId> = failed.into_iter().map(|(j, _)| j).collect();
        jobs.dedup();
        error!(?jobs, withheld, %error, "writes failed: their messages are withheld");
        let status = Status::internal(error.clone());
        if let Err(e) = self.apply_locked(inner, Event::PersistFailed { jobs, error }) {
            error!(%e, "ending the jobs whose writes failed");
        }
        status
    }

    /// Carries out `effects` of the state-machine call `timing` measured:
    /// the writes, then (only if every write succeeded) the rest. A
    /// refused write withholds everything after it and fails the jobs
    /// written for, in memory only ([`Event::PersistFailed`]).
    pub(super) fn run_effects(
        &self,
        inner: &mut Inner,
        effects: Effects,
        timing: Timing,
    ) -> Result<(), Status> {
        let (persists, effects) = effects.into_parts();
        let mut failed: Vec<(JobId, String)> = Vec::new();
        for p in persists {
            if let Err(e) = self.persist(inner, p) {
                failed.push(e);
            }
        }
        if !failed.is_empty() {
            return Err(self.persist_failed(inner, failed, effects.len()));
        }
        self.observe_effects(inner, &effects);
        let mut after = After::default();
        for e in effects {
            self.carry_out(inner, e, &mut after);
        }
        self.after_effects(inner, after, timing)
    }

    /// Carries out one effect of a call whose writes are durable.
    fn carry_out(&self, inner: &mut Inner, e: Effect, after: &mut After) {
        match e {
            Effect::AppendMetrics { job, path, metrics } => {
                if let Err(err) = crate::shell::output::append_metrics(&path, &job, &metrics) {
                    error!(path = %path.display(), %err, "writing metrics.jsonl failed");
                    let what = format!("{}: {err}", path.display());
                    after.failed_outputs.push(Event::OutputFailed { job, what });
                } else if let Err(what) = self.track(
                    inner,
                    &job,
                    "train",
                    metrics.step,
                    metrics.unix_ms,
                    &*metrics,
                ) {
                    after.failed_outputs.push(Event::OutputFailed { job, what });
                }
            }
            Effect::AppendEval { job, path, eval } => {
                self.metrics.observe_eval(&job, &eval);
                if let Err(err) = crate::shell::output::append_eval(&path, &job, &eval) {
                    error!(path = %path.display(), %err, "writing metrics.jsonl failed");
                    let what = format!("{}: {err}", path.display());
                    after.failed_outputs.push(Event::OutputFailed { job, what });
                } else if let Err(what) =
                    self.track(inner, &job, "eval", eval.step, eval.unix_ms, &eval)
                {
                    after.failed_outputs.push(Event::OutputFailed { job, what });
                }
            }
            Effect::RemoveCheckpoint { job, step, dir } => match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    tracing::info!(%job, step, dir = %dir.display(), "old checkpoint removed")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => {
                    error!(%job, dir = %dir.display(), %err, "removing an old checkpoint failed");
                    let what = format!("removing {}: {err}", dir.display());
                    after.failed_outputs.push(Event::OutputFailed { job, what });
                }
            },
            Effect::WriteTokenizer { job, dir, step } => {
                if let Ok(j) = inner.core.job(&job) {
                    let (me, id) = (self.me.clone(), job.clone());
                    self.tokenizers
                        .write(&job, &j.spec.data, &dir, move |result| {
                            let event = match (result, step) {
                                (Err(what), _) => Event::OutputFailed { job: id, what },
                                (Ok(()), Some(step)) => Event::TokenizerWritten { job: id, step },
                                (Ok(()), None) => return,
                            };
                            if let Some(s) = me.upgrade() {
                                if let Err(e) = s.apply(event) {
                                    error!(%e, "taking a tokenizer write's result failed");
                                }
                            }
                        });
                }
            }
            Effect::Send { worker, msg } => {
                // A relay's messages are its members'.
                let relayed: &[(u32, ToWorker)] = match &msg {
                    ToWorker::Relay { messages, .. } => messages,
                    _ => &[],
                };
                let each = std::iter::once(&msg).chain(relayed.iter().map(|m| &m.1));
                let planned = each.clone().find_map(|m| match m {
                    ToWorker::Plan { job, .. } => Some(job.clone()),
                    _ => None,
                });
                if let Some((_, tx)) = inner.sessions.get(&worker) {
                    // A closed channel means the session is going away;
                    // its close event will follow.
                    let _ = tx.send(Ok(msg));
                }
                if let Some(job) = planned {
                    after.dispatched(job);
                }
            }
            Effect::EndSession { worker, why } => {
                // The session's reader task keeps its own sender, so
                // the stream is ended with a status, not by a drop.
                if let Some((_, tx)) = inner.sessions.remove(&worker) {
                    let status = Status::aborted(format!(
                        "this worker was declared lost ({why}); register again"
                    ));
                    let _ = tx.send(Err(status));
                }
            }
            Effect::Publish { job, item } => {
                let _ = self.watch.send((job, item));
            }
            Effect::LoadHistory { job, from, to } => {
                if let Err(err) = load_history(self.me.clone(), inner.store.clone(), &job, from, to)
                {
                    // The core waits for an answer: without a thread the
                    // replay would wait forever, so it fails instead.
                    let steps = Err(format!("starting the thread that reads it: {err}"));
                    after
                        .failed_outputs
                        .push(Event::HistoryLoaded { job, from, steps });
                }
            }
            Effect::ScoreRound(round) => self.score_round(*round),
            Effect::StepEpisodes(step) => self.step_episodes(*step),
            Effect::Served { served, .. } => self.deliver(served),
            Effect::EngineGenerate(round) => self.engine_generate(*round),
            Effect::EngineReload {
                job,
                step,
                dir,
                engine,
                adapter,
            } => self.engine_reload(job, step, dir, engine, adapter),
        }
    }

    /// What follows a call's effects: the plan latencies observed, the
    /// outputs that failed reported to the core, the next steps planned
    /// ahead.
    fn after_effects(&self, inner: &mut Inner, after: After, timing: Timing) -> Result<(), Status> {
        let mut failure = None;
        for (job, queued) in &after.dispatched {
            let plan = timing.returned - timing.started;
            self.metrics
                .observe_plan(job, plan, *queued - timing.returned);
        }
        for event in after.failed_outputs {
            if let Err(status) = self.apply_locked(inner, event) {
                failure = Some(status);
            }
        }
        // The plans are queued to the sessions, whose tasks encode and send
        // them: the next step is planned while this one runs, after the
        // tasks already queued (the sends) had their turn.
        for (job, _) in after.dispatched {
            match (&self.runtime, self.me.upgrade()) {
                (Some(rt), Some(me)) => {
                    rt.spawn(async move {
                        tokio::task::yield_now().await;
                        me.plan_ahead(&job);
                    });
                }
                _ => self.plan_ahead_locked(inner, &job),
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Plans `job`'s next step while its current one runs (`core::ahead`).
    fn plan_ahead(&self, job: &str) {
        let mut inner = self.lock();
        self.plan_ahead_locked(&mut inner, job);
    }

    fn plan_ahead_locked(&self, inner: &mut Inner, job: &str) {
        let event = Event::PlanAhead {
            job: job.to_string(),
        };
        match handle_timed(inner, event) {
            Ok((_, timing)) => self
                .metrics
                .observe_plan_ahead(job, timing.returned - timing.started),
            // Nothing to report to: dispatch plans the step itself.
            Err(e) => warn!(job, %e, "planning the next step ahead failed"),
        }
    }
}

/// Reads steps `from..=to` of `job`'s replay history from the store on a
/// thread of its own (a replay reached steps the core no longer holds in
/// memory; decompressing their records must not hold the state lock) and
/// hands them to the core. Err: the thread could not start (nothing was
/// read; the caller answers the core itself).
fn load_history(
    me: std::sync::Weak<Shared>,
    store: Store,
    job: &str,
    from: u64,
    to: u64,
) -> std::io::Result<()> {
    let job = job.to_string();
    std::thread::Builder::new()
        .name("accrue-coord-history".into())
        .spawn(move || {
            let steps = crate::shell::store::committed_steps_between(&store, &job, from, to)
                .map_err(|e| e.to_string());
            if let Some(shared) = me.upgrade() {
                if let Err(status) = shared.apply(Event::HistoryLoaded { job, from, steps }) {
                    error!(%status, "handing the replay history read from the store to the core failed");
                }
            }
        })
        .map(|_| ())
}

/// Moves `job`'s old step records to a cold file on a thread of its own
/// when due: tens of megabytes read, written and synced at W = 1024 must
/// not hold the state lock (issue 19). A move that fails is logged and
/// due again at the next commit.
fn cool_off_lock(store: &Store, job: &str, step: u64) {
    let cooling = match store.cooling(job, step) {
        Ok(Some(c)) => c,
        Ok(None) => return,
        Err(err) => {
            warn!(%job, %err, "checking for old step records to move failed");
            return;
        }
    };
    let job = job.to_string();
    let spawned = std::thread::Builder::new()
        .name("accrue-coord-cool".into())
        .spawn(move || {
            if let Err(err) = cooling.run() {
                warn!(%job, %err, "moving old step records to the cold files failed");
            }
        });
    if let Err(err) = spawned {
        warn!(%err, "starting the move of old step records failed");
    }
}
