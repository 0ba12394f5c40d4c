//! A job as the coordinator tracks it: its persisted record, its spec, its
//! data, its [`Phase`], and its live parts (operator requests at the next
//! boundary, the acknowledgements it waits for, its fault history, the
//! step planned ahead), rebuilt after a restart.

use std::path::PathBuf;
use std::sync::Arc;

use super::acks::Acks;
use super::bisect::Bisection;
use super::deadline::Pace;
use super::effects::{Effect, Effects, ToWorker, WatchItem};
use super::eval::EvalRun;
use super::generation::Generation;
use super::job_data::{JobData, HISTORY_WINDOW};
use super::phase::{Active, InFlight, Phase, Work};
use super::record::JobRecord;
use super::step::PlannedStep;
use super::types::{AbortReason, EventKind, PlanKind, WorkerId};
use crate::job::settings::Settings;
use crate::job::spec::JobSpec;
use crate::stream::cursor::Order;

/// Who acknowledges a checkpoint's tokenizer files (the coordinator's
/// shell, with `Event::TokenizerWritten`, beside the members'
/// `CheckpointDone`): a worker id that registration refuses.
pub const TOKENIZER_FILES: &str = "coordinator/tokenizer-files";

/// A job with its live state.
#[derive(Debug, Clone)]
pub struct Job {
    pub rec: JobRecord,
    pub spec: Arc<JobSpec>,
    pub data: JobData,
    pub phase: Phase,
    /// Operator requests for the next step boundary.
    pub requests: BoundaryRequests,
    /// What the job waits for its members to acknowledge.
    pub acks: JobAcks,
    /// Its failures so far and what they decide (live only).
    pub faults: Faults,
    /// The last plan dispatched: (generation, step, kind), so that a result
    /// arriving after its generation ended still tells what the worker holds.
    pub last_plan: Option<(u64, u64, PlanKind)>,
    /// An evaluation owed or under way (live only: lost with the
    /// coordinator, never needed for correctness).
    pub eval_run: Option<EvalRun>,
    /// The next step, planned while the current one runs (see `ahead`).
    pub ahead: PlannedAhead,
}

/// Operator requests that take effect at the next step boundary. They
/// outlive a generation that ends before the boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoundaryRequests {
    pub pause: bool,
    pub checkpoint: bool,
}

/// The acknowledgements a job waits for, by step.
#[derive(Debug, Clone, Default)]
pub struct JobAcks {
    /// Checkpoints being written (asynchronously; training goes on): the
    /// members asked to write each that have not reported it durable. It
    /// counts once all have.
    pub checkpoints: Acks<u64>,
    /// Published policies (`rl.publish_every`): members yet to answer.
    /// By (generation, step): a late answer to an older generation's
    /// request is not counted for a newer one's.
    pub policies: Acks<(u64, u64)>,
}

/// Relay link failures after which a job's messages go directly.
pub const RELAY_FAILURES_BEFORE_DIRECT: u32 = 2;

/// A job's failures so far (live only: a restarted coordinator starts
/// them over).
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The last training step dispatched and how many times it was
    /// (1 + aborts before commit).
    pub attempts: (u64, u32),
    /// Why the last aborted attempt ended.
    pub last_abort: String,
    /// The last failed restore, as its worker told it: when no source of
    /// state is left, the job's failure names this cause.
    pub last_restore_failure: Option<String>,
    /// Generations in a row that failed to restore their state (reset
    /// when one is ready): a source that keeps failing ends the job at
    /// `faults.max_step_attempts` instead of being retried forever.
    pub restore_failures: u32,
    /// Answers refused in a row (a result, gathered results, a round's
    /// completions or a weight sync that do not fit what was asked), reset
    /// when any work completes. Each refusal drops its worker and plans the
    /// work again; a worker that keeps answering wrongly (confused or
    /// hostile) would otherwise loop the job for ever, for every kind of
    /// work: at `faults.max_step_attempts` the job fails.
    pub refusals: u32,
    /// Relay links that failed (issue 33 (6)): at
    /// [`RELAY_FAILURES_BEFORE_DIRECT`] the job's generations stop relaying
    /// and every message goes on its worker's own session.
    pub relay_failures: u32,
    /// How fast its plans ran: the step deadline's basis.
    pub pace: Pace,
    /// A non-finite step's documents being bisected.
    pub bisection: Option<Bisection>,
}

/// The step planned while the current one runs, and how many went out so.
#[derive(Debug, Clone, Default)]
pub struct PlannedAhead {
    /// The next step, if planned (see `ahead`) ...
    pub next: Option<super::ahead::Ahead>,
    /// ... and how many steps went out so planned (the others were planned
    /// at dispatch: the first, and any after a change).
    pub sent: u64,
}

impl Job {
    pub fn new(rec: JobRecord, spec: Arc<JobSpec>, data: JobData) -> Self {
        let phase = if rec.state.is_terminal() {
            Phase::Ended
        } else {
            Phase::Waiting {
                rejoin_until_ms: None,
                disk_only: false,
            }
        };
        Self {
            rec,
            spec,
            data,
            phase,
            requests: BoundaryRequests::default(),
            acks: JobAcks::default(),
            faults: Faults::default(),
            last_plan: None,
            eval_run: None,
            ahead: PlannedAhead::default(),
        }
    }

    /// The settings of the job's steps (spec plus live changes).
    pub fn settings(&self) -> Settings<'_> {
        Settings::new(&self.spec, &self.rec.changes)
    }

    /// How step `step` is served: the job's order with the mixture's
    /// weights in force at that step.
    pub fn order_at(&self, step: u64) -> Order {
        let base = &self.data.order;
        if base.mix.is_empty() {
            return base.clone();
        }
        let (weights, rev) = self.settings().weights_at(step, &self.data.sources);
        if rev == 0 {
            return base.clone();
        }
        base.with_weights(weights, rev)
    }

    /// The current generation and its work, if one is formed.
    pub fn active(&self) -> Option<&Active> {
        match &self.phase {
            Phase::Active(a) => Some(a),
            _ => None,
        }
    }

    pub fn active_mut(&mut self) -> Option<&mut Active> {
        match &mut self.phase {
            Phase::Active(a) => Some(a),
            _ => None,
        }
    }

    /// The current generation, if one is formed.
    pub fn gen(&self) -> Option<&Generation> {
        self.active().map(|a| &a.gen)
    }

    /// The step in flight, if any.
    pub fn inflight(&self) -> Option<&InFlight> {
        match self.active().map(|a| &a.work) {
            Some(Work::InFlight(f)) => Some(f),
            _ => None,
        }
    }

    /// Whether the next generation must restore from disk (a state sync
    /// failed, and no generation has become ready since).
    pub fn restore_required(&self) -> bool {
        match &self.phase {
            Phase::Waiting { disk_only, .. } => *disk_only,
            Phase::Active(a) => a.gen.disk_only && !a.gen.all_ready(),
            Phase::Ended => false,
        }
    }

    /// True while the generation re-runs committed steps after a restore.
    pub fn replaying(&self) -> bool {
        self.gen().is_some_and(|g| g.step < self.rec.step)
    }

    /// Where the checkpoint of `step` is written.
    pub fn checkpoint_dir(&self, step: u64) -> PathBuf {
        self.spec
            .job
            .output_dir
            .join("checkpoints")
            .join(format!("step-{step}"))
    }

    /// Whether the committed step's state is on disk (a checkpoint of it,
    /// or nothing trained yet).
    pub fn step_durable(&self) -> bool {
        self.rec.step == 0 || self.rec.checkpoints.iter().any(|c| c.step == self.rec.step)
    }

    /// The first step of the replay history kept in memory: the newest
    /// `HISTORY_WINDOW` committed steps after `rec.history_from` (older
    /// ones are read back from the store when a replay reaches them).
    pub fn history_window_start(rec: &JobRecord) -> u64 {
        rec.history_from
            .max(rec.step.saturating_sub(HISTORY_WINDOW))
            + 1
    }

    /// Drops from memory the replay history below the window (the store
    /// holds it), except steps from `keep` on (a replay in progress); the
    /// window starts after `rec.history_from`, so nothing at or below it
    /// (no longer replayable) stays either.
    pub fn trim_history(&mut self, keep: Option<u64>) {
        let start = Job::history_window_start(&self.rec);
        let cut = keep.map_or(start, |k| k.min(start));
        let h = &mut self.data.history;
        *h = h.split_off(&cut);
        self.data.history_stored_through = self.data.history_stored_through.max(start - 1);
    }

    /// True when the job has trained all it was asked to.
    pub fn finished(&self) -> bool {
        match self.spec.job.steps {
            Some(steps) => self.rec.step >= steps,
            // A stream without job.steps runs until cancelled.
            None if self.data.stream.is_some() => false,
            None => self.data.order.exhausted(&self.rec.cursor),
        }
    }

    /// The first step a change made now applies to.
    pub fn next_new_step(&self) -> u64 {
        self.rec.step.max(self.faults.attempts.0) + 1
    }

    /// Counts a dispatch of a training step (a re-dispatch after an abort
    /// is another attempt of the same step).
    pub fn note_dispatch(&mut self, p: &PlannedStep) {
        if p.kind != PlanKind::Train {
            return;
        }
        self.faults.attempts = match self.faults.attempts {
            (s, n) if s == p.step => (s, n + 1),
            _ => (p.step, 1),
        };
    }

    /// The time by which the step in flight must have every result.
    pub fn step_deadline_ms(&self) -> Option<i64> {
        let f = self.inflight()?;
        let tokens = f.planned.busiest_rank_tokens();
        let timeout = self
            .faults
            .pace
            .deadline_ms(self.spec.faults.step_timeout_s, tokens);
        Some(f.started_ms.saturating_add(timeout))
    }

    /// The generation round in flight on the job's workers (the RL loop),
    /// if any: the training ranks' (colocated, or eval prompts), else the
    /// generators' (disaggregated).
    pub fn round(&self) -> Option<&crate::rl::rounds::Round> {
        self.round_on().map(|(r, _)| r)
    }

    /// [`Self::round`] and the workers it was dealt to, by rank.
    pub fn round_on(&self) -> Option<(&crate::rl::rounds::Round, &[WorkerId])> {
        let a = self.active()?;
        if let Work::Generating(r) = &a.work {
            return Some((r, &a.gen.members));
        }
        if a.gen.generators.is_empty() {
            return None;
        }
        let e = self.data.rollout_loop.as_ref()?.engine.as_ref()?;
        let r = e.round.as_deref()?;
        Some((r, &a.gen.generators.members))
    }

    /// When the round in flight is overdue: after `faults.step_timeout_s`,
    /// else the deadline floor (a round's pace is not learned: its length
    /// depends on what the policy samples).
    pub fn round_deadline_ms(&self) -> Option<i64> {
        let r = self.round().filter(|r| r.out())?;
        let timeout = match self.spec.faults.step_timeout_s {
            Some(s) => (s * 1000.0).ceil() as i64,
            None => super::deadline::FLOOR_MS as i64,
        };
        Some(r.started_ms.saturating_add(timeout))
    }

    /// Times step `step` was dispatched so far (at least 1).
    pub fn attempts_of(&self, step: u64) -> u32 {
        if self.faults.attempts.0 == step {
            self.faults.attempts.1
        } else {
            1
        }
    }

    /// A watch event about this job, in its current state.
    pub fn event(&self, kind: EventKind, message: String, now_ms: i64) -> Effect {
        self.event_ending(kind, message, None, None, now_ms)
    }

    /// A watch event that ends something (a generation, the job): why, and
    /// which step in flight it abandoned.
    pub fn event_ending(
        &self,
        kind: EventKind,
        message: String,
        reason: Option<AbortReason>,
        aborted_step: Option<u64>,
        now_ms: i64,
    ) -> Effect {
        Effect::Publish {
            job: self.rec.id.clone(),
            item: WatchItem::Event {
                kind,
                message,
                state: self.rec.state,
                unix_ms: now_ms,
                reason,
                aborted_step,
            },
        }
    }

    /// Asks every member to write the committed step's checkpoint (once
    /// per step). Mid-replay the members do not hold the committed step
    /// yet: the checkpoint is taken at the next commit instead.
    pub fn request_checkpoint(&mut self, fx: &mut Effects) {
        let Some(gen) = self.gen() else { return };
        if gen.step < self.rec.step {
            self.requests.checkpoint = true;
            return;
        }
        let step = self.rec.step;
        if self.acks.checkpoints.waits_for(&step)
            || self.rec.checkpoints.iter().any(|c| c.step == step)
        {
            return;
        }
        let dir = self.checkpoint_dir(step);
        // The workers write weights and optimizer state; the coordinator,
        // which owns the tokenizer, its files.
        fx.push(Effect::WriteTokenizer {
            job: self.rec.id.clone(),
            dir: dir.clone(),
            step: Some(step),
        });
        for m in &gen.members {
            fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Checkpoint {
                    job: self.rec.id.clone(),
                    step,
                    dir: dir.clone(),
                    cursor: self.rec.cursor.clone(),
                },
            });
        }
        // The checkpoint is durable once every member wrote its part and
        // the coordinator its tokenizer files (acknowledged apart: a job
        // must not complete before a tokenizer write that then fails).
        let mut writers = gen.members.clone();
        writers.push(TOKENIZER_FILES.to_string());
        self.acks.checkpoints.expect(step, writers);
    }
}
