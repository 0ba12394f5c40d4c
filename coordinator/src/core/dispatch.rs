//! Sending a job's next plan: what comes next (a step from the files, a
//! streamed queue, a replay, the reference pass, an eval chunk, a probe)
//! is the planner's; here it is taken (or the step planned ahead while the
//! last one ran), bounded by `faults.max_step_attempts`, and sent.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::ctx::JobCtx;
use super::effects::{Effect, ToWorker};
use super::phase::{InFlight, Phase, Work};
use super::planner::{self, Source};
use super::step::PlannedStep;
use super::types::{AbortReason, End, JobState, PlanKind, Why};

impl JobCtx<'_> {
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

    pub(crate) fn dispatch(&mut self) {
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
        // Plans are for the data-parallel world: each context-parallel
        // group takes one plan rank's microbatches (`send_plan`).
        let world = job.spec.parallel.data_parallel(
            job.gen()
                .expect("dispatch within a generation")
                .world_size(),
        );
        let next = job.rec.step + 1;
        let planned = match planner::next_source(job) {
            Ok(Source::Stream) => {
                // A streamed job waits until its queue holds a whole step.
                let s = job.data.stream.as_ref().expect("a streamed job");
                let need = job.settings().rollouts_needed(next);
                if let Some(reason) = s.waiting_reason(need) {
                    // The RL loop makes the rollouts itself.
                    // (An external engine's rounds are planned apart.)
                    let generating =
                        job.data.rollout_loop.is_some() && !job.spec.rl.generates_apart();
                    job.rec.reason = reason;
                    if generating {
                        self.plan_round(need);
                    }
                    // A served job's endpoint calls run while no step is
                    // due (a step due goes first: calls wait one step).
                    self.plan_serve_round();
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
            job.spec.parallel.data_parallel(active.gen.world_size()),
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

    pub(crate) fn send_plan(&mut self, planned: Arc<PlannedStep>) {
        let job = &mut *self.job;
        let context = job.spec.parallel.context.max(1);
        let active = job.active_mut().expect("dispatch within a generation");
        let gen = &active.gen;
        for (rank, m) in gen.members.iter().enumerate() {
            self.fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Plan {
                    job: self.id.clone(),
                    generation: gen.id,
                    rank: rank as u32,
                    group: rank as u32 / context,
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
}
