//! A job's handlers run on [`JobCtx`]: the job, the worker registry, the
//! time and the effects being collected, looked up once per event. What
//! every handler needs (an event on the watch stream, losing a member,
//! ending the generation, ending the job) lives here; the handlers
//! themselves live beside it by concern (`results`, `commit`, `dispatch`, `generations`,
//! `control`, `publish`, `quarantine`, and the RL loop's in `crate::rl`).

use tracing::info;

use super::effects::{Effect, Effects, Persist, ToWorker};
use super::job::Job;
use super::options::CoordinatorOptions;
use super::phase::{Phase, Work};
use super::types::{AbortReason, End, EventKind, JobId, JobState, Why};
use super::workers::{WorkerState, Workers};

/// One job, with what its handlers may touch besides it.
pub(crate) struct JobCtx<'a> {
    pub id: JobId,
    pub job: &'a mut Job,
    pub workers: &'a mut Workers,
    pub opts: &'a CoordinatorOptions,
    pub now: i64,
    pub fx: &'a mut Effects,
}

impl JobCtx<'_> {
    /// A watch event about the job, in its current state.
    pub fn event(&mut self, kind: EventKind, message: String) {
        let e = self.job.event(kind, message, self.now);
        self.fx.push(e);
    }

    /// Writes the job's record (before anything the call does after it).
    pub fn persist_job(&mut self) {
        self.fx
            .persist(Persist::Job(Box::new(self.job.rec.clone())));
    }

    /// A member is gone (`why` names it): its session ends, the checkpoints
    /// it still owed never complete, and the generation ends: its step in
    /// flight is aborted and re-planned from the same cursor.
    pub fn lose_member(&mut self, worker: &str, why: Why) {
        if let Some(job) = self.workers.lose(worker, &why, self.fx) {
            self.job.acks.checkpoints.drop_owed_by(worker);
            if job.as_deref() == Some(self.id.as_str()) {
                self.end_generation(why, false);
            }
        }
    }

    /// Refuses `worker`'s answer: the worker is dropped like a failed one
    /// and its work planned again, unless `faults.max_step_attempts`
    /// answers in a row were refused without any work completing: then
    /// the job fails, naming the last refusal.
    pub fn refuse(&mut self, worker: &str, why: Why) {
        self.job.faults.refusals += 1;
        let (n, max) = (
            self.job.faults.refusals,
            self.job.spec.faults.max_step_attempts,
        );
        let detail = why.detail.clone();
        self.lose_member(worker, why);
        if n >= max && !self.job.rec.state.is_terminal() {
            let why = Why::new(
                AbortReason::TooManyAttempts,
                format!(
                    "{n} answers in a row were refused without any work completing (faults.max_step_attempts = {max}); the last: {detail}"
                ),
            );
            self.finish(End::Failed(why));
        }
    }

    /// Work completed: the refusals in a row start over.
    pub fn progressed(&mut self) {
        self.job.faults.refusals = 0;
    }

    /// [`Self::lose_member`] for a plain loss (`why` says how).
    pub fn lose_member_for(&mut self, worker: &str, why: &str) {
        let why = Why::new(
            AbortReason::WorkerLost,
            format!("worker {worker} lost: {why}"),
        );
        self.lose_member(worker, why);
    }

    /// Ends the job's generation: aborts its in-flight step (the cursor has
    /// not moved, so the same documents are re-planned) and frees its
    /// members. With `disk_only` the next generation must restore from disk.
    pub fn end_generation(&mut self, why: Why, disk_only: bool) {
        let waiting = Phase::Waiting {
            rejoin_until_ms: None,
            disk_only,
        };
        let Phase::Active(active) = std::mem::replace(&mut self.job.phase, waiting) else {
            return;
        };
        let gen = active.gen;
        // A disk-only generation that never became ready passes the
        // restriction on.
        if gen.disk_only && !gen.all_ready() {
            self.job.phase = Phase::Waiting {
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
            let Some(w) = self.workers.get(m).filter(|w| w.state != WorkerState::Lost) else {
                continue;
            };
            let draining = w.draining;
            if let Some(step) = aborted.filter(|_| i < trainers) {
                self.fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Abort {
                        job: self.id.clone(),
                        generation: gen.id,
                        step,
                        why: why.clone(),
                    },
                });
            }
            if draining {
                // Its boundary will not come in this generation and a
                // drained worker joins no other: it leaves now.
                self.fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: self.id.clone(),
                        reason: "drained".into(),
                    },
                });
            }
            self.workers.release(m);
        }
        if aborted.is_some() {
            self.job.faults.last_abort = why.detail.clone();
        }
        let rec = &mut self.job.rec;
        if !rec.state.is_terminal() && rec.state != JobState::Paused {
            rec.state = JobState::Pending;
            rec.reason = why.detail.clone();
        }
        self.persist_job();
        let message = match aborted {
            Some(step) => format!("generation {} ended, step {step} aborted: {why}", gen.id),
            None => format!("generation {} ended: {why}", gen.id),
        };
        let e = self.job.event_ending(
            EventKind::Generation,
            message,
            Some(why.reason),
            aborted,
            self.now,
        );
        self.fx.push(e);
    }

    /// Ends the job: the step in flight is aborted, the members released.
    pub fn finish(&mut self, end: End) {
        let why = end.why();
        let reason = why.detail.clone();
        let mut aborted_step = None;
        if let Phase::Active(active) = std::mem::replace(&mut self.job.phase, Phase::Ended) {
            let gen = active.gen;
            if let Work::InFlight(flight) = &active.work {
                aborted_step = Some(flight.planned.step);
                for m in &gen.members {
                    self.fx.push(Effect::Send {
                        worker: m.clone(),
                        msg: ToWorker::Abort {
                            job: self.id.clone(),
                            generation: gen.id,
                            step: flight.planned.step,
                            why: why.clone(),
                        },
                    });
                }
            }
            for m in gen.everyone() {
                self.fx.push(Effect::Send {
                    worker: m.clone(),
                    msg: ToWorker::Release {
                        job: self.id.clone(),
                        reason: reason.clone(),
                    },
                });
                self.workers.release(m);
            }
        }
        self.job.rec.state = end.state();
        self.job.rec.reason = reason.clone();
        info!(job = %self.id, state = %self.job.rec.state.name(), reason, "job finished");
        self.persist_job();
        let ended = (!matches!(end, End::Completed(_))).then_some(why.reason);
        let e = self
            .job
            .event_ending(EventKind::State, reason, ended, aborted_step, self.now);
        self.fx.push(e);
    }

    /// The store refused the job's writes: the job ends here, in memory
    /// only. Nothing is written (the store is what failed; its last durable
    /// state is what a restarted coordinator resumes the job from), and its
    /// members are released.
    pub fn persist_failed(&mut self, error: &str) {
        if self.job.rec.state.is_terminal() {
            return;
        }
        let why = Why::new(
            AbortReason::OutputFailed,
            format!(
                "the coordinator's store refused the job's state ({error}); a restarted coordinator resumes it from its last durable step"
            ),
        );
        let mut ended = Effects::default();
        let mut cx = JobCtx {
            id: self.id.clone(),
            job: &mut *self.job,
            workers: &mut *self.workers,
            opts: self.opts,
            now: self.now,
            fx: &mut ended,
        };
        cx.finish(End::Failed(why));
        let (_unwritable, then) = ended.into_parts();
        for e in then {
            self.fx.push(e);
        }
    }

    /// Ends the job as failed (`reason` says why).
    pub fn fail(&mut self, reason: AbortReason, detail: impl Into<String>) {
        self.finish(End::Failed(Why::new(reason, detail)));
    }
}
