//! Drains (a worker's SIGTERM sends Leave = DrainWorker), and results that disagree with their plan.

use super::*;

// ---- drains (a worker's SIGTERM sends Leave = DrainWorker) ----------------

#[test]
fn draining_an_idle_worker_releases_it_once() {
    let mut s = Sim::new();
    s.worker("a");
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    assert_eq!(
        s.releases,
        vec!["a".to_string()],
        "a second drain sends nothing"
    );
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Draining);
    // A drained worker joins no job.
    s.submit(spec("steps = 1", "docs_per_step = 4", 1, 1), docs(8));
    s.run();
    assert_eq!(s.state(), JobState::Pending);
    assert!(s.configures.is_empty());
}

#[test]
fn a_drained_worker_that_reconnected_is_released_again_on_a_new_drain() {
    let mut s = Sim::new();
    s.worker("a");
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    // The session broke before the Release arrived; the worker is back.
    s.handle(Event::SessionClosed { worker: "a".into() })
        .unwrap();
    s.handle(Event::SessionOpened { worker: "a".into() })
        .unwrap();
    s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
    assert_eq!(s.releases, vec!["a".to_string(), "a".to_string()]);
}

#[test]
fn draining_a_configuring_worker_aborts_nothing_and_the_rest_train() {
    let mut s = Sim::new();
    let d = docs(16);
    for w in ["a", "b"] {
        s.worker(w);
    }
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), d.clone());
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Configuring);
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.releases.iter().filter(|w| *w == "b").count(), 1);
    assert_eq!(s.aborts, vec![]);
    assert!(s
        .manifests
        .iter()
        .all(|m| m.world_size == 1 && m.attempts == 1));
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

/// Workers a, b, c on a 24-document job of 6 per step, step 1 in flight.
pub(super) fn three_workers_step_1_in_flight(sharding: Sharding) -> (Sim, Arc<[Document]>) {
    let mut s = Sim::new();
    let d = docs(24);
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(
        with(spec("epochs = 1", "docs_per_step = 6", 1, 3), sharding, 0),
        d.clone(),
    );
    for _ in 0..3 {
        s.step_once(); // all ready → step 1 in flight
    }
    (s, d)
}

/// Regression (chaos soak): a worker draining at the step boundary whose
/// generation ended without one (another member lost mid-step) was left
/// Draining with no job and never released: the process hung on forever.
#[test]
fn a_draining_member_of_a_generation_ended_by_a_loss_is_released() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let (mut s, d) = three_workers_step_1_in_flight(sharding);
        s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
        assert_eq!(
            s.releases,
            Vec::<String>::new(),
            "{sharding:?}: not before its boundary"
        );
        s.dead.push("b".into());
        s.handle(Event::SessionClosed { worker: "b".into() })
            .unwrap();
        assert_eq!(s.releases, vec!["c".to_string()], "{sharding:?}");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let c = s.releases.iter().filter(|w| *w == "c").count();
        assert_eq!(c, 1, "{sharding:?}: c released once");
        assert!(
            s.manifests.iter().all(|m| m.world_size == 1),
            "{sharding:?}: only a trains after the loss"
        );
        assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
    }
}

/// Regression (chaos soak, seed 12 at fsdp with Qwen3): a worker drained
/// mid-step and then lost before its boundary (a peer's collective timeout
/// blamed it) registered again under its id as a fresh worker and was
/// configured into a later generation. Its drain now survives the loss: it
/// is released when it comes back and never trains again.
#[test]
fn a_drained_worker_lost_before_its_release_stays_drained_when_it_registers_again() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let (mut s, d) = three_workers_step_1_in_flight(sharding);
        s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
        s.handle(Event::SessionClosed { worker: "c".into() })
            .unwrap();
        assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
        let releases = s.releases.len();
        s.worker("c");
        assert_eq!(
            s.releases[releases..],
            ["c".to_string()],
            "{sharding:?}: released on its return"
        );
        assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Draining);
        let configured = s.configures.len();
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        assert!(
            s.configures[configured..].iter().all(|(w, _)| w != "c"),
            "{sharding:?}: c configured again"
        );
        assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
    }
}

/// Regression (chaos soak): a worker lost by heartbeat (SIGSTOP, then
/// SIGCONT) kept heartbeating on its open session into a core that ignores
/// Lost workers, and was never used or told again. Its session is now
/// ended, and the worker registering again is used like any joiner.
#[test]
fn a_worker_lost_with_its_session_open_is_told_and_rejoins_by_registering() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    s.dead.push("c".into());
    s.now += 10_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    assert_eq!(s.ended_sessions, vec!["c".to_string()]);
    // Its late heartbeat changes nothing; its session is over.
    s.handle(heartbeat("c".into())).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    // It registers again (same id, as the worker does) and rejoins.
    s.dead.clear();
    s.worker("c");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let worlds: Vec<u32> = s.manifests.iter().map(|m| m.world_size).collect();
    assert_eq!(
        worlds.first(),
        Some(&2),
        "the first committed step ran without c"
    );
    assert_eq!(worlds.last(), Some(&3), "c rejoined: {worlds:?}");
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

/// Issue 19: a result whose counts disagree with its rank's plan would skew
/// every metric; its worker is dropped and the step re-planned.
#[test]
fn a_result_that_disagrees_with_its_plan_drops_the_worker_and_replans() {
    refused_for(|mbs| {
        let tokens: u64 = mbs.iter().map(|m| m.rows().token_ids.len() as u64).sum();
        let sums = MetricSums {
            tokens: tokens * 2,
            microbatches: mbs.len() as u32,
            documents: 2,
            loss_tokens: 1,
            loss_sum: 1.0,
            ..Default::default()
        };
        (sums, format!("tokens {}, planned {tokens}", tokens * 2))
    });
}

/// Issue 19: loss tokens are checked too (every objective's worker counts
/// them the same way, so a correct result always agrees).
#[test]
fn a_result_with_other_loss_tokens_than_planned_is_refused() {
    refused_for(|mbs| {
        let planned: u64 = mbs
            .iter()
            .map(|m| step::rank_loss_tokens(&m.cu_seq_lens, &m.rows().labels))
            .sum();
        let sums = MetricSums {
            tokens: mbs.iter().map(|m| m.rows().token_ids.len() as u64).sum(),
            microbatches: mbs.len() as u32,
            documents: mbs
                .iter()
                .flat_map(|m| &m.seqs)
                .filter(|q| q.role == 0)
                .count() as u64,
            loss_tokens: planned + 1,
            loss_sum: 1.0,
            ..Default::default()
        };
        (
            sums,
            format!("loss tokens {}, planned {planned}", planned + 1),
        )
    });
}

/// Rank 2 of three answers step 1 with `bad(its microbatches)`: the result
/// is refused naming the returned detail, and the job completes without it.
/// `worker` (its session already gone: it is dead to the simulation)
/// answers `step` of `generation` with `result`; asserts the result is
/// refused: the worker lost, and a generation event saying its result for
/// `noun` disagrees with its plan, naming `want`.
pub(super) fn assert_refused(
    s: &mut Sim,
    worker: &str,
    generation: u64,
    step: u64,
    result: RankResult,
    noun: &str,
    want: &str,
) {
    s.dead.push(worker.to_string());
    s.handle(Event::StepResult {
        worker: worker.to_string(),
        job: "job".into(),
        generation,
        step,
        sums: result.sums,
        logps: result.logps,
        nonfinite: result.nonfinite,
    })
    .unwrap();
    assert_eq!(
        s.c.worker(worker).unwrap().state,
        WorkerState::Lost,
        "{want}"
    );
    let detail = s
        .events
        .iter()
        .map(|(_, m)| m.as_str())
        .find(|m| m.contains(noun) && m.contains("disagrees with its plan"))
        .expect("a generation event naming the disagreement");
    assert!(detail.contains(want), "{detail}");
}

pub(super) fn refused_for(bad: impl Fn(&[step::MicrobatchPayload]) -> (MetricSums, String)) {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    let (w, generation, planned) = s
        .inbox
        .iter()
        .find_map(|(w, m)| match m {
            ToWorker::Plan {
                rank: 2,
                generation,
                planned,
                ..
            } => Some((w.clone(), *generation, planned.clone())),
            _ => None,
        })
        .unwrap();
    let (sums, want) = bad(&planned.ranks[2]);
    s.inbox.retain(|(x, _)| *x != w);
    let result = RankResult {
        sums,
        logps: Vec::new(),
        nonfinite: Vec::new(),
    };
    assert_refused(&mut s, &w, generation, 1, result, "step", &want);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.manifests[0].world_size, 2, "step 1 re-planned without it");
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn draining_a_worker_of_a_paused_job_releases_it_and_resume_goes_on_without_it() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Ddp);
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.releases, vec!["c".to_string()], "released while paused");
    assert_eq!(s.state(), JobState::Paused, "a drain does not resume");
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.aborts, vec![]);
    let worlds: Vec<u32> = s.manifests.iter().map(|m| m.world_size).collect();
    assert_eq!(worlds, vec![3, 2, 2, 2]);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_drain_requested_twice_mid_step_writes_one_checkpoint_and_releases_once() {
    let (mut s, d) = three_workers_step_1_in_flight(Sharding::Fsdp);
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    // Answer the three step results: the boundary asks for a checkpoint.
    for _ in 0..3 {
        s.step_once();
    }
    assert_eq!(s.checkpoint_msgs, 3, "the drain's checkpoint, one per rank");
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    assert_eq!(s.checkpoint_msgs, 3, "a second drain asks for nothing more");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.releases.iter().filter(|w| *w == "c").count(), 1);
    assert_eq!(s.aborts, vec![]);
    let shape: Vec<(u32, u32)> = s
        .manifests
        .iter()
        .map(|m| (m.world_size, m.attempts))
        .collect();
    assert_eq!(shape, vec![(3, 1), (2, 1), (2, 1), (2, 1)]);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}
