//! Scenario tests of the RL loop (`data.source = "generate"`): rounds
//! planned from the prompt stream, completions gathered, scored rounds
//! admitted; every prompt once per epoch and no rollout counted twice,
//! also when a generator is lost mid-round or a round is scored late.

use super::*;
use crate::rl::episode::{EnvReply, EpisodesToStep};
use crate::rl::generation::{Finish, GenCompletion};
use crate::rl::rounds::{LoopInputs, RoundPlan, RoundStats, RoundToScore, MAX_BARREN_GROUPS};

pub(crate) fn loop_spec(steps: u64, docs_per_step: u64, group: u32, max_workers: u32) -> JobSpec {
    let mut sp = spec(
        &format!("steps = {steps}"),
        &format!("docs_per_step = {docs_per_step}"),
        1,
        max_workers,
    );
    sp.data.source = crate::job::data::DataSource::Generate;
    sp.data.format = crate::job::data::DataFormat::Prompts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.rl.group_size = Some(group);
    sp.rl.queue_capacity = Some(1000);
    sp
}

pub(crate) fn inputs(n: u64) -> LoopInputs {
    let prompts = (1..=n)
        .map(|line| Prompt {
            id: DocId { file: 0, line },
            ids: vec![10 + line as u32; 3],
            text: format!("p{line}"),
            reference: "r".into(),
            chat: false,
        })
        .collect();
    LoopInputs {
        record_routing: Default::default(),
        episodes: false,
        prompts: Arc::new(PromptSet { prompts }),
        stop_ids: vec![258],
        stop_sequences: Vec::new(),
        eval: None,
    }
}

/// A simulated worker's answer to a round: two tokens per request, the
/// second its sample number (so rewards can depend on it).
pub(crate) fn generated(worker: WorkerId, job: JobId, generation: u64, plan: &RoundPlan) -> Event {
    Event::GenerateResult {
        worker,
        job,
        generation,
        round: plan.round,
        completions: plan
            .requests
            .iter()
            .map(|q| GenCompletion {
                routing: Default::default(),
                trace: None,
                prompt: q.prompt,
                sample: q.sample,
                token_ids: vec![q.prompt.line as u32 % 256, q.sample],
                logprobs: vec![-0.5, -0.25],
                finish: Finish::Stop,
            })
            .collect(),
        seconds: 0.5,
    }
}

/// The shell's answer to a round: reward = sample parity (every group of
/// two or more has variance), as rollouts named like the shell names them.
pub(crate) fn scored(r: &RoundToScore) -> Event {
    scored_by(r, |sample| f64::from(sample % 2))
}

/// [`scored`] with the reward a function of the sample number.
pub(super) fn scored_by(r: &RoundToScore, reward_of: impl Fn(u32) -> f64) -> Event {
    let mut stats = RoundStats {
        gen_seconds: r.seconds,
        ..Default::default()
    };
    let mut rollouts = Vec::new();
    for g in &r.groups {
        for c in &g.completions {
            let reward = reward_of(c.sample);
            stats.completions += 1;
            stats.reward_sum += reward;
            stats.reward_sq_sum += reward * reward;
            stats.judged += 1;
            stats.correct += u64::from(reward > 0.0);
            stats.completion_tokens += c.token_ids.len() as u64;
            let mut ids = vec![1, 2, 3];
            ids.extend(&c.token_ids);
            let labels = [-100, -100, -100]
                .into_iter()
                .chain(c.token_ids.iter().map(|&t| t as i32))
                .collect();
            rollouts.push(Rollout {
                routing: Default::default(),
                seq: Sequence::new(ids, labels),
                reward,
                group: format!("{}@{}", g.prompt, g.position),
                policy_version: r.policy_version,
                old_logprobs: Some([0.0, 0.0, 0.0, -0.5, -0.25].to_vec()),
            });
        }
    }
    Event::RoundScored {
        job: r.job.clone(),
        round: r.round,
        rollouts,
        stats,
    }
}

/// The shell's answer to a multi-turn round's turn: a first policy turn
/// gets a 2-token environment turn (one tool call), a later one ends its
/// episode.
pub(crate) fn stepped(st: &EpisodesToStep) -> Event {
    let replies = st
        .episodes
        .iter()
        .map(|t| EnvReply {
            prompt: t.prompt,
            sample: t.sample,
            tokens: if t.turns == 1 {
                vec![200, 201]
            } else {
                Vec::new()
            },
            tool_calls: u32::from(t.turns == 1),
            done: (t.turns > 1).then_some(Finish::Stop),
            score: None,
        })
        .collect();
    Event::EpisodesStepped {
        job: st.job.clone(),
        round: st.round,
        result: Ok(replies),
    }
}

impl Sim {
    pub(crate) fn submit_loop(&mut self, spec: JobSpec, prompts: u64) {
        self.submit(spec, Vec::new().into());
        self.handle(Event::LoadPrompts {
            job: "job".into(),
            inputs: inputs(prompts),
        })
        .unwrap();
    }

    /// [`Self::submit_loop`] of a job whose rollouts are episodes.
    pub(crate) fn submit_episodes(&mut self, spec: JobSpec, prompts: u64) {
        self.submit(spec, Vec::new().into());
        let inputs = LoopInputs {
            episodes: true,
            ..inputs(prompts)
        };
        self.handle(Event::LoadPrompts {
            job: "job".into(),
            inputs,
        })
        .unwrap();
    }

    /// The group (prompt@position) of every trained rollout, per step.
    pub(crate) fn trained_groups(&self) -> Vec<Vec<String>> {
        let group_of: BTreeMap<DocId, String> = self
            .rollout_writes
            .iter()
            .flat_map(|w| &w.admit)
            .map(|d| match &d.body {
                DocBody::Rollout(r) => (d.id, r.group.clone()),
                _ => unreachable!(),
            })
            .collect();
        self.committed
            .iter()
            .map(|(_, docs)| docs.iter().map(|id| group_of[id].clone()).collect())
            .collect()
    }
}

/// Every prompt trained exactly once per epoch, each in `group` rollouts.
pub(crate) fn assert_prompts_once_per_epoch(s: &Sim, prompts: u64, group: usize) {
    let trained: Vec<String> = s.trained_groups().into_iter().flatten().collect();
    let mut per_group: BTreeMap<&str, usize> = BTreeMap::new();
    for g in &trained {
        *per_group.entry(g.as_str()).or_default() += 1;
    }
    assert!(
        per_group.values().all(|&n| n == group),
        "whole groups, none twice: {per_group:?}"
    );
    // position p is prompt-stream position: epoch p / n.
    let mut per_epoch: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for g in per_group.keys() {
        let (prompt, pos) = g.split_once('@').unwrap();
        let pos: u64 = pos.parse().unwrap();
        per_epoch
            .entry(pos / prompts)
            .or_default()
            .push(prompt.to_string());
    }
    for (epoch, mut ps) in per_epoch {
        let n = ps.len();
        ps.sort();
        ps.dedup();
        assert_eq!(ps.len(), n, "epoch {epoch}: a prompt twice");
    }
    let positions: std::collections::BTreeSet<u64> = per_group
        .keys()
        .map(|g| g.split_once('@').unwrap().1.parse().unwrap())
        .collect();
    let want: std::collections::BTreeSet<u64> = (0..positions.len() as u64).collect();
    assert_eq!(
        positions, want,
        "prompt positions consumed in order, none skipped"
    );
}

#[test]
fn rounds_train_every_prompt_once_per_epoch_with_loop_metrics() {
    let mut s = Sim::new();
    // 6 prompts, groups of 2, 4 rollouts (2 prompts) a step: 6 steps = 2 epochs.
    s.submit_loop(loop_spec(6, 4, 2, 1), 6);
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 6);
    // One round per step, of the prompts the step lacked.
    assert_eq!(s.rounds.len(), 6);
    for (i, (rank, plan)) in s.rounds.iter().enumerate() {
        assert_eq!(*rank, 0);
        assert_eq!(plan.round, i as u64 + 1);
        assert_eq!(plan.requests.len(), 4, "2 prompts × group 2");
        assert_eq!(
            plan.policy_version, i as u64,
            "sampled with the committed step's weights"
        );
        assert_eq!(plan.stop_ids.as_ref(), &[258]);
    }
    assert_prompts_once_per_epoch(&s, 6, 2);
    // Each step's manifest names the prompts (groups) it trained.
    for (m, groups) in s.manifests.iter().zip(s.trained_groups()) {
        let mut want = groups.clone();
        want.dedup();
        assert_eq!(m.groups, want);
        assert!(m
            .groups
            .iter()
            .all(|g| g.starts_with("0:") && g.contains('@')));
    }
    for (m, docs) in &s.committed {
        assert_eq!(docs.len(), 4);
        assert_eq!(m.extra["rl/reward_mean"], 0.5);
        assert_eq!(m.extra["rl/accuracy"], 0.5);
        assert_eq!(m.extra["rl/response_tokens_mean"], 2.0);
        assert_eq!(m.extra["rl/gen_tokens_per_s"], 16.0, "8 tokens in 0.5 s");
        assert_eq!(m.extra["staleness/max"], 0.0, "colocated: on-policy");
    }
    // The prompt cursor is written with the rollouts it admitted.
    let done: Vec<u64> = s
        .rollout_writes
        .iter()
        .filter(|w| !w.admit.is_empty())
        .map(|w| w.meta.prompts_done)
        .collect();
    assert_eq!(done, [2, 4, 6, 8, 10, 12]);
    // Sampler seeds: distinct within a round, the same for a position.
    let seeds: std::collections::BTreeSet<u64> = s
        .rounds
        .iter()
        .flat_map(|(_, p)| p.requests.iter().map(|q| q.seed))
        .collect();
    assert_eq!(seeds.len(), 24);
}

#[test]
fn a_round_never_crosses_an_epoch_and_is_split_over_ranks() {
    let mut s = Sim::new();
    let mut sp = loop_spec(3, 8, 2, 2);
    sp.rl.prompts_per_round = Some(4);
    sp.parallel.min_workers = 2;
    s.submit_loop(sp, 5);
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // 5 prompts: rounds of 4, then 1 (end of epoch 0), then 4, …
    let sizes: Vec<(u64, u32, usize)> = s
        .rounds
        .iter()
        .map(|(rank, p)| (p.round, *rank, p.requests.len()))
        .collect();
    assert_eq!(&sizes[..4], &[(1, 0, 4), (1, 1, 4), (2, 0, 0), (2, 1, 2)]);
    assert_prompts_once_per_epoch(&s, 5, 2);
}

#[test]
fn a_generator_lost_mid_round_loses_no_prompt_and_counts_no_rollout_twice() {
    let mut s = Sim::new();
    // Both workers are there when the job starts: one generation of two.
    s.worker("a");
    s.worker("b");
    s.submit_loop(loop_spec(4, 4, 2, 2), 6);
    // Run until the first round is out to both ranks, then lose b before
    // it answers; a's answer arrives for a generation that is over.
    s.run_until(|s| s.rounds.len() == 2);
    let first: Vec<DocId> = s
        .rounds
        .iter()
        .flat_map(|(_, p)| p.requests.iter().map(|q| q.prompt))
        .collect();
    let old_gen = s.last_generation();
    s.kill("b");
    assert!(s.to_score.is_empty(), "half a round is never scored");
    s.run_until(|s| s.rounds.len() >= 3);
    let (_, replanned) = s.rounds.last().unwrap().clone();
    let again: Vec<DocId> = replanned.requests.iter().map(|q| q.prompt).collect();
    let mut want = first.clone();
    want.sort();
    let mut got = again.clone();
    got.sort();
    assert_eq!(
        got, want,
        "the lost round's prompts are planned again, whole"
    );
    // A late answer of the old generation changes nothing.
    let late = generated("b".into(), "job".into(), old_gen, &s.rounds[1].1);
    s.handle(late).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 4);
    assert_prompts_once_per_epoch(&s, 6, 2);
}

#[test]
fn a_scored_round_is_admitted_once_even_when_its_generation_is_lost() {
    let mut s = Sim::new();
    s.auto_score = false;
    s.worker("a");
    s.worker("b");
    s.submit_loop(loop_spec(2, 4, 2, 2), 8);
    s.run();
    assert_eq!(
        s.to_score.len(),
        1,
        "round 1 generated, waiting for its scores"
    );
    let r = s.to_score.remove(0);
    // The generation ends while the round is being scored: no new round
    // is planned meanwhile (its prompts are not consumed yet).
    s.kill("b");
    s.run();
    assert_eq!(s.rounds.len(), 2, "no round planned while one is scored");
    let ev = scored(&r);
    s.handle(ev.clone()).unwrap();
    let admitted = s
        .rollout_writes
        .iter()
        .filter(|w| !w.admit.is_empty())
        .count();
    // The same scores again (a retried answer) are ignored.
    s.handle(ev).unwrap();
    assert_eq!(
        s.rollout_writes
            .iter()
            .filter(|w| !w.admit.is_empty())
            .count(),
        admitted
    );
    s.auto_score = true;
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_prompts_once_per_epoch(&s, 8, 2);
}

#[test]
fn groups_with_equal_rewards_fail_the_job_after_a_bound() {
    let mut s = Sim::new();
    s.auto_score = false;
    s.submit_loop(loop_spec(2, 4, 2, 1), 4);
    s.worker("a");
    let mut rounds = 0;
    while s.state() != JobState::Failed && rounds < 2 * MAX_BARREN_GROUPS {
        s.run();
        let Some(r) = (!s.to_score.is_empty()).then(|| s.to_score.remove(0)) else {
            break;
        };
        rounds += 1;
        // Every sample wrong, bar the very first round's: one admitted
        // group resets the count.
        let first = rounds == 1;
        s.handle(scored_by(&r, |sample| f64::from(first && sample == 1)))
            .unwrap();
    }
    assert_eq!(s.state(), JobState::Failed);
    // Rounds of two groups (one step's rollouts) after the first.
    assert_eq!(
        rounds,
        1 + MAX_BARREN_GROUPS / 2,
        "bounded, counted in a row"
    );
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(reason.contains("no learning signal"), "{reason}");
    assert!(reason.contains("had equal rewards"), "{reason}");
}

#[test]
fn a_failed_verifier_fails_the_job_naming_it() {
    let mut s = Sim::new();
    s.auto_score = false;
    s.submit_loop(loop_spec(2, 4, 2, 1), 4);
    s.worker("a");
    s.run();
    let r = s.to_score.remove(0);
    s.handle(Event::RoundFailed {
        job: "job".into(),
        round: r.round,
        error: "verifier command \"./v\": stdout line 2: not JSON".into(),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(reason.contains("stdout line 2: not JSON"), "{reason}");
}

#[test]
fn after_a_restart_the_prompt_stream_resumes_where_its_rollouts_were_written() {
    let mut s = Sim::new();
    s.submit_loop(loop_spec(3, 4, 2, 1), 10);
    s.worker("a");
    s.run_until(|s| s.committed.len() == 2);
    assert_eq!(s.persisted.last().unwrap().step, 2);
    let stored = s.stored(&[]);
    let done = stored.meta.prompts_done;
    assert!(done >= 4, "{done}");
    let rec = s.persisted.last().unwrap().clone();
    let mut r = Sim::restored_stream(rec, loop_spec(3, 4, 2, 1), stored);
    r.handle(Event::LoadPrompts {
        job: "job".into(),
        inputs: inputs(10),
    })
    .unwrap();
    // The worker kept the committed step's weights in memory.
    let held = HeldState {
        job: "job".into(),
        step: 2,
        world_size: 1,
        rank: 0,
        generation: s.last_generation(),
    };
    r.worker_holding("a", Some(held));
    r.after_rejoin_grace();
    r.run();
    let j = r.c.job("job").unwrap();
    assert_eq!(r.state(), JobState::Completed, "{}", j.rec.reason);
    let first = r
        .rounds
        .first()
        .map(|(_, p)| p.requests[0].seed)
        .expect("a round after the restart");
    // The first round after the restart starts at the stored position
    // (its seeds are those of that position).
    let pos_seed = crate::rl::generation::seed_of(3, done, 0);
    assert_eq!(first, pos_seed);
}

#[test]
fn eval_prompts_are_answered_greedily_before_the_first_step_and_after_the_last() {
    let mut s = Sim::new();
    let mut sp = loop_spec(3, 4, 2, 1);
    sp.rl.eval_every = Some(2);
    s.submit(sp, Vec::new().into());
    let mut i = inputs(6);
    let held_out = (1..=3)
        .map(|line| Prompt {
            id: DocId { file: 1, line },
            ids: vec![99; 2],
            text: format!("e{line}"),
            reference: "r".into(),
            chat: false,
        })
        .collect();
    i.eval = Some(Arc::new(PromptSet { prompts: held_out }));
    s.handle(Event::LoadPrompts {
        job: "job".into(),
        inputs: i,
    })
    .unwrap();
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 3);
    // Evaluated at steps 0, 2 (eval_every) and 3 (the last), greedily,
    // one answer per held-out prompt; never trained on.
    let steps: Vec<u64> = s.evals.iter().map(|e| e.step).collect();
    assert_eq!(steps, [0, 2, 3]);
    for e in &s.evals {
        assert_eq!(e.docs, 3);
        assert_eq!(e.extra["rl/accuracy"], 0.0, "sample 0 of each: reward 0");
    }
    let evals: Vec<&Arc<RoundPlan>> = s
        .rounds
        .iter()
        .map(|(_, p)| p)
        .filter(|p| p.requests.iter().any(|q| q.prompt.file == 1))
        .collect();
    assert_eq!(evals.len(), 3);
    for p in evals {
        assert_eq!(p.sampling.temperature, 0.0);
        assert!(p
            .requests
            .iter()
            .all(|q| q.prompt.file == 1 && q.sample == 0));
    }
    assert!(s
        .trained_groups()
        .iter()
        .flatten()
        .all(|g| g.starts_with("0:")));
}

#[test]
fn a_hung_generator_is_lost_at_the_deadline_and_its_round_planned_again() {
    let mut s = Sim::new();
    let mut sp = loop_spec(2, 4, 2, 2);
    sp.faults.step_timeout_s = Some(5.0);
    s.worker("a");
    s.worker("b");
    s.submit_loop(sp, 6);
    // b heartbeats but never answers its part of round 1.
    s.run_until(|s| s.rounds.len() == 2);
    s.dead.push("b".into());
    s.run();
    assert_eq!(s.state(), JobState::Running);
    assert!(s.to_score.is_empty() && s.committed.is_empty());
    s.now += 6_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    let j = s.c.job("job").unwrap();
    assert!(
        j.gen().is_some_and(|g| g.members == ["a"]),
        "b was dropped for its silence: {:?} {:?} {}",
        j.gen().map(|g| &g.members),
        s.events,
        j.rec.reason
    );
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_prompts_once_per_epoch(&s, 6, 2);
    let first: Vec<DocId> = s.rounds[..2]
        .iter()
        .flat_map(|(_, p)| p.requests.iter().map(|q| q.prompt))
        .collect();
    let again: Vec<DocId> = s.rounds[2].1.requests.iter().map(|q| q.prompt).collect();
    assert_eq!(
        first.iter().collect::<std::collections::BTreeSet<_>>(),
        again.iter().collect(),
        "the overdue round's prompts are planned again"
    );
}

/// Multi-turn episodes (issue 36): every episode's second turn continues
/// from its first and the environment's tokens, with a seed of its own;
/// every prompt is trained once per epoch.
#[test]
fn episodes_take_turns_and_train_every_prompt_once_per_epoch() {
    let mut s = Sim::new();
    let mut sp = loop_spec(3, 4, 2, 2);
    sp.parallel.min_workers = 2;
    s.worker("a");
    s.worker("b");
    s.submit_episodes(sp, 4);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 3);
    assert_prompts_once_per_epoch(&s, 4, 2);
    // Rounds alternate first turns (3-token prompts) and second turns.
    let firsts: Vec<&RoundPlan> = s
        .rounds
        .iter()
        .map(|(_, p)| p.as_ref())
        .filter(|p| p.requests.iter().all(|q| q.prompt_ids.len() == 3))
        .collect();
    let seconds: Vec<&RoundPlan> = s
        .rounds
        .iter()
        .map(|(_, p)| p.as_ref())
        .filter(|p| p.requests.iter().any(|q| q.prompt_ids.len() != 3))
        .collect();
    assert_eq!(firsts.len(), seconds.len());
    for p in &seconds {
        for q in &p.requests {
            let line = q.prompt.line as u32;
            assert_eq!(
                &*q.prompt_ids,
                [10 + line, 10 + line, 10 + line, line, q.sample, 200, 201],
                "prompt, the policy's first turn, the environment's turn"
            );
        }
    }
    let first_seeds: std::collections::BTreeSet<u64> = firsts
        .iter()
        .flat_map(|p| p.requests.iter().map(|q| q.seed))
        .collect();
    assert!(seconds
        .iter()
        .flat_map(|p| &p.requests)
        .all(|q| !first_seeds.contains(&q.seed)));
    // A round's turns carry one policy version: no step between them.
    for (a, b) in firsts.iter().zip(&seconds) {
        assert_eq!(a.policy_version, b.policy_version);
        assert!(b.round > a.round);
    }
}

/// Continuous batching across turns (issue 36): environments answer a
/// wave's episodes at different times. The episode answered first goes on
/// in a wave of its own while the others' environments step; those
/// answered while that wave is out go together in the next; the slowest
/// goes after; the round is scored when its last episode ended. Every
/// request (the episode so far, its turn's seed, the policy) and every
/// trained rollout is what turn-synchronous rounds give.
#[test]
fn episodes_answered_apart_go_on_in_waves_with_the_same_requests() {
    let start = || {
        let mut s = Sim::new();
        let mut sp = loop_spec(2, 4, 2, 2);
        sp.parallel.min_workers = 2;
        s.worker("a");
        s.worker("b");
        s.submit_episodes(sp, 4);
        s
    };
    type Asked = std::collections::BTreeSet<(DocId, u32, Vec<u32>, u64, u64)>;
    let requests = |s: &Sim| -> Asked {
        s.rounds
            .iter()
            .flat_map(|(_, p)| {
                p.requests.iter().map(|q| {
                    (
                        q.prompt,
                        q.sample,
                        q.prompt_ids.to_vec(),
                        q.seed,
                        p.policy_version,
                    )
                })
            })
            .collect()
    };
    let asked = |s: &Sim, from: usize| -> usize {
        s.rounds[from..].iter().map(|(_, p)| p.requests.len()).sum()
    };
    let reply = |st: &EpisodesToStep, which: &[usize]| {
        stepped(&EpisodesToStep {
            episodes: which.iter().map(|&i| st.episodes[i].clone()).collect(),
            ..st.clone()
        })
    };
    let mut sync = start();
    sync.run();
    assert_eq!(sync.state(), JobState::Completed);

    let mut s = start();
    s.hold_steps = true;
    s.run_until(|s| !s.to_step.is_empty());
    let first = s.to_step.remove(0);
    assert_eq!(first.episodes.len(), 4);
    let sent = s.rounds.len();
    s.handle(reply(&first, &[0])).unwrap();
    assert_eq!(s.rounds.len(), sent + 2, "a wave goes to every rank");
    assert_eq!(
        asked(&s, sent),
        1,
        "the episode answered first goes on alone"
    );
    let wave2 = s.rounds[sent].1.round;
    s.handle(reply(&first, &[1, 2])).unwrap();
    assert_eq!(
        s.rounds.len(),
        sent + 2,
        "answered while a wave is out: they wait"
    );
    s.run_until(|s| !s.to_step.is_empty());
    assert_eq!(
        s.to_step[0].episodes.len(),
        1,
        "wave 2's turn to its environment"
    );
    assert_eq!(s.rounds.len(), sent + 4, "wave 3 left when wave 2 ended");
    assert_eq!(asked(&s, sent + 2), 2);
    assert!(s.rounds[sent + 2].1.round > wave2);
    // The slowest environment answers while wave 3 is out.
    s.handle(reply(&first, &[3])).unwrap();
    assert!(
        s.to_score.is_empty(),
        "no episode of the round is scored early"
    );
    s.hold_steps = false;
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(asked(&s, 0), asked(&sync, 0), "no turn asked twice");
    assert_eq!(
        requests(&s),
        requests(&sync),
        "the requests of turn-synchronous rounds"
    );
    assert_eq!(s.trained_groups(), sync.trained_groups());
    assert!(s.rounds.len() > sync.rounds.len(), "in more waves");
    assert_prompts_once_per_epoch(&s, 4, 2);
}

/// A worker lost while an episode waits for its second turn: the round
/// starts again from its prompts with the first turn's seeds, nothing of
/// the lost round is scored, and every prompt still trains once.
#[test]
fn an_episode_lost_with_its_generator_restarts_from_its_prompt() {
    let mut s = Sim::new();
    let mut sp = loop_spec(2, 4, 2, 2);
    sp.parallel.min_workers = 1;
    s.worker("a");
    s.worker("b");
    s.submit_episodes(sp, 4);
    // Until the first round's second turn is out to both ranks.
    s.run_until(|s| s.rounds.len() == 4);
    let first_turn: Vec<(DocId, u32, u64)> = s.rounds[..2]
        .iter()
        .flat_map(|(_, p)| p.requests.iter().map(|q| (q.prompt, q.sample, q.seed)))
        .collect();
    assert!(s.rounds[2..]
        .iter()
        .flat_map(|(_, p)| &p.requests)
        .all(|q| q.prompt_ids.len() == 7));
    let old_gen = s.last_generation();
    let old_second = s.rounds[3].1.clone();
    s.kill("b");
    assert!(s.to_score.is_empty(), "half an episode is never scored");
    s.run_until(|s| s.rounds.len() >= 5);
    let (_, again) = s.rounds[4].clone();
    let mut got: Vec<(DocId, u32, u64)> = again
        .requests
        .iter()
        .map(|q| (q.prompt, q.sample, q.seed))
        .collect();
    got.sort();
    let mut want = first_turn;
    want.sort();
    assert_eq!(got, want, "the same prompts and seeds, from the start");
    assert!(again.requests.iter().all(|q| q.prompt_ids.len() == 3));
    // A late second turn of the old generation changes nothing.
    s.handle(generated("b".into(), "job".into(), old_gen, &old_second))
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_prompts_once_per_epoch(&s, 4, 2);
}

/// An environment that fails fails the job naming the round and what
/// the shell said; replies for a round not being stepped are ignored.
#[test]
fn a_failed_environment_fails_the_job_naming_the_episode() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit_episodes(loop_spec(2, 4, 2, 1), 4);
    s.auto_score = false;
    s.run_until(|s| !s.to_step.is_empty());
    let st = s.to_step.remove(0);
    s.handle(Event::EpisodesStepped {
        job: "job".into(),
        round: st.round + 7,
        result: Ok(Vec::new()),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Running, "a stale reply is ignored");
    s.handle(Event::EpisodesStepped {
        job: "job".into(),
        round: st.round,
        result: Err("episode 0:1 sample 1: tool server down".into()),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = s.c.job("job").unwrap().rec.reason.clone();
    assert!(
        reason.contains(&format!(
            "generation round {}: environment: episode 0:1 sample 1: tool server down",
            st.round
        )),
        "{reason}"
    );
}

/// A coordinator restarted while a multi-turn round waits for its second
/// turn: the round lived only in memory, so its prompts are unconsumed
/// and the restarted coordinator starts their episodes again from the
/// prompts (first-turn requests, the stored position's seeds).
#[test]
fn a_coordinator_restart_mid_episode_starts_the_episodes_again() {
    let mut s = Sim::new();
    s.submit_episodes(loop_spec(3, 4, 2, 1), 10);
    s.worker("a");
    s.run_until(|s| {
        s.committed.len() == 1
            && s.rounds.last().is_some_and(|(_, p)| {
                p.policy_version == 1 && p.requests.iter().all(|q| q.prompt_ids.len() == 7)
            })
    });
    assert!(s.to_score.is_empty());
    let stored = s.stored(&[]);
    let done = stored.meta.prompts_done;
    assert_eq!(done, 2, "only the first step's episodes were admitted");
    let rec = s.persisted.last().unwrap().clone();
    let mut r = Sim::restored_stream(rec, loop_spec(3, 4, 2, 1), stored);
    r.handle(Event::LoadPrompts {
        job: "job".into(),
        inputs: LoopInputs {
            episodes: true,
            ..inputs(10)
        },
    })
    .unwrap();
    let held = HeldState {
        job: "job".into(),
        step: 1,
        world_size: 1,
        rank: 0,
        generation: s.last_generation(),
    };
    r.worker_holding("a", Some(held));
    r.after_rejoin_grace();
    r.run();
    let j = r.c.job("job").unwrap();
    assert_eq!(r.state(), JobState::Completed, "{}", j.rec.reason);
    let (_, first) = r.rounds.first().expect("a round after the restart");
    assert!(
        first.requests.iter().all(|q| q.prompt_ids.len() == 3),
        "from the prompts"
    );
    assert_eq!(
        first.requests[0].seed,
        crate::rl::generation::seed_of(3, done, 0)
    );
    // Two more steps of 2 prompts each: positions 2..6, each once.
    let positions: Vec<u64> = r
        .trained_groups()
        .into_iter()
        .flatten()
        .map(|g| g.split_once('@').unwrap().1.parse().unwrap())
        .collect();
    let mut uniq = positions.clone();
    uniq.dedup();
    assert_eq!(uniq, [2, 3, 4, 5], "{positions:?}");
}
