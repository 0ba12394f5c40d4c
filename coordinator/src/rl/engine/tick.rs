//! The RL loop on an external engine (`rl.engine`, issue 17 item 6): the
//! same rounds as `crate::rl::rollout_loop` plans for the workers, sent to the
//! shell (`Effect::EngineGenerate`) instead, so generation runs on an
//! inference server while the workers train.
//!
//! One thing at a time per engine: a round, or a reload of the newest
//! published policy (`Effect::EngineReload`), so each round's completions
//! come from the version it is tagged with. The engine's version is known
//! only from a reload that succeeded; until then (at submit and after a
//! restart), and when its policy is too old with no newer one coming (a
//! publication lost with a worker), the workers publish the current
//! weights for it to load.
//!
//! Staleness: a round is planned only when its rollouts can still be
//! admitted when they arrive: the committed step, plus the step in flight
//! that may commit meanwhile, is at most `rl.max_staleness` past the
//! engine's version. A round is planned only while the queue lacks the
//! step after the one in flight, so no more steps can commit before it is
//! admitted. Should one still arrive too stale, it is dropped unadmitted
//! and its prompts are planned again (`on_scored`): they are consumed only
//! with admitted rollouts, as for worker rounds.
//!
//! Disaggregated generation (`rl.generators`) is the same loop with the
//! job's own generator workers as the engine: a round is dealt to them as
//! `GeneratePlan`s, "publish" is a snapshot of the policy that trainer
//! rank 0 keeps in memory, and "reload" is a weight sync (`SyncWeights`):
//! trainer rank 0 broadcasts the snapshot over the weight ring and every
//! generator answers `WeightsSynced`. A generation that loses any worker
//! re-forms; its generators start with no known policy again.

use std::sync::Arc;

use tracing::{info, warn};

use crate::core::ctx::JobCtx;
use crate::core::effects::{Effect, Effects, ToWorker};
use crate::core::job::Job;
use crate::core::phase::Work;
use crate::core::publish::{self, policy_dir};
use crate::core::types::{AbortReason, End, EventKind, JobState, PlanKind, Why};
use crate::rl::generation::GenCompletion;
use crate::rl::rounds::{EngineRound, LoopState, Round, RoundPlan, Scoring, WaveNext};

/// Hands an answered round to the shell for scoring.
pub(crate) fn hand_to_scorer(
    job_id: &str,
    reason: &mut String,
    l: &mut LoopState,
    r: Round,
    fx: &mut Effects,
) {
    l.scoring = Some(Scoring {
        round: r.id,
        kind: r.kind,
        prompts_end: r.positions.end,
    });
    let to_score = r.into_score(job_id, l);
    *reason = format!("scoring round {}", to_score.round);
    fx.push(Effect::ScoreRound(Box::new(to_score)));
}

/// Sends each generator (in rank order) its plan of a round or turn.
fn send_plans(
    job: &str,
    fx: &mut Effects,
    generation: u64,
    generators: &[String],
    plans: Vec<RoundPlan>,
) {
    for (rank, (w, plan)) in generators.iter().zip(plans).enumerate() {
        fx.push(Effect::Send {
            worker: w.clone(),
            msg: ToWorker::Generate {
                job: job.to_string(),
                generation,
                rank: rank as u32,
                plan: Arc::new(plan),
            },
        });
    }
}

impl JobCtx<'_> {
    /// Takes rank `rank`'s answer to `round`: true once every rank
    /// answered. A worker whose answer does not fit its plan (`who` says
    /// what it is) is dropped, and its round planned again.
    pub(crate) fn take_answer(
        &mut self,
        round: &mut Round,
        who: &str,
        (worker, rank): (&str, u32),
        (completions, seconds): (Vec<GenCompletion>, f64),
    ) -> bool {
        match round.answer(rank, completions, seconds) {
            Ok(done) => {
                if done {
                    self.progressed();
                }
                done
            }
            Err(e) => {
                let detail = format!(
                    "{who} {worker} (rank {rank}) answered generation round {} wrongly: {e}",
                    round.id
                );
                self.refuse(worker, Why::new(AbortReason::WorkerError, detail));
                false
            }
        }
    }

    /// An answer to a round that is not the job's current one.
    pub(crate) fn stale_answer(&self, worker: &str, generation: u64, round: u64) {
        warn!(worker, job = %self.id, generation, round, "completions for a stale round, ignored");
    }
}

/// Where a job's rounds go when they run apart from the trainers.
pub(crate) enum Backend {
    /// An inference server (`rl.engine`).
    External(crate::job::engine::EngineSection),
    /// The job's own generator workers (`rl.generators`).
    Workers,
}

/// What a job's engine should do next, as [`next`] decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing now (it is busy, or nothing is owed).
    Nothing,
    /// An answered round waited for the scorer: its turn now.
    Score,
    /// Load the newest published policy, of this step.
    Reload(u64),
    /// Ask the members to publish the committed step's policy for it (its
    /// version is unknown, or too old with no newer one coming).
    Publish,
    /// Wait, for the reason given (the job's status).
    Wait(String),
    /// Generate a round of this many prompts with the loaded policy.
    Round { prompts: u64 },
}

/// The engine's next move for `job` (pure: the tick applies it). One
/// thing at a time: a newer published policy is loaded before any round;
/// an unknown or too old policy is published first; then a round when the
/// queue lacks the step after the one in flight and its rollouts could
/// still be admitted.
pub(crate) fn next(job: &Job, backend: &Backend) -> Next {
    // (A finished job's last policy is of no use to the engine.)
    if job.rec.state != JobState::Running || job.replaying() || job.finished() {
        return Next::Nothing;
    }
    let Some(gen) = job.gen() else {
        return Next::Nothing;
    };
    let step = job.rec.step;
    // Generator workers take part in a sync or a round only once
    // configured (and trainer rank 0, their sender, too).
    let generators_ready =
        gen.all_ready() && gen.generators.all_ready() && !gen.generators.is_empty();
    if matches!(backend, Backend::Workers) && !generators_ready {
        return Next::Nothing;
    }
    let (inflight_steps, inflight_docs) = job
        .inflight()
        .filter(|f| f.planned.kind == PlanKind::Train)
        .map_or((0, 0), |f| (1, f.planned.docs.len() as u64));
    // The workers answering eval prompts share the one scoring slot.
    let workers_generating = matches!(job.active().map(|a| &a.work), Some(Work::Generating(_)));
    let Some(l) = job
        .data
        .rollout_loop
        .as_ref()
        .filter(|l| l.scoring.is_none())
    else {
        return Next::Nothing;
    };
    let Some(e) = l.engine.as_ref() else {
        return Next::Nothing;
    };
    if e.answered.is_some() {
        return Next::Score;
    }
    if e.round.is_some() || e.reloading.is_some() || workers_generating {
        return Next::Nothing;
    }
    if let Some(p) = e.published.filter(|&p| e.loaded.is_none_or(|v| p > v)) {
        return Next::Reload(p);
    }
    let max_staleness = job.spec.rl.max_staleness;
    let too_old = |v: u64| max_staleness.is_some_and(|max| step.saturating_sub(v) > max);
    let loaded = match e.loaded {
        Some(v) if !(inflight_steps == 0 && too_old(v) && e.published.is_none_or(|p| p < step)) => {
            v
        }
        _ => {
            // A publication of this step that this generation's members
            // are writing (an older generation's never completes).
            let publishing = job.acks.policies.waits_for(&(gen.id, step));
            // Only between steps: the members hold the committed step's
            // weights then; asked while a step is in flight, they would
            // take the policy after it, the next step's weights under this
            // step's number (the commit publishes that one, in order).
            let ask = gen.all_ready()
                && inflight_steps == 0
                && !publishing
                && e.asked_publish != Some((step, gen.id));
            return if ask { Next::Publish } else { Next::Nothing };
        }
    };
    if job
        .spec
        .job
        .steps
        .is_some_and(|n| step + inflight_steps >= n)
    {
        return Next::Nothing;
    }
    let Some(s) = job.data.stream.as_ref() else {
        return Next::Nothing;
    };
    let need = job.settings().rollouts_needed(step + inflight_steps + 1);
    let have = s.queued_rollouts().saturating_sub(inflight_docs);
    if have >= need {
        return Next::Nothing;
    }
    let age = (step + inflight_steps).saturating_sub(loaded);
    if max_staleness.is_some_and(|max| age > max) {
        return Next::Wait(format!(
            "waiting for {} to load a newer policy (they serve step {loaded}'s; rl.max_staleness {})",
            backend.who(),
            max_staleness.unwrap_or_default()
        ));
    }
    let per_round = job.spec.rl.prompts_per_round;
    let prompts = per_round.unwrap_or_else(|| (need - have).div_ceil(u64::from(s.group_size)));
    Next::Round { prompts }
}

impl Backend {
    /// The job's engine: an external server, or its generator workers.
    fn of(job: &Job) -> Option<Backend> {
        match (&job.spec.rl.engine, job.spec.rl.generators) {
            (Some(e), _) => Some(Backend::External(e.clone())),
            (None, Some(_)) => Some(Backend::Workers),
            (None, None) => None,
        }
    }

    fn who(&self) -> &'static str {
        match self {
            Backend::External(_) => "the engine",
            Backend::Workers => "the generators",
        }
    }
}

impl JobCtx<'_> {
    /// Starts the next thing the job's engine (or its generator workers)
    /// should do, as [`next`] decides.
    pub(crate) fn engine_tick(&mut self) {
        let Some(backend) = Backend::of(self.job) else {
            return;
        };
        match next(self.job, &backend) {
            Next::Nothing => {}
            Next::Score => {
                let job = &mut *self.job;
                let l = job.data.rollout_loop.as_mut().expect("decided on it");
                let r = l.engine.as_mut().and_then(|e| e.answered.take());
                let r = r.expect("an answered round");
                hand_to_scorer(&self.id, &mut job.rec.reason, l, *r, self.fx);
            }
            Next::Reload(step) => self.reload(backend, step),
            Next::Publish => {
                let (step, gen) = (self.job.rec.step, self.job.gen().map_or(0, |g| g.id));
                if let Some(e) = self.job.data.engine_mut() {
                    e.asked_publish = Some((step, gen));
                }
                self.job.rec.reason = match backend {
                    Backend::External(_) => {
                        format!("publishing step {step}'s policy for the engine")
                    }
                    Backend::Workers => format!("taking step {step}'s policy for the generators"),
                };
                publish::request(self.job, self.fx);
            }
            Next::Wait(reason) => self.job.rec.reason = reason,
            Next::Round { prompts } => self.start_round(backend, prompts),
        }
    }

    /// Has the engine load the policy of `step`: the external one from
    /// its published directory, the generator workers over the weight ring.
    fn reload(&mut self, backend: Backend, step: u64) {
        let job = &mut *self.job;
        let gen = job.gen().expect("decided within a generation");
        let (gen_id, generators) = (gen.id, gen.generators.members.clone());
        let sender = gen.members.first().cloned();
        let dir = policy_dir(job, step);
        let e = job.data.engine_mut().expect("decided on it");
        e.reloading = Some(step);
        match backend {
            Backend::External(spec) => {
                info!(job = %self.id, step, dir = %dir.display(), url = %spec.url, "engine told to load a policy");
                job.rec.reason = format!("engine loading the policy of step {step}");
                self.fx.push(Effect::EngineReload {
                    job: self.id.clone(),
                    step,
                    dir,
                    engine: spec,
                    adapter: job.spec.lora.is_some(),
                });
            }
            Backend::Workers => {
                info!(job = %self.id, step, generators = generators.len(), "weights sent to the generators");
                job.rec.reason = format!("sending the policy of step {step} to the generators");
                e.awaiting = generators.iter().cloned().collect();
                for w in sender.iter().chain(&generators) {
                    self.fx.push(Effect::Send {
                        worker: w.clone(),
                        msg: ToWorker::SyncWeights {
                            job: self.id.clone(),
                            generation: gen_id,
                            version: step,
                        },
                    });
                }
            }
        }
    }

    /// Plans a round of `prompts` prompts with the loaded policy and hands
    /// it to the engine (or deals it to the generators).
    fn start_round(&mut self, backend: Backend, prompts: u64) {
        let job = &mut *self.job;
        let gen = job.gen().expect("decided within a generation");
        let (gen_id, generators) = (gen.id, gen.generators.members.clone());
        let sampling = job.spec.rl.sampling.clone().unwrap_or_default();
        let s = job.data.stream.as_ref().expect("decided on it");
        let (group, done) = (s.group_size, s.prompts_done);
        let ranks = match backend {
            Backend::External(_) => 1,
            Backend::Workers => generators.len() as u32,
        };
        let l = job.data.rollout_loop.as_mut().expect("decided on it");
        let policy = l
            .engine
            .as_ref()
            .and_then(|e| e.loaded)
            .expect("decided on it");
        let Some((round, mut plans)) = l.plan_round(
            done, prompts, group, ranks, gen_id, policy, &sampling, self.now,
        ) else {
            job.rec.reason = "waiting for the prompts to load".into();
            return;
        };
        info!(
            job = %self.id,
            round = round.id,
            prompts = round.positions.end - round.positions.start,
            from = round.positions.start,
            policy,
            "engine round planned"
        );
        match backend {
            Backend::External(spec) => {
                job.rec.reason = format!("engine generating round {}", round.id);
                self.fx.push(Effect::EngineGenerate(Box::new(EngineRound {
                    job: self.id.clone(),
                    round: round.id,
                    group,
                    plan: plans.pop().expect("one rank"),
                    engine: spec,
                    adapter: job.spec.lora.is_some(),
                })));
            }
            Backend::Workers => {
                job.rec.reason = format!("generators generating round {}", round.id);
                send_plans(&self.id, self.fx, gen_id, &generators, plans);
            }
        }
        l.engine.as_mut().expect("decided on it").round = Some(Box::new(round));
    }

    /// A generator's completions of the job's current generators' round:
    /// once every generator answered, the round goes to the scorer (or
    /// waits for it). An answer that does not fit its plan drops the
    /// generator (its round is planned again with the new generation).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_generator_answer(
        &mut self,
        worker: &str,
        rank: u32,
        generation: u64,
        round: u64,
        answer: (Vec<GenCompletion>, f64),
    ) {
        let Some(e) = self.job.data.engine_mut() else {
            return;
        };
        let Some(mut r) = e.round.take_if(|r| r.is(generation, round)) else {
            return self.stale_answer(worker, generation, round);
        };
        if !self.take_answer(&mut r, "generator", (worker, rank), answer) {
            // Not whole yet (or its generator was dropped: the generation
            // re-forms and the round is planned again).
            if let Some(e) = self.job.data.engine_mut() {
                e.round = Some(r);
            }
            return;
        }
        if let Some(step) = r.end_wave(&self.id) {
            self.step_episodes(step);
        }
        self.move_generators_round(r);
    }

    /// The generators' round with no wave out: a multi-turn round's next
    /// wave when episodes are ready, or it stays out while environments
    /// step; the scorer once whole.
    pub(crate) fn move_generators_round(&mut self, r: Box<Round>) {
        match r.after_wave() {
            WaveNext::Wave => self.next_generators_wave(r),
            WaveNext::Wait => {
                if let Some(e) = self.job.data.engine_mut() {
                    e.round = Some(r);
                }
            }
            WaveNext::Score => self.generators_round_over(r),
        }
    }

    /// The generators' round is whole: to the scorer, or waiting for it.
    fn generators_round_over(&mut self, r: Box<Round>) {
        let job = &mut *self.job;
        let l = job.data.rollout_loop.as_mut().expect("a generating job");
        if l.scoring.is_some() {
            if let Some(e) = l.engine.as_mut() {
                e.answered = Some(r);
            }
            return;
        }
        hand_to_scorer(&self.id, &mut job.rec.reason, l, *r, self.fx);
    }

    /// The next wave of the generators' multi-turn round, on the same
    /// generators (no weight sync happens while a round is out, so every
    /// turn samples the policy the round is tagged with).
    fn next_generators_wave(&mut self, mut r: Box<Round>) {
        let job = &mut *self.job;
        let Some(gen) = job.gen() else {
            return;
        };
        let (gen_id, generators) = (gen.id, gen.generators.members.clone());
        let sampling = job.spec.rl.sampling.clone().unwrap_or_default();
        let l = job.data.rollout_loop.as_mut().expect("a generating job");
        let plans = l.plan_wave(&mut r, generators.len() as u32, &sampling, self.now);
        job.rec.reason = format!("generators generating round {}", r.id);
        send_plans(&self.id, self.fx, gen_id, &generators, plans);
        if let Some(e) = job.data.engine_mut() {
            e.round = Some(r);
        }
    }

    /// A generator loaded the policy of step `version` from the weight
    /// ring (`transfer`: its bytes and seconds); once every generator
    /// did, rounds are tagged with it.
    pub(crate) fn on_weights_synced(
        &mut self,
        worker: &str,
        generation: u64,
        version: u64,
        transfer: (u64, f64),
    ) {
        let job = &mut *self.job;
        if job.gen().is_none_or(|g| g.id != generation) {
            warn!(
                worker,
                job = %self.id,
                generation,
                "weight sync of a stale generation, ignored"
            );
            return;
        }
        let Some(e) = job.data.engine_mut() else {
            return;
        };
        let Some(asked) = e.reloading else {
            return;
        };
        if version < asked {
            // Trainer rank 0 sends its newest snapshot, never an older one.
            let why = Why::new(
                AbortReason::WorkerError,
                format!(
                    "generator {worker} loaded the policy of step {version}, step {asked} was sent"
                ),
            );
            self.refuse(worker, why);
            return;
        }
        if !e.awaiting.remove(worker) {
            return;
        }
        e.sync_bytes = e.sync_bytes.max(transfer.0);
        e.sync_s = e.sync_s.max(transfer.1);
        if !e.awaiting.is_empty() {
            return;
        }
        let (bytes, seconds) = (e.sync_bytes, e.sync_s);
        e.sync_bytes = 0;
        e.sync_s = 0.0;
        e.reloading = None;
        e.loaded = e.loaded.max(Some(version));
        info!(
            job = %self.id,
            step = version,
            "the generators loaded the policy"
        );
        job.rec.reason.clear();
        let msg = format!(
            "the generators loaded the policy of step {version} from trainer rank 0 ({bytes} bytes each, {seconds:.3} s)"
        );
        self.fx.push(job.event(EventKind::Policy, msg, self.now));
    }

    /// The engine answered round `round`: its completions go to the shell
    /// for scoring; a failure (after the shell's retries) or an answer
    /// that does not fit the round fails the job, naming why. An answer
    /// for another round is ignored.
    pub(crate) fn on_engine_generated(
        &mut self,
        round: u64,
        result: Result<(Vec<GenCompletion>, f64), String>,
    ) {
        let job = &mut *self.job;
        let url = job.spec.rl.engine.as_ref().map(|e| e.url.clone());
        let Some(l) = job.data.rollout_loop.as_mut() else {
            return;
        };
        let Some(r) = l
            .engine
            .as_mut()
            .and_then(|e| e.round.take_if(|r| r.id == round))
        else {
            warn!(
                job = %self.id,
                round, "engine completions for no pending round, ignored"
            );
            return;
        };
        if job.rec.state.is_terminal() {
            return;
        }
        let mut r = *r;
        let failure = match result {
            Err(e) => Some(e),
            Ok((completions, seconds)) => match r.answer(0, completions, seconds) {
                Ok(_) => None,
                Err(e) => Some(format!("the engine answered wrongly: {e}")),
            },
        };
        if let Some(error) = failure {
            let why = Why::new(
                AbortReason::JobFailed,
                format!(
                    "generation engine {} failed round {round}: {error}",
                    url.unwrap_or_default()
                ),
            );
            self.finish(End::Failed(why));
            return;
        }
        if l.scoring.is_some() {
            let e = l.engine.as_mut().expect("an engine round");
            e.answered = Some(Box::new(r));
            return;
        }
        hand_to_scorer(self.id.as_str(), &mut job.rec.reason, l, r, self.fx);
    }

    /// The engine answered the reload of step `step`'s policy: from now
    /// on rounds are tagged with it. A failed reload fails the job.
    pub(crate) fn on_engine_reloaded(&mut self, step: u64, result: Result<(), String>) {
        let job = &mut *self.job;
        let Some(e) = job.data.engine_mut().filter(|e| e.reloading == Some(step)) else {
            return;
        };
        e.reloading = None;
        if job.rec.state.is_terminal() {
            return;
        }
        match result {
            Ok(()) => {
                e.loaded = e.loaded.max(Some(step));
                info!(job = %self.id, step, "engine loaded the policy");
                job.rec.reason.clear();
                let msg = format!("the generation engine loaded the policy of step {step}");
                self.fx.push(job.event(EventKind::Policy, msg, self.now));
            }
            Err(error) => {
                let dir = policy_dir(job, step);
                let why = Why::new(
                    AbortReason::JobFailed,
                    format!(
                        "the generation engine could not load the policy in {}: {error}",
                        dir.display()
                    ),
                );
                self.finish(End::Failed(why));
            }
        }
    }
}
