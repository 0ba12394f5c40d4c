//! Scenario tests of disaggregated RL (`rl.generators`): some of a job's
//! workers only generate while the others train; trainer rank 0 sends
//! each published policy over the weight ring (never through disk); the
//! generators' rounds stay within `rl.max_staleness`; losing a generator
//! or a trainer re-forms the generation with every prompt trained once
//! per epoch and no rollout counted twice.

use super::*;
use crate::rl::rounds::RoundPlan;

pub(super) fn disagg_spec(steps: u64, generators: u32, every: u64, max_staleness: u64) -> JobSpec {
    let mut sp = loop_spec(steps, 4, 2, 3);
    sp.rl.generators = Some(generators);
    sp.rl.publish_every = Some(every);
    sp.rl.max_staleness = Some(max_staleness);
    sp
}

/// The policy version every trained rollout was generated with, by id.
pub(super) fn versions(s: &Sim) -> BTreeMap<DocId, u64> {
    s.rollout_writes
        .iter()
        .flat_map(|w| &w.admit)
        .map(|d| match &d.body {
            DocBody::Rollout(r) => (d.id, r.policy_version),
            _ => unreachable!(),
        })
        .collect()
}

/// Every trained rollout is within `max` versions of the step it trained
/// in (step i + 1 trains on the weights of step i).
pub(super) fn assert_staleness(s: &Sim, max: u64) {
    let version = versions(s);
    for (i, (_, docs)) in s.committed.iter().enumerate() {
        for d in docs {
            let age = i as u64 - version[d];
            assert!(
                age <= max,
                "step {} trained a rollout of policy {} (age {age} > {max})",
                i + 1,
                version[d]
            );
        }
    }
}

/// (rank, role, weight ring) of each Configure of `generation`, by worker.
pub(super) fn roles(
    s: &Sim,
    generation: u64,
) -> BTreeMap<WorkerId, (u32, Role, Option<WeightRing>)> {
    s.configures
        .iter()
        .filter_map(|(w, m)| match m {
            ToWorker::Configure {
                generation: g,
                rank,
                role,
                weights,
                ..
            } if *g == generation => Some((w.clone(), (*rank, *role, weights.clone()))),
            _ => None,
        })
        .collect()
}

#[test]
fn generators_generate_trainers_train_and_weights_go_over_the_ring() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.worker("c");
    // 6 prompts, groups of 2, 2 prompts a step: 6 steps = 2 epochs.
    s.submit_loop(disagg_spec(6, 1, 1, 1), 6);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 6);
    // c (registered last, holding nothing) generates; a and b train as
    // ranks 0 and 1; a and c form the weight ring.
    let r = roles(&s, 1);
    let ring = |rank, world, next: &str| {
        Some(WeightRing {
            rank,
            world,
            next: (next.to_string(), format!("127.0.0.1:1{next}")),
        })
    };
    assert_eq!(r["a"], (0, Role::Trainer, ring(0, 2, "c")));
    assert_eq!(r["b"], (1, Role::Trainer, None));
    assert_eq!(r["c"], (0, Role::Generator, ring(1, 2, "a")));
    assert!(
        s.round_workers.iter().all(|(w, _)| w == "c"),
        "only the generator generates: {:?}",
        s.round_workers
    );
    assert!(
        s.plans.iter().all(|p| p.ranks.len() == 2),
        "two training ranks"
    );
    // No policy on disk: the trainers snapshot it in memory.
    assert!(s
        .publish_requests
        .iter()
        .all(|(_, _, dir)| dir.as_os_str().is_empty()));
    // The starting weights go first (a generator's are never assumed),
    // then every published step, in order, to trainer rank 0 and c.
    let to_c: Vec<u64> = s
        .syncs
        .iter()
        .filter(|(w, _)| w == "c")
        .map(|(_, v)| *v)
        .collect();
    let to_a: Vec<u64> = s
        .syncs
        .iter()
        .filter(|(w, _)| w == "a")
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(to_c.first(), Some(&0));
    assert_eq!(to_a, to_c, "trainer rank 0 sends what the generators load");
    assert!(to_c.windows(2).all(|w| w[0] < w[1]), "{to_c:?}");
    assert!(s.syncs.iter().all(|(w, _)| w == "a" || w == "c"));
    // Every round is of the newest synced policy at the time.
    let rounds: Vec<u64> = s.rounds.iter().map(|(_, p)| p.policy_version).collect();
    assert!(
        rounds.iter().all(|v| to_c.contains(v)),
        "{rounds:?} vs {to_c:?}"
    );
    assert_staleness(&s, 1);
    assert_prompts_once_per_epoch(&s, 6, 2);
    assert!(
        s.round_workers.iter().any(|&(_, busy)| busy),
        "some round was generated while a step trained"
    );
}

#[test]
fn with_no_staleness_allowed_every_step_trains_on_policy() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit_loop(disagg_spec(4, 1, 1, 0), 6);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 4);
    assert_staleness(&s, 0);
    // One trainer, one generator.
    assert!(s.plans.iter().all(|p| p.ranks.len() == 1));
    assert!(s.round_workers.iter().all(|(w, _)| w == "b"));
    assert!(
        s.round_workers.iter().all(|&(_, busy)| !busy),
        "on-policy: no round while a step trains"
    );
    assert_prompts_once_per_epoch(&s, 6, 2);
}

#[test]
fn a_generator_lost_mid_round_is_replaced_with_no_prompt_lost_or_trained_twice() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.worker("c");
    s.submit_loop(disagg_spec(6, 1, 1, 1), 6);
    // Until the generator's second round is out, then lose it unanswered.
    s.run_until(|s| s.round_workers.len() == 2);
    let rank = |s: &Sim, w: &str| s.c.generator_rank(s.c.worker(w).unwrap());
    assert_eq!(
        (rank(&s, "a"), rank(&s, "b"), rank(&s, "c")),
        (None, None, Some(0))
    );
    let lost: Vec<DocId> = s.rounds[1].1.requests.iter().map(|q| q.prompt).collect();
    s.inbox.retain(|(w, _)| w != "c");
    let old = s.last_generation();
    s.kill("c");
    // a and b re-form: both hold the training state (ddp); b, the later
    // rank, generates now and a trains alone.
    s.run_until(|s| s.last_generation() > old && s.round_workers.len() >= 3);
    let r = roles(&s, s.last_generation());
    assert_eq!(r.len(), 2);
    assert_eq!(
        r.values()
            .filter(|(_, role, _)| *role == Role::Generator)
            .count(),
        1
    );
    // The new generator's weights are unknown: synced before its round.
    let (g, _) = s.round_workers[2].clone();
    assert!(s.syncs.iter().any(|(w, _)| *w == g));
    let again: Vec<DocId> = s.rounds[2].1.requests.iter().map(|q| q.prompt).collect();
    let sorted = |mut v: Vec<DocId>| {
        v.sort();
        v
    };
    assert_eq!(
        sorted(again),
        sorted(lost),
        "the lost round's prompts, whole"
    );
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 6);
    assert_prompts_once_per_epoch(&s, 6, 2);
    assert_staleness(&s, 1);
}

#[test]
fn a_trainer_lost_mid_step_keeps_the_rounds_exact() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.worker("c");
    s.submit_loop(disagg_spec(6, 1, 1, 1), 6);
    // Lose trainer b while step 3 is in flight.
    s.run_until(|s| {
        s.c.job("job")
            .unwrap()
            .inflight()
            .is_some_and(|f| f.planned.step == 3)
    });
    s.inbox.retain(|(w, _)| w != "b");
    s.kill("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 6);
    assert_prompts_once_per_epoch(&s, 6, 2);
    assert_staleness(&s, 1);
    // With two workers left, a trains and c still generates.
    let r = roles(&s, s.last_generation());
    assert_eq!(r["a"].1, Role::Trainer);
    assert_eq!(r["c"].1, Role::Generator);
}

#[test]
fn one_worker_cannot_form_a_disaggregated_generation() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit_loop(disagg_spec(2, 1, 1, 1), 6);
    s.run();
    assert_eq!(s.state(), JobState::Pending);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("rl.generators needs at least 2"),
        "{reason}"
    );
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
}

/// Issue 33 (12): a weight-ring join or weight sync that failed blamed
/// nobody (the peer was a weight-ring rank, which the coordinator would
/// have read as a training rank), so the same membership formed again and
/// again. The worker now names the weight-ring rank and the coordinator
/// maps it: rank 0 is trainer rank 0, rank i the i-th generator.
#[test]
fn a_weight_ring_failure_blames_the_weight_ring_peer() {
    for (ring_rank, blamed_role) in [(1u32, Role::Generator), (0, Role::Trainer)] {
        let mut s = Sim::new();
        for w in ["a", "b", "c", "d"] {
            s.worker(w);
        }
        s.submit_loop(disagg_spec(6, 2, 1, 1), 6);
        s.run_until(|s| s.last_generation() == 1 && !s.configures.is_empty());
        let r = roles(&s, 1);
        let by_ring: BTreeMap<u32, WorkerId> = r
            .iter()
            .filter_map(|(w, (_, _, ring))| Some((ring.as_ref()?.rank, w.clone())))
            .collect();
        assert_eq!(by_ring.len(), 3, "trainer rank 0 and two generators: {r:?}");
        let blamed = by_ring[&ring_rank].clone();
        assert_eq!(r[&blamed].1, blamed_role);
        // The reporter is the weight ring's other generator.
        let reporter = by_ring[&if ring_rank == 2 { 1 } else { 2 }].clone();
        assert_ne!(reporter, blamed);
        s.handle(Event::WorkerError {
            worker: reporter.clone(),
            job: "job".into(),
            generation: 1,
            step: 0,
            kind: WorkerErrorKind::CollectiveTimeout {
                peer: Some(Peer::WeightRing(ring_rank)),
            },
            message: "configure: joining the weight ring of generation 1: timed out".into(),
        })
        .unwrap();
        assert_eq!(
            s.c.worker(&blamed).unwrap().state,
            WorkerState::Lost,
            "weight-ring rank {ring_rank} ({blamed}) is blamed"
        );
        assert_ne!(s.c.worker(&reporter).unwrap().state, WorkerState::Lost);
        // A training rank of the same number is not.
        let training = r
            .iter()
            .find(|(_, (rank, role, _))| *role == Role::Trainer && *rank == ring_rank)
            .map(|(w, _)| w.clone());
        if let Some(t) = training.filter(|t| *t != blamed) {
            assert_ne!(s.c.worker(&t).unwrap().state, WorkerState::Lost);
        }
    }
}

/// Issue 33 (12): published-policy acknowledgements were keyed by step
/// only, so a late answer from a member of an older generation counted
/// toward the same step's request of the current one; the engine could
/// then ask generators for a snapshot trainer rank 0 had not taken (a job
/// failure). Acknowledgements are keyed by generation now.
#[test]
fn a_late_publish_ack_of_an_older_generation_counts_for_nothing() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit_loop(disagg_spec(6, 1, 1, 1), 6);
    s.run_until(|s| s.c.job("job").unwrap().gen().is_some_and(|g| g.all_ready()));
    let job = s.c.job("job").unwrap();
    let (generation, step, members) = {
        let g = job.gen().unwrap();
        (g.id, job.rec.step, g.members.clone())
    };
    // The current generation asks its members to publish.
    let mut fx = Effects::default();
    crate::core::publish::request(s.c.jobs.get_mut("job").unwrap(), &mut fx);
    assert!(s
        .c
        .job("job")
        .unwrap()
        .acks
        .policies
        .waits_for(&(generation, step)));
    let late = Event::PolicyPublished {
        worker: members[0].clone(),
        job: "job".into(),
        generation: generation - 1,
        step,
    };
    s.handle(late).unwrap();
    let acks = &s.c.job("job").unwrap().acks.policies;
    assert!(
        acks.owed(&(generation, step))
            .is_some_and(|o| o.contains(&members[0])),
        "the older generation's answer is not this generation's"
    );
    s.handle(Event::PolicyPublished {
        worker: members[0].clone(),
        job: "job".into(),
        generation,
        step,
    })
    .unwrap();
    assert!(!s
        .c
        .job("job")
        .unwrap()
        .acks
        .policies
        .waits_for(&(generation, step)));
}

/// Multi-turn episodes on generator workers (issue 36): a round's turns
/// all go to the generators, with no weight sync between them (every turn
/// samples the policy the round is tagged with), episodes within the
/// staleness bound, every prompt once per epoch.
#[test]
fn generators_take_episodes_turn_by_turn_on_one_policy() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.worker("c");
    s.submit_episodes(disagg_spec(4, 1, 1, 1), 6);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 4);
    assert_prompts_once_per_epoch(&s, 6, 2);
    assert_staleness(&s, 1);
    let mut last_first: Option<&RoundPlan> = None;
    let mut seconds = 0;
    for (_, p) in &s.rounds {
        if p.requests.iter().all(|q| q.prompt_ids.len() == 3) {
            last_first = Some(p);
            continue;
        }
        seconds += 1;
        let first = last_first.expect("a first turn before a second");
        assert_eq!(
            p.policy_version, first.policy_version,
            "one policy per round"
        );
        let ids = |p: &RoundPlan| -> Vec<(DocId, u32)> {
            p.requests.iter().map(|q| (q.prompt, q.sample)).collect()
        };
        assert_eq!(
            ids(p),
            ids(first),
            "the same episodes, on the same generator"
        );
    }
    assert!(seconds >= 4, "second turns: {seconds}");
}
