//! The control plane at scale: refused reference results, forgotten lost workers, planning ahead, relayed generations.

use super::*;

/// Runs `s` until a plan of `kind` for worker `w` waits in its inbox;
/// takes it out (the worker answers it by hand) and returns its
/// generation and plan.
pub(super) fn take_plan(
    s: &mut Sim,
    w: &str,
    kind: PlanKind,
) -> (u64, u32, Arc<step::PlannedStep>) {
    loop {
        let found = s.inbox.iter().position(|(x, m)| {
            x == w && matches!(m, ToWorker::Plan { planned, .. } if planned.kind == kind)
        });
        if let Some(i) = found {
            let Some((
                _,
                ToWorker::Plan {
                    generation,
                    rank,
                    planned,
                    ..
                },
            )) = s.inbox.remove(i)
            else {
                unreachable!("matched above")
            };
            return (generation, rank, planned);
        }
        assert!(s.step_once(), "no {kind:?} plan for {w}");
    }
}

/// The log-probs an honest worker reports for `mbs`.
pub(super) fn honest_logps(mbs: &[step::MicrobatchPayload]) -> Vec<SeqLogp> {
    mbs.iter()
        .flat_map(|m| m.seqs.iter())
        .map(|q| SeqLogp {
            doc: q.doc,
            role: q.role,
            logp: fake_logp(q.doc, q.role),
            tokens: Vec::new(),
        })
        .collect()
}

/// The counts an honest worker reports for a forward-only plan `mbs`.
pub(super) fn forward_sums(mbs: &[step::MicrobatchPayload]) -> MetricSums {
    MetricSums {
        microbatches: mbs.len() as u32,
        tokens: mbs.iter().map(|m| m.tokens()).sum(),
        documents: mbs.iter().map(|m| m.seqs.len() as u64).sum(),
        loss_tokens: mbs.iter().map(|m| m.loss_tokens).sum(),
        ..Default::default()
    }
}

/// Eval, reference and probe results are checked against their plans
/// like training ones: a reference chunk whose log-probs are not its
/// plan's sequences (one missing, one for another document, counts off)
/// drops the worker and the chunk is planned again, and the pass still
/// caches every document once (before, a missing log-prob failed the job
/// and a wrong one was cached).
#[test]
fn a_reference_result_that_disagrees_with_its_plan_is_refused() {
    type Bad = fn(&mut MetricSums, &mut Vec<SeqLogp>) -> &'static str;
    let cases: [Bad; 4] = [
        |_, l| {
            l.pop();
            "log-probs"
        },
        |_, l| {
            l[0].doc.line += 1000;
            "log-prob 0 for document"
        },
        |s, _| {
            s.documents += 1;
            "documents"
        },
        |s, _| {
            s.tokens -= 1;
            "tokens"
        },
    ];
    for bad in cases {
        let mut s = Sim::new();
        let d = pairs(150);
        s.submit(dpo_spec("steps = 2"), d.clone());
        s.worker("a");
        s.worker("b");
        let (generation, rank, planned) = take_plan(&mut s, "b", PlanKind::Reference);
        let mbs = &planned.ranks[rank as usize];
        let (mut sums, mut logps) = (forward_sums(mbs), honest_logps(mbs));
        let want = bad(&mut sums, &mut logps);
        let result = RankResult {
            sums,
            logps,
            nonfinite: Vec::new(),
        };
        let step = planned.step;
        assert_refused(
            &mut s,
            "b",
            generation,
            step,
            result,
            "reference chunk",
            want,
        );
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{want}");
        assert_eq!(s.stored_ref.len(), d.len(), "{want}: every pair cached");
        for (id, e) in &s.stored_ref {
            let honest = reference::RefEntry::Pair([fake_logp(*id, 0), fake_logp(*id, 1)]);
            assert_eq!(*e, honest, "{want}: {id} cached as computed");
        }
    }
}

/// Issue 19, bounded state: workers that come and go (each registering
/// under a new id, as a restarted pod does) leave at most
/// [`LOST_WORKERS_KEPT`] lost records, the most recent; a forgotten
/// worker registers again and trains.
#[test]
fn lost_workers_beyond_the_kept_number_are_forgotten_oldest_first() {
    let mut s = Sim::new();
    let churn = workers::LOST_WORKERS_KEPT + 40;
    for i in 0..churn {
        let id = format!("w{i}");
        s.worker(&id);
        s.dead.push(id.clone());
        s.handle(Event::SessionClosed { worker: id }).unwrap();
    }
    let lost: Vec<&str> =
        s.c.workers()
            .filter(|w| w.state == WorkerState::Lost)
            .map(|w| w.id.as_str())
            .collect();
    assert_eq!(lost.len(), workers::LOST_WORKERS_KEPT);
    assert_eq!(s.c.workers().count(), workers::LOST_WORKERS_KEPT);
    assert!(s.c.worker("w0").is_none(), "the first lost is forgotten");
    assert!(
        s.c.worker(&format!("w{}", churn - 1)).is_some(),
        "the last is kept"
    );
    assert!(s.c.worker("w40").is_some(), "the oldest kept");
    assert!(s.c.worker("w39").is_none(), "the newest forgotten");
    // A forgotten worker comes back under its old id and trains.
    s.dead.clear();
    s.worker("w0");
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), docs(8));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.c.worker("w0").unwrap().state, WorkerState::Idle);
}

// Planning the next step while one runs (`ahead`).

/// The step job "job" holds planned ahead.
pub(super) fn planned_ahead(s: &Sim) -> PlannedStep {
    let job = s.c.job("job").unwrap();
    job.ahead
        .next
        .as_ref()
        .expect("a step planned ahead")
        .planned()
        .clone()
}

/// Steps until the `n`th plan has been sent.
pub(super) fn until_plans(s: &mut Sim, n: usize) {
    while s.plans.len() < n {
        assert!(s.step_once(), "stalled before plan {n}");
    }
}

#[test]
fn the_next_step_is_planned_while_one_runs_and_sent_as_planned() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 2, 2), docs(40));
    s.worker("a");
    s.worker("b");
    until_plans(&mut s, 1);
    let planned = planned_ahead(&s);
    assert_eq!(planned.step, 2);
    until_plans(&mut s, 2);
    assert_eq!(*s.plans[1], planned, "step 2 went out as planned ahead");
    assert_eq!(planned_ahead(&s).step, 3);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 10);
    // All but the first went out as planned ahead.
    assert_eq!(s.c.job("job").unwrap().ahead.sent, 9);
}

#[test]
fn a_step_planned_ahead_is_planned_again_when_what_it_was_planned_from_changed() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), docs(40));
    s.worker("a");
    until_plans(&mut s, 1);
    assert_eq!(planned_ahead(&s).docs.len(), 4);
    // A live change for step 2 while step 1 runs.
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            ..Default::default()
        },
    )
    .unwrap();
    until_plans(&mut s, 2);
    assert_eq!(s.plans[1].step, 2);
    assert_eq!(s.plans[1].docs.len(), 6, "planned again with the change");
    assert_eq!(s.c.job("job").unwrap().ahead.sent, 0);
    // A member joins while step 2 runs: step 3, planned for one rank, is
    // planned again for the new generation's two.
    assert_eq!(planned_ahead(&s).ranks.len(), 1);
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.plans.iter().any(|p| p.ranks.len() == 2), "re-formed at 2");
    let all: Vec<DocId> = s.committed.iter().flat_map(|(_, d)| d.clone()).collect();
    assert_eq!(all.len(), 40, "every document once");
}

/// The relay roles of generation `g`'s Configures, by rank.
pub(super) fn relay_roles(s: &Sim, g: u64) -> Vec<Option<crate::core::relay::RelayRole>> {
    let mut roles: Vec<(u32, Option<crate::core::relay::RelayRole>)> = s
        .configures
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Configure {
                generation,
                rank,
                relay,
                role: Role::Trainer,
                ..
            } if *generation == g => Some((*rank, relay.clone())),
            _ => None,
        })
        .collect();
    roles.sort_by_key(|r| r.0);
    roles.into_iter().map(|r| r.1).collect()
}

/// `n` documents committed, each once.
pub(super) fn assert_every_document_once(s: &Sim, n: usize) {
    let all: Vec<DocId> = s.committed.iter().flat_map(|(_, d)| d.clone()).collect();
    let mut sorted = all.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((all.len(), sorted.len()), (n, n), "every document once");
}

#[test]
fn a_relayed_generations_followers_get_their_messages_through_their_hubs() {
    use crate::core::relay::RelayRole;
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 8", 4, 4), docs(40));
    for w in ["a", "b", "c", "d"] {
        s.worker(w);
    }
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 5);
    // Four ranks: groups of ⌈√4⌉ = 2, hubs 0 and 2.
    let roles = relay_roles(&s, 1);
    let key = |r: usize| match &roles[r] {
        Some(RelayRole::Hub { key, .. } | RelayRole::Follower { key, .. }) => key.clone(),
        other => panic!("rank {r}: {other:?}"),
    };
    // Each group has its own key (issue 33): a hub and its followers share
    // it, the other group's differs.
    assert_eq!(key(0), key(1));
    assert_eq!(key(2), key(3));
    assert_ne!(key(0), key(2));
    assert_eq!(
        roles[0],
        Some(RelayRole::Hub {
            key: key(0),
            followers: vec![1]
        })
    );
    assert_eq!(
        roles[2],
        Some(RelayRole::Hub {
            key: key(2),
            followers: vec![3]
        })
    );
    let members = s.c.job("job").unwrap().rec.members.clone();
    let addr = |r: usize| format!("127.0.0.1:2{}", members[r]);
    assert_eq!(
        roles[1],
        Some(RelayRole::Follower {
            key: key(0),
            hub: 0,
            hub_addr: addr(0)
        })
    );
    assert_eq!(
        roles[3],
        Some(RelayRole::Follower {
            key: key(2),
            hub: 2,
            hub_addr: addr(2)
        })
    );
    // Relays go to hubs only, and carry every member's plan of every step
    // (the hubs' own too), with the checkpoint requests.
    let hubs = [members[0].clone(), members[2].clone()];
    assert!(
        s.relayed.iter().all(|(h, _)| hubs.contains(h)),
        "{:?}",
        s.relayed
    );
    let mut plans = s.relayed_plans.clone();
    plans.sort();
    let want: Vec<(u32, u64)> = (0..4)
        .flat_map(|r| (1..=5).map(move |step| (r, step)))
        .collect();
    assert_eq!(plans, want);
    assert_every_document_once(&s, 40);
}

#[test]
fn a_relayed_generation_that_loses_a_follower_re_forms_and_relays_again() {
    use crate::core::relay::RelayRole;
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 6", 3, 4), docs(36));
    for w in ["a", "b", "c", "d"] {
        s.worker(w);
    }
    until_plans(&mut s, 2);
    let members = s.c.job("job").unwrap().rec.members.clone();
    // Rank 3 follows rank 2: its plan went through rank 2's relay.
    s.kill(&members[3]);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Three ranks: groups of 2; rank 2's group has no follower.
    let last = s.c.job("job").unwrap().rec.generation;
    let roles = relay_roles(&s, last);
    assert_eq!(roles.len(), 3, "{roles:?}");
    assert!(matches!(&roles[0], Some(RelayRole::Hub { followers, .. }) if followers == &[1]));
    assert!(matches!(&roles[1], Some(RelayRole::Follower { .. })));
    assert_eq!(roles[2], None);
    assert_every_document_once(&s, 36);
}

/// `bad` joins and answers its reference plan with one token too many:
/// (generation, step, the wrong result), not yet sent.
fn joins_with_a_wrong_reference_answer(s: &mut Sim, bad: &str) -> (u64, u64, RankResult) {
    s.worker(bad);
    let (generation, rank, planned) = take_plan(s, bad, PlanKind::Reference);
    let mbs = &planned.ranks[rank as usize];
    let mut sums = forward_sums(mbs);
    sums.tokens += 1;
    let result = RankResult {
        sums,
        logps: honest_logps(mbs),
        nonfinite: Vec::new(),
    };
    (generation, planned.step, result)
}

/// Issue 33 (11): only training plans counted their attempts, so a worker
/// that answers every reference (eval, probe, generation round) wrongly —
/// dropped, rejoining, dropped again — looped the job for ever. Refusals
/// in a row now fail the job at `faults.max_step_attempts`, naming the
/// last one; honest work in between starts the count over.
#[test]
fn answers_refused_again_and_again_fail_the_job_instead_of_looping() {
    let mut s = Sim::new();
    let mut sp = dpo_spec("steps = 2");
    sp.faults.max_step_attempts = 3;
    // "a" never trains alone: every generation has a hostile member.
    sp.parallel.min_workers = 2;
    s.submit(sp, pairs(150));
    s.worker("a");
    for i in 0..3 {
        let bad = format!("bad{i}");
        let (generation, step, result) = joins_with_a_wrong_reference_answer(&mut s, &bad);
        assert_ne!(s.state(), JobState::Failed, "refusal {i} of 3");
        assert_refused(
            &mut s,
            &bad,
            generation,
            step,
            result,
            "reference chunk",
            "tokens",
        );
    }
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("3 answers in a row were refused")
            && reason.contains("faults.max_step_attempts = 3")
            && reason.contains("worker bad2"),
        "{reason}"
    );

    // An honest answer between refusals starts the count over.
    let mut s = Sim::new();
    let mut sp = dpo_spec("steps = 2");
    sp.faults.max_step_attempts = 2;
    s.submit(sp, pairs(2000));
    s.worker("a");
    for i in 0..2 {
        let bad = format!("bad{i}");
        let (generation, step, result) = joins_with_a_wrong_reference_answer(&mut s, &bad);
        assert_refused(
            &mut s,
            &bad,
            generation,
            step,
            result,
            "reference chunk",
            "tokens",
        );
        // "a" alone completes a chunk before the next hostile worker joins.
        let before = s.stored_ref.len();
        while s.stored_ref.len() == before {
            assert!(s.step_once(), "a alone makes progress");
        }
    }
    assert_ne!(s.state(), JobState::Failed);
}

/// Issue 33 (6): a relay link that kept failing (a network policy between
/// pods, say) re-formed relayed generation after relayed generation. Each
/// failure blames the rank the worker names, and after two the job's next
/// generations send every message directly, and the job completes.
#[test]
fn relay_link_failures_twice_make_the_job_send_directly() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 8", 3, 4), docs(40));
    for w in ["a", "b", "c", "d", "e", "f"] {
        s.worker(w);
    }
    for failure in 1..=2u32 {
        until_plans(&mut s, 1);
        let job = s.c.job("job").unwrap();
        let generation = job.rec.generation;
        let members = job.rec.members.clone();
        let roles = relay_roles(&s, generation);
        use crate::core::relay::RelayRole;
        assert!(
            matches!(roles[1], Some(RelayRole::Follower { hub: 0, .. })),
            "relayed: {roles:?}"
        );
        // Rank 1 follows rank 0 and reports its link broken.
        s.handle(Event::WorkerError {
            worker: members[1].clone(),
            job: "job".into(),
            generation,
            step: 1,
            kind: WorkerErrorKind::RelayLink { peer_rank: Some(0) },
            message: format!("relay from rank 0: connection reset ({failure})"),
        })
        .unwrap();
        assert_eq!(
            s.c.worker(&members[0]).unwrap().state,
            WorkerState::Lost,
            "the hub is blamed"
        );
        s.dead.push(members[0].clone());
        s.inbox.retain(|(w, _)| *w != members[0]);
    }
    assert!(
        s.events
            .iter()
            .any(|(_, m)| m.contains("relaying stopped after 2 relay link failures")),
        "{:?}",
        s.events
    );
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let last = s.c.job("job").unwrap().rec.generation;
    let roles = relay_roles(&s, last);
    assert!(
        !roles.is_empty() && roles.iter().all(Option::is_none),
        "direct: {roles:?}"
    );
    assert_every_document_once(&s, 40);
}
