//! The RL loop's handlers (issue 17; the pure part is `super::rounds`):
//! plan a generation round when a generating job's queue lacks its next
//! step, gather the ranks' completions, hand the round to the shell for
//! scoring, and admit the scored rollouts into the job's stream with the
//! round's prompts consumed in the same write.

use std::sync::Arc;

use tracing::{debug, info, warn};

use super::engine::tick::hand_to_scorer;
use super::episode::{EnvReply, EpisodesToStep};
use super::generation::GenCompletion;
use super::rounds::{LoopInputs, Round, RoundKind, RoundStats, WaveNext, MAX_BARREN_GROUPS};
use super::stream::Admission;
use crate::core::ctx::JobCtx;
use crate::core::effects::{Effect, Persist, ToWorker, WatchItem};
use crate::core::error::{CoreError, Result};
use crate::core::phase::Work;
use crate::core::types::{AbortReason, End, Why};
use crate::stream::doc::Rollout;

impl JobCtx<'_> {
    /// The shell loaded a generating job's prompts.
    pub(crate) fn load_prompts(&mut self, inputs: LoopInputs) -> Result<()> {
        let job = &mut *self.job;
        let Some(l) = job.data.rollout_loop.as_mut() else {
            return Err(CoreError::NotStreamed(self.id.clone()));
        };
        info!(
            job = %self.id,
            prompts = inputs.prompts.len(),
            "prompts loaded"
        );
        l.load(inputs);
        Ok(())
    }

    /// Plans a round for an idle generating job whose queue lacks `need`
    /// rollouts; false when it cannot (prompts not loaded, or a round is
    /// being scored: the job waits).
    pub(crate) fn plan_round(&mut self, need: u64) -> bool {
        let job = &mut *self.job;
        let Some(gen) = job.gen() else {
            return false;
        };
        let (gen_id, world) = (gen.id, gen.world_size());
        let sampling = job.spec.rl.sampling.clone().unwrap_or_default();
        let per_round = job.spec.rl.prompts_per_round;
        let (Some(l), Some(s)) = (job.data.rollout_loop.as_mut(), job.data.stream.as_ref()) else {
            return false;
        };
        if l.scoring.is_some() {
            job.rec.reason = "scoring generated rollouts".into();
            return false;
        }
        let group = s.group_size;
        let missing = need.saturating_sub(s.queued_rollouts());
        let prompts = per_round.unwrap_or_else(|| missing.div_ceil(u64::from(group)));
        let planned = l.plan_round(
            s.prompts_done,
            prompts,
            group,
            world,
            gen_id,
            job.rec.step,
            &sampling,
            self.now,
        );
        let Some((round, plans)) = planned else {
            job.rec.reason = "waiting for the prompts to load".into();
            return false;
        };
        self.send_round(round, plans);
        true
    }

    /// Whether the job's eval prompts are due at its committed step:
    /// before the first step, after the last, and every `rl.eval_every`.
    pub(crate) fn eval_due(&self) -> bool {
        let job = &*self.job;
        let Some(l) = job.data.rollout_loop.as_ref() else {
            return false;
        };
        let has = l.inputs().is_some_and(|i| i.eval.is_some());
        let step = job.rec.step;
        let every = job.spec.rl.eval_every;
        let at = step == 0 || job.finished() || every.is_some_and(|e| step.is_multiple_of(e));
        has && at && l.evaluated != Some(step) && !job.replaying()
    }

    /// Plans a greedy round over the job's eval prompts.
    pub(crate) fn plan_eval(&mut self) -> bool {
        let job = &mut *self.job;
        let Some(gen) = job.gen() else {
            return false;
        };
        let (gen_id, world) = (gen.id, gen.world_size());
        let sampling = job.spec.rl.sampling.clone().unwrap_or_default();
        let Some(l) = job.data.rollout_loop.as_mut() else {
            return false;
        };
        let Some((round, plans)) =
            l.plan_eval_round(world, gen_id, job.rec.step, &sampling, self.now)
        else {
            return false;
        };
        self.send_round(round, plans);
        true
    }

    /// Sends each rank its plan of `round`, which the generation is then
    /// busy with.
    pub(crate) fn send_round(
        &mut self,
        round: super::rounds::Round,
        plans: Vec<super::rounds::RoundPlan>,
    ) {
        let job = &mut *self.job;
        info!(
            job = %self.id,
            round = round.id,
            kind = ?round.kind,
            prompts = round.positions.end - round.positions.start,
            from = round.positions.start,
            policy = round.policy_version,
            "generation round planned"
        );
        job.rec.reason = format!("generating round {}", round.id);
        self.send_to_members(Box::new(round), plans);
    }

    /// Sends each member (in rank order) its plan of `round`, which the
    /// generation is then busy with.
    fn send_to_members(&mut self, round: Box<Round>, plans: Vec<super::rounds::RoundPlan>) {
        let active = self.job.active_mut().expect("a round within a generation");
        for (rank, (m, plan)) in active.gen.members.iter().zip(plans).enumerate() {
            self.fx.push(Effect::Send {
                worker: m.clone(),
                msg: ToWorker::Generate {
                    job: self.id.clone(),
                    generation: round.generation,
                    rank: rank as u32,
                    plan: Arc::new(plan),
                },
            });
        }
        active.work = Work::Generating(round);
    }

    /// One rank's completions; once every rank answered, the round goes to
    /// the shell for scoring and the generation is idle again. A result
    /// for another generation or round is ignored; one that does not
    /// answer its plan drops the worker (its round is planned again).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_generated(
        &mut self,
        worker: &str,
        generation: u64,
        round: u64,
        answer: (Vec<GenCompletion>, f64),
    ) {
        let job = &mut *self.job;
        let Some(active) = job.active_mut() else {
            return;
        };
        // A disaggregated generation's generators answer the engine round.
        if let Some(g) = active
            .gen
            .generators
            .rank_of(worker)
            .filter(|_| active.gen.id == generation)
        {
            self.on_generator_answer(worker, g, generation, round, answer);
            return;
        }
        let rank = active.gen.rank_of(worker);
        let Work::Generating(r) = &mut active.work else {
            warn!(
                worker,
                job = %self.id,
                round,
                "completions for no round, ignored"
            );
            return;
        };
        // (A multi-turn round with no wave out has every answer of its
        // last wave: another is a repeat.)
        let Some(rank) = rank.filter(|_| r.is(generation, round)) else {
            return self.stale_answer(worker, generation, round);
        };
        let Work::Generating(mut r) = std::mem::replace(&mut active.work, Work::Idle) else {
            unreachable!("matched above")
        };
        if !self.take_answer(&mut r, "worker", (worker, rank), answer) {
            // Not whole yet (or its worker was dropped: the generation
            // ended, and the round is planned again with the next).
            if let Some(a) = self.job.active_mut() {
                a.work = Work::Generating(r);
            }
            return;
        }
        self.round_answered(r);
    }

    /// A round every rank answered: a multi-turn round's wave goes to
    /// the environments (`Effect::StepEpisodes`) and the round moves on;
    /// any other round to the scorer.
    fn round_answered(&mut self, mut r: Box<Round>) {
        if r.kind == RoundKind::Serve {
            return self.serve_round_answered(*r);
        }
        if let Some(step) = r.end_wave(&self.id) {
            self.step_episodes(step);
        }
        self.move_round(r);
    }

    /// The workers' round with no wave out: the next wave when episodes
    /// are ready, the scorer when all ended, else it waits for their
    /// environments (the generation stays busy with it: no step runs
    /// between the turns of a round's episodes).
    fn move_round(&mut self, mut r: Box<Round>) {
        match r.after_wave() {
            WaveNext::Wave => {
                let world = self.job.gen().map_or(1, |g| g.world_size());
                let sampling = self.job.spec.rl.sampling.clone().unwrap_or_default();
                let l = self
                    .job
                    .data
                    .rollout_loop
                    .as_mut()
                    .expect("a generating job");
                let plans = l.plan_wave(&mut r, world, &sampling, self.now);
                self.send_wave(r, plans);
            }
            WaveNext::Wait => {
                if let Some(a) = self.job.active_mut() {
                    a.work = Work::Generating(r);
                }
            }
            WaveNext::Score => {
                let job = &mut *self.job;
                let l = job.data.rollout_loop.as_mut().expect("a generating job");
                hand_to_scorer(&self.id, &mut job.rec.reason, l, *r, self.fx);
            }
        }
    }

    /// Sends each rank its part of a multi-turn round's next wave.
    fn send_wave(&mut self, r: Box<Round>, plans: Vec<super::rounds::RoundPlan>) {
        let job = &mut *self.job;
        let episodes: usize = r.asked.iter().map(Vec::len).sum();
        debug!(job = %self.id, round = r.id, episodes, "wave of episodes sent");
        job.rec.reason = format!("generating round {} ({episodes} episodes' turns)", r.id);
        self.send_to_members(r, plans);
    }

    /// Asks the shell to step a turn's environments.
    pub(crate) fn step_episodes(&mut self, step: EpisodesToStep) {
        self.job.rec.reason = format!(
            "round {}: stepping {} episodes' environments",
            step.round,
            step.episodes.len()
        );
        self.fx.push(Effect::StepEpisodes(Box::new(step)));
    }

    /// The shell stepped the environments of some of round `round`'s
    /// episodes (on the workers' round, or the generators'): those that
    /// go on are ready for the next wave, which leaves at once when no
    /// wave is out; the round is scored once every episode ended. Replies
    /// for any other round (one forgotten with its generation) are
    /// ignored; one that does not fit, or an environment that failed,
    /// fails the job.
    pub(crate) fn on_episodes_stepped(
        &mut self,
        round: u64,
        result: std::result::Result<Vec<EnvReply>, String>,
    ) {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() {
            return;
        }
        let ours = |r: &Round| r.episodes.as_ref().is_some_and(|e| e.origin == round);
        let on_workers =
            matches!(job.active().map(|a| &a.work), Some(Work::Generating(r)) if ours(r));
        let taken = if on_workers {
            let a = job.active_mut().expect("matched above");
            match std::mem::replace(&mut a.work, Work::Idle) {
                Work::Generating(r) => Some(r),
                _ => unreachable!("matched above"),
            }
        } else {
            job.data
                .engine_mut()
                .and_then(|e| e.round.take_if(|r| ours(r)))
        };
        let Some(mut r) = taken else {
            warn!(job = %self.id, round, "environment replies for no round being stepped, ignored");
            return;
        };
        let eps = r.episodes.as_mut().expect("matched above");
        let applied = result.and_then(|replies| eps.apply(replies).map_err(|e| e.to_string()));
        if let Err(error) = applied {
            let why = Why::new(
                AbortReason::JobFailed,
                format!("generation round {round}: environment: {error}"),
            );
            self.finish(End::Failed(why));
            return;
        }
        if on_workers {
            self.move_round(r);
        } else {
            self.move_generators_round(r);
        }
    }

    /// The shell scored round `round`: its rollouts join the stream and
    /// its prompts are consumed, in one write. Any other round is stale
    /// (already admitted, or of a job that restarted) and ignored.
    pub(crate) fn on_scored(
        &mut self,
        round: u64,
        rollouts: Vec<Rollout>,
        stats: RoundStats,
    ) -> Result<()> {
        let job = &mut *self.job;
        let pg = job.spec.objective.pg();
        let next = job.rec.step + 1;
        let need = job.settings().rollouts_needed(next);
        let (step, max_staleness) = (job.rec.step, job.spec.rl.max_staleness);
        let (Some(l), Some(s), Some(plan), Some(pg)) = (
            job.data.rollout_loop.as_mut(),
            job.data.stream.as_mut(),
            job.data.rollouts.as_mut(),
            pg,
        ) else {
            return Err(CoreError::NotStreamed(self.id.clone()));
        };
        let (prompts_done, kind) = match l.scoring {
            Some(sc) if sc.round == round && !job.rec.state.is_terminal() => {
                (sc.prompts_end, sc.kind)
            }
            _ => {
                warn!(
                    job = %self.id,
                    round, "scored round is not the one being scored, ignored"
                );
                return Ok(());
            }
        };
        l.scoring = None;
        job.rec.reason.clear();
        if kind == RoundKind::Eval {
            l.evaluated = Some(step);
            let metrics = crate::core::eval::EvalMetrics {
                step,
                loss: 0.0,
                loss_tokens: 0,
                tokens: stats.completion_tokens,
                docs: stats.completions,
                extra: stats.metrics(),
                sources: Default::default(),
                unix_ms: self.now,
            };
            info!(job = %self.id, step, accuracy = ?metrics.extra.get("rl/accuracy"), "eval prompts answered");
            self.fx.push(Effect::AppendEval {
                job: self.id.clone(),
                path: job.spec.job.output_dir.join("metrics.jsonl"),
                eval: Box::new(metrics.clone()),
            });
            self.fx.push(Effect::Publish {
                job: self.id.clone(),
                item: WatchItem::Eval(metrics),
            });
            return Ok(());
        }
        // An engine round that went stale while scored is not admitted:
        // its prompts stay unconsumed and are planned again.
        let engine = job.spec.rl.generates_apart();
        if let Some(r) = rollouts.iter().find(|r| {
            engine && crate::rl::pg::admit(r.policy_version, step, max_staleness).is_err()
        }) {
            warn!(
                job = %self.id,
                round,
                policy = r.policy_version,
                step,
                "engine round too stale to admit: its prompts are planned again"
            );
            return Ok(());
        }
        let at = Admission {
            job: self.id.as_str(),
            pg: &pg,
            step,
            max_staleness,
            need,
        };
        let queued = s.queued_rollouts();
        let write = s.push_generated(plan, at, rollouts, prompts_done);
        let flat = write.counts.as_ref().map_or(0, |c| c.zero_variance_groups);
        if s.queued_rollouts() > queued {
            l.barren = (0, 0);
        } else if flat > 0 {
            l.barren = (l.barren.0 + flat, l.barren.1 + 1);
        }
        let (groups, rounds) = l.barren;
        job.data.loop_stats.add(&stats);
        self.fx.persist(Persist::Rollouts(Box::new(write)));
        if groups >= MAX_BARREN_GROUPS {
            let why = Why::new(
                AbortReason::JobFailed,
                format!(
                    "no learning signal: {groups} groups in a row ({rounds} generation rounds) had equal rewards (zero variance: dropped, none admitted; last round's mean reward {:.3}): the policy is always right or always wrong on these prompts (check the verifier and the references, rl.sampling.temperature, or the starting checkpoint)",
                    stats.reward_sum / stats.completions.max(1) as f64
                ),
            );
            warn!(
                job = %self.id,
                groups, rounds, "no group admitted, failing the job"
            );
            self.finish(End::Failed(why));
        }
        Ok(())
    }

    /// The shell could not score round `round`: the job fails with why.
    pub(crate) fn on_score_failed(&mut self, round: u64, error: String) {
        let job = &*self.job;
        let ours = job
            .data
            .rollout_loop
            .as_ref()
            .is_some_and(|l| l.scoring.is_some_and(|s| s.round == round));
        if !ours || job.rec.state.is_terminal() {
            return;
        }
        let why = Why::new(
            AbortReason::JobFailed,
            format!("scoring generation round {round} failed: {error}"),
        );
        self.finish(End::Failed(why));
    }
}
