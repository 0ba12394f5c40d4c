//! Scenario tests of the RL loop on an external engine (`rl.engine`):
//! rounds go to the shell, never to the workers, and may run while a step
//! trains; the engine loads every published policy between rounds; every
//! prompt is trained once per epoch within `rl.max_staleness`; a failed
//! round fails the job naming the engine, and a late answer is ignored.

use super::*;

pub(super) fn engine_spec(steps: u64, publish_every: u64, max_staleness: u64) -> JobSpec {
    let mut sp = loop_spec(steps, 4, 2, 2);
    sp.rl.publish_every = Some(publish_every);
    sp.rl.max_staleness = Some(max_staleness);
    sp.rl.engine = Some(
        toml::from_str("url = \"http://engine:8000\"\nmodel = \"policy\"\nreload = \"sglang\"\n")
            .unwrap(),
    );
    sp
}

/// The engine's answer to a round: what a worker would have answered.
pub(super) fn completions(r: &EngineRound) -> Vec<GenCompletion> {
    match generated("engine".into(), r.job.clone(), 0, &r.plan) {
        Event::GenerateResult { completions, .. } => completions,
        _ => unreachable!(),
    }
}

impl Sim {
    /// Runs the workers and the engine (every reload succeeds) until
    /// nothing is left to answer.
    pub(super) fn run_with_engine(&mut self) {
        self.run_with_engine_until(|_| false);
    }

    /// [`Self::run_with_engine`] until `done` holds.
    pub(super) fn run_with_engine_until(&mut self, done: impl Fn(&Sim) -> bool) {
        loop {
            while !done(self) && self.step_once() {}
            if done(self) {
                return;
            }
            if !self.engine_reloads.is_empty() && self.answered_reloads < self.engine_reloads.len()
            {
                let step = self.engine_reloads[self.answered_reloads].0;
                self.answered_reloads += 1;
                self.handle(Event::EngineReloaded {
                    job: "job".into(),
                    step,
                    result: Ok(()),
                })
                .unwrap();
                continue;
            }
            if self.answered_rounds < self.engine_rounds.len() {
                let r = self.engine_rounds[self.answered_rounds].clone();
                self.answered_rounds += 1;
                self.handle(Event::EngineGenerated {
                    job: r.job.clone(),
                    round: r.round,
                    result: Ok((completions(&r), 0.5)),
                })
                .unwrap();
                continue;
            }
            break;
        }
    }
}

#[test]
fn engine_rounds_skip_the_workers_overlap_training_and_stay_within_staleness() {
    let mut s = Sim::new();
    // 6 prompts, groups of 2, 2 prompts a step: 6 steps = 2 epochs.
    s.submit_loop(engine_spec(6, 2, 2), 6);
    s.worker("a");
    s.worker("b");
    s.run_with_engine();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 6);
    assert!(s.rounds.is_empty(), "no Generate plan went to a worker");
    assert_prompts_once_per_epoch(&s, 6, 2);
    // The engine first loads the starting weights (its version is never
    // assumed), then each published policy, in order.
    let reloads: Vec<u64> = s.engine_reloads.iter().map(|(st, _)| *st).collect();
    assert_eq!(reloads, [0, 2, 4]);
    assert_eq!(
        s.engine_reloads[1].1,
        std::path::Path::new("/tmp/accrue-core-test/policy/step-2")
    );
    // Rollouts were planned at the engine's version, within the bound of
    // the step they trained in.
    let version: BTreeMap<DocId, u64> = s
        .rollout_writes
        .iter()
        .flat_map(|w| &w.admit)
        .map(|d| match &d.body {
            DocBody::Rollout(r) => (d.id, r.policy_version),
            _ => unreachable!(),
        })
        .collect();
    for (i, (_, docs)) in s.committed.iter().enumerate() {
        let committed_before = i as u64;
        for d in docs {
            assert!(
                committed_before - version[d] <= 2,
                "step {}: rollout of policy {}",
                i + 1,
                version[d]
            );
        }
    }
    let versions: Vec<u64> = s
        .engine_rounds
        .iter()
        .map(|r| r.plan.policy_version)
        .collect();
    assert!(versions.windows(2).all(|w| w[0] <= w[1]), "{versions:?}");
    assert!(
        s.engine_overlap.iter().any(|&b| b),
        "some round was generated while a step trained: {:?}",
        s.engine_overlap
    );
}

#[test]
fn a_failed_engine_round_fails_the_job_naming_the_engine() {
    let mut s = Sim::new();
    s.submit_loop(engine_spec(4, 1, 1), 6);
    s.worker("a");
    s.worker("b");
    s.run();
    // The starting weights load; then the first round goes out.
    s.handle(Event::EngineReloaded {
        job: "job".into(),
        step: 0,
        result: Ok(()),
    })
    .unwrap();
    let r = s.engine_rounds.last().cloned().expect("a round planned");
    // An answer to another round is ignored.
    s.handle(Event::EngineGenerated {
        job: "job".into(),
        round: r.round + 7,
        result: Ok((Vec::new(), 0.1)),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Running);
    s.handle(Event::EngineGenerated {
        job: "job".into(),
        round: r.round,
        result: Err(
            "http://engine:8000/v1/completions answered HTTP 500: boom (after 5 attempts)".into(),
        ),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("http://engine:8000") && reason.contains("HTTP 500"),
        "{reason}"
    );
    assert!(s.committed.is_empty() && s.to_score.is_empty());
}

#[test]
fn a_wrong_count_from_the_engine_fails_the_job_and_no_round_runs_during_a_reload() {
    let mut s = Sim::new();
    s.submit_loop(engine_spec(4, 1, 1), 6);
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.engine_reloads.len(), 1);
    assert!(
        s.engine_rounds.is_empty(),
        "no round before the engine's version is known"
    );
    s.handle(Event::EngineReloaded {
        job: "job".into(),
        step: 0,
        result: Ok(()),
    })
    .unwrap();
    let r = s.engine_rounds.last().cloned().unwrap();
    let mut cs = completions(&r);
    cs.pop();
    s.handle(Event::EngineGenerated {
        job: "job".into(),
        round: r.round,
        result: Ok((cs, 0.1)),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("answered 3 completions, 4 were asked"),
        "{reason}"
    );
}

#[test]
fn eval_prompts_stay_on_the_workers_and_share_the_scorer_with_engine_rounds() {
    let mut s = Sim::new();
    let mut sp = engine_spec(4, 1, 1);
    sp.rl.eval_every = Some(2);
    s.submit(sp, Vec::new().into());
    let mut i = super::rl_loop::inputs(6);
    let held_out = (1..=3)
        .map(|line| crate::rl::prompts::Prompt {
            id: DocId { file: 1, line },
            ids: vec![99; 2],
            text: format!("e{line}"),
            reference: "r".into(),
            chat: false,
        })
        .collect();
    i.eval = Some(Arc::new(crate::rl::prompts::PromptSet {
        prompts: held_out,
    }));
    s.handle(Event::LoadPrompts {
        job: "job".into(),
        inputs: i,
    })
    .unwrap();
    s.worker("a");
    s.worker("b");
    s.run_with_engine();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 4);
    let steps: Vec<u64> = s.evals.iter().map(|e| e.step).collect();
    assert_eq!(
        steps,
        [0, 2, 4],
        "every eval answered, none lost to an engine round"
    );
    assert!(
        s.rounds.iter().all(|(_, p)| p.sampling.temperature == 0.0),
        "the workers only answered the (greedy) eval prompts"
    );
    assert_prompts_once_per_epoch(&s, 6, 2);
}

#[test]
fn after_a_restart_the_engine_loads_the_current_policy_before_any_round() {
    let mut s = Sim::new();
    s.submit_loop(engine_spec(4, 1, 1), 6);
    s.worker("a");
    s.run_with_engine_until(|s| s.committed.len() == 2);
    let stored = s.stored(&[]);
    let rec = s.persisted.last().unwrap().clone();
    assert_eq!(rec.step, 2);
    let mut r = Sim::restored_stream(rec, engine_spec(4, 1, 1), stored);
    r.handle(Event::LoadPrompts {
        job: "job".into(),
        inputs: super::rl_loop::inputs(6),
    })
    .unwrap();
    let held = HeldState {
        job: "job".into(),
        step: 2,
        world_size: 1,
        rank: 0,
        generation: s.last_generation(),
    };
    r.worker_holding("a", Some(held));
    r.after_rejoin_grace();
    r.run_with_engine();
    assert_eq!(r.state(), JobState::Completed);
    // What the engine serves is unknown after a restart: step 2 is
    // published again and loaded before the first round.
    assert_eq!(r.engine_reloads[0].0, 2);
    assert!(r.publish_requests.iter().any(|(_, step, _)| *step == 2));
    assert!(r.engine_rounds.iter().all(|e| e.plan.policy_version >= 2));
    assert!(r.rounds.is_empty());
}

#[test]
fn an_engine_round_too_stale_to_admit_is_dropped_and_its_prompts_planned_again() {
    let mut s = Sim::new();
    s.submit_loop(engine_spec(4, 1, 1), 6);
    s.worker("a");
    s.run_with_engine_until(|s| s.committed.len() == 2);
    // Hold the next round at the scorer and age it past rl.max_staleness
    // (as if generated by policy 0 while the job is at step 2).
    s.auto_score = false;
    s.run_with_engine_until(|s| !s.to_score.is_empty());
    let mut r = s.to_score.remove(0);
    let seed = s
        .engine_rounds
        .iter()
        .find(|e| e.round == r.round)
        .unwrap()
        .plan
        .requests[0]
        .seed;
    r.policy_version = 0;
    let writes = s.rollout_writes.len();
    s.handle(super::rl_loop::scored(&r)).unwrap();
    assert_eq!(
        s.rollout_writes.len(),
        writes,
        "nothing admitted, no prompt consumed"
    );
    s.auto_score = true;
    s.run_with_engine();
    assert_eq!(s.state(), JobState::Completed);
    let asked = s
        .engine_rounds
        .iter()
        .filter(|e| e.plan.requests[0].seed == seed)
        .count();
    assert_eq!(asked, 2, "the same prompts (same seeds) were asked again");
    assert_prompts_once_per_epoch(&s, 6, 2);
}

#[test]
fn a_publication_lost_with_a_worker_is_asked_again_instead_of_stalling_the_engine() {
    let mut s = Sim::new();
    // On-policy: every round needs the policy of the committed step.
    s.worker("a");
    s.worker("b");
    s.submit_loop(engine_spec(4, 1, 0), 6);
    s.run_with_engine_until(|s| s.committed.len() == 1);
    // b dies before it wrote its part of step 1's policy: that
    // publication never completes.
    assert!(s
        .inbox
        .iter()
        .any(|(w, m)| w == "b" && matches!(m, ToWorker::PublishPolicy { step: 1, .. })));
    s.kill("b");
    s.run_with_engine();
    let j = s.c.job("job").unwrap();
    assert_eq!(s.state(), JobState::Completed, "{}", j.rec.reason);
    let reloads: Vec<u64> = s.engine_reloads.iter().map(|(st, _)| *st).collect();
    assert_eq!(reloads, [0, 1, 2, 3]);
    assert_prompts_once_per_epoch(&s, 6, 2);
}
