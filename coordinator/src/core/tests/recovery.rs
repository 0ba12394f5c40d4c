//! Recovery (issue 6): state from memory or checkpoints, replays, failed restores and syncs, liveness, coordinator restarts.

use super::*;

// ---- recovery (issue 6): memory, checkpoints, replay ------------------------

/// One Configure as a worker received it.
#[derive(Debug, Clone)]
pub(super) struct Conf {
    pub(super) rank: u32,
    pub(super) step: u64,
    pub(super) restore_from: Option<PathBuf>,
    pub(super) priors: Vec<Option<HeldState>>,
}

impl Sim {
    pub(super) fn run_until(&mut self, done: impl Fn(&Sim) -> bool) {
        while !done(self) {
            assert!(
                self.step_once(),
                "the inbox ran dry before the condition held"
            );
        }
    }

    pub(super) fn kill(&mut self, w: &str) {
        self.dead.push(w.into());
        self.handle(Event::SessionClosed { worker: w.into() })
            .unwrap();
    }

    pub(super) fn configures_of(&self, generation: u64) -> Vec<Conf> {
        let mut out: Vec<Conf> = self
            .configures
            .iter()
            .filter_map(|(_, m)| match m {
                ToWorker::Configure {
                    generation: g,
                    rank,
                    step,
                    restore_from,
                    priors,
                    ..
                } if *g == generation => Some(Conf {
                    rank: *rank,
                    step: *step,
                    restore_from: restore_from.clone(),
                    priors: priors.to_vec(),
                }),
                _ => None,
            })
            .collect();
        out.sort_by_key(|c| c.rank);
        out
    }

    pub(super) fn last_generation(&self) -> u64 {
        self.c.job("job").unwrap().rec.generation
    }

    /// Committed step → its manifest; a step committed twice fails.
    pub(super) fn manifests(&self) -> BTreeMap<u64, Vec<DocId>> {
        let mut out = BTreeMap::new();
        for (m, docs) in &self.committed {
            assert!(
                out.insert(m.step, docs.clone()).is_none(),
                "step {} committed twice",
                m.step
            );
        }
        out
    }

    pub(super) fn replayed(&self) -> Vec<Arc<PlannedStep>> {
        self.plans.iter().filter(|p| p.replay).cloned().collect()
    }
}

pub(super) fn with(
    mut sp: JobSpec,
    sharding: crate::job::parallel::Sharding,
    every: u64,
) -> JobSpec {
    sp.parallel.sharding = sharding;
    sp.checkpoint.every_steps = every;
    sp
}

/// Every document of every epoch in the committed manifests exactly once,
/// steps 1..=n without gaps, and every replayed plan carries exactly the
/// documents of the step it re-runs.
pub(super) fn assert_exactly_once(s: &Sim, d: &[Document], epochs: u32) {
    let manifests = s.manifests();
    let steps: Vec<u64> = manifests.keys().copied().collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
    for id in manifests.values().flatten() {
        *counts.entry(*id).or_default() += 1;
    }
    assert_eq!(counts.len(), d.len());
    assert!(counts.values().all(|&c| c == epochs), "{counts:?}");
    for p in s.replayed() {
        assert_eq!(p.docs, manifests[&p.step], "replayed step {}", p.step);
        let packed: Vec<DocId> = p
            .ranks
            .iter()
            .flatten()
            .flat_map(|m| &m.seqs)
            .map(|q| q.doc)
            .collect();
        let (mut a, mut b) = (packed, p.docs.clone());
        a.sort();
        b.sort();
        assert_eq!(a, b, "replayed step {} packs its documents once", p.step);
    }
}

#[test]
fn ddp_loss_keeps_the_survivors_state_and_replans_the_same_documents() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(36);
    s.submit(
        with(
            spec("steps = 6", "docs_per_step = 6", 1, 3),
            Sharding::Ddp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 3);
    let step4 = s.plans.last().unwrap().clone();
    assert_eq!(step4.step, 4);
    // c dies with step 4 in flight; nothing of step 4 was applied.
    s.inbox.clear();
    s.kill("c");
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    for c in &gen2 {
        assert_eq!((c.step, &c.restore_from), (3, &None), "{c:?}");
        assert!(c
            .priors
            .iter()
            .all(|p| p.as_ref().is_some_and(|p| p.step == 3)));
    }
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.replayed().is_empty(), "survivors keep their state");
    let m = s.manifests();
    assert_eq!(
        m[&4], step4.docs,
        "the aborted step is re-planned with the same documents"
    );
    assert_eq!(s.committed[3].0.world_size, 2);
    assert_exactly_once(&s, &d, 1);
}

/// An fsdp job of `steps` steps that never checkpoints, on three workers,
/// run until one step is left; then a worker dies (the survivors restore
/// from init and replay every committed step).
pub(super) fn long_run_losing_a_shard(steps: u64) -> (Sim, Arc<[Document]>) {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(steps as usize * 3);
    let sp = spec(&format!("steps = {steps}"), "docs_per_step = 3", 1, 3);
    s.submit(with(sp, Sharding::Fsdp, 0), d.clone());
    s.run_until(|s| s.committed.len() as u64 == steps - 1);
    s.inbox.clear();
    s.kill("c");
    (s, d)
}

#[test]
fn a_replay_past_the_in_memory_window_reads_older_steps_back_from_the_store() {
    let steps = HISTORY_WINDOW + HISTORY_LOAD_STEPS + 30;
    let (mut s, d) = long_run_losing_a_shard(steps);
    // Only the newest steps' documents stayed in memory.
    let job = s.c.job("job").unwrap();
    assert_eq!(job.data.history.len() as u64, HISTORY_WINDOW);
    assert_eq!(job.data.history_stored_through, steps - 1 - HISTORY_WINDOW);
    let mut most = 0;
    while s.step_once() {
        most = most.max(s.c.job("job").unwrap().data.history.len() as u64);
    }
    assert_eq!(s.state(), JobState::Completed);
    // The stored steps were read back in chunks as the replay reached them,
    // and memory never held more than the window and one chunk.
    let stored = steps - 1 - HISTORY_WINDOW;
    assert_eq!(
        s.history_loads,
        vec![(1, HISTORY_LOAD_STEPS), (HISTORY_LOAD_STEPS + 1, stored)]
    );
    assert!(most <= HISTORY_WINDOW + HISTORY_LOAD_STEPS, "{most}");
    // Every committed step replayed with its own documents and lr.
    let replayed = s.replayed();
    assert_eq!(
        replayed.iter().map(|p| p.step).collect::<Vec<_>>(),
        (1..steps).collect::<Vec<_>>()
    );
    for p in &replayed {
        let (m, docs) = &s.committed[p.step as usize - 1];
        assert_eq!((&p.docs, p.lr), (docs, m.lr), "step {}", p.step);
    }
    assert_exactly_once(&s, &d, 1);
}

#[test]
fn a_store_that_cannot_give_a_replayed_step_fails_the_job_naming_it() {
    let (mut s, _) = long_run_losing_a_shard(HISTORY_WINDOW + 5);
    s.history_error = Some("disk on fire".into());
    s.run();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("replaying step 1: reading its record from the store failed: disk on fire"),
        "{reason}"
    );
}

#[test]
fn fsdp_loss_restores_the_checkpoint_and_replays_the_committed_steps() {
    for sharding in [Sharding::Fsdp, Sharding::Zero2] {
        let mut s = Sim::new();
        for w in ["a", "b", "c"] {
            s.worker(w);
        }
        let d = docs(48);
        s.submit(
            with(spec("steps = 8", "docs_per_step = 6", 1, 3), sharding, 2),
            d.clone(),
        );
        // Step 2 is checkpointed, step 3 committed, step 4 in flight.
        s.run_until(|s| s.committed.len() == 3);
        assert_eq!(s.c.job("job").unwrap().rec.last_checkpoint, Some(2));
        s.inbox.clear();
        s.kill("c");
        let gen2 = s.configures_of(2);
        assert_eq!(gen2.len(), 2);
        for c in &gen2 {
            assert_eq!(c.step, 2);
            let dir = c.restore_from.as_ref().expect("a restore");
            assert!(dir.ends_with("checkpoints/step-2"), "{dir:?}");
            assert!(c.priors.iter().all(Option::is_none));
        }
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let replayed = s.replayed();
        assert_eq!(replayed.len(), 1);
        assert_eq!(replayed[0].step, 3);
        assert_eq!(replayed[0].ranks.len(), 2, "re-packed for the new world");
        assert_eq!(replayed[0].lr, s.committed[2].0.lr);
        // The replay comes first, then normal steps from 4 on.
        let after: Vec<(u64, bool)> = s
            .plans
            .iter()
            .skip_while(|p| !p.replay)
            .map(|p| (p.step, p.replay))
            .collect();
        assert_eq!(after[..2], [(3, true), (4, false)]);
        let replay_events = s.events.iter().filter(|(k, _)| k == "replay").count();
        assert_eq!(replay_events, 1);
        assert_exactly_once(&s, &d, 1);
    }
}

#[test]
fn a_join_from_two_to_three_syncs_from_memory_under_ddp_and_fsdp() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let mut s = Sim::new();
        s.worker("a");
        s.worker("b");
        s.submit(
            with(spec("steps = 4", "docs_per_step = 6", 1, 4), sharding, 0),
            docs(30),
        );
        s.step_once();
        s.step_once(); // both Ready → step 1 in flight
        s.worker("c");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
        assert_eq!(worlds, vec![2, 3, 3, 3]);
        let gen2 = s.configures_of(2);
        assert_eq!(gen2.len(), 3);
        for c in &gen2 {
            assert_eq!((c.step, &c.restore_from), (1, &None), "{sharding:?}");
            let prior = |i: usize| c.priors[i].as_ref().map(|p| (p.rank, p.world_size));
            assert_eq!(
                [prior(0), prior(1), prior(2)],
                [Some((0, 2)), Some((1, 2)), None]
            );
        }
        assert_eq!(s.checkpoints, vec![4], "only the final checkpoint");
        assert!(s.replayed().is_empty());
    }
}

#[test]
fn an_fsdp_drain_writes_the_step_first_and_restores_it_without_replay() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(
        with(
            spec("steps = 4", "docs_per_step = 6", 1, 3),
            Sharding::Fsdp,
            0,
        ),
        docs(30),
    );
    for _ in 0..3 {
        s.step_once(); // all Ready → step 1 in flight
    }
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.checkpoints, vec![1, 4], "the drain writes step 1 first");
    // The core asks for each checkpoint's tokenizer files once, whatever
    // the number of writers (the shell no longer guesses from the sends).
    let job = s.c.job("job").unwrap();
    assert_eq!(
        s.tokenizer_dirs,
        vec![job.checkpoint_dir(1), job.checkpoint_dir(4)]
    );
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    assert!(gen2.iter().all(|c| c.step == 1
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-1"))));
    assert!(s.replayed().is_empty());
    let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
    assert_eq!(worlds, vec![3, 2, 2, 2]);
}

#[test]
fn a_ddp_drain_needs_no_checkpoint() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(
            spec("steps = 3", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            0,
        ),
        docs(20),
    );
    s.step_once();
    s.step_once();
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.checkpoints, vec![3]);
    let gen2 = s.configures_of(2);
    assert_eq!((gen2.len(), gen2[0].restore_from.clone()), (1, None));
    assert!(gen2[0].priors[0].is_some());
}

#[test]
fn a_checkpoint_that_fails_to_restore_falls_back_to_the_previous_one() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let d = docs(48);
    s.submit(
        with(
            spec("steps = 8", "docs_per_step = 6", 1, 3),
            Sharding::Fsdp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 5);
    let rec = &s.c.job("job").unwrap().rec;
    let index: Vec<u64> = rec.checkpoints.iter().map(|c| c.step).collect();
    assert_eq!(index, vec![2, 4]);
    s.inbox.clear();
    s.kill("c");
    assert_eq!(s.configures_of(2)[0].step, 4);
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 2,
        step: 4,
        kind: WorkerErrorKind::RestoreFailed,
        message: "step-4/model-rank1.safetensors: checksum mismatch".into(),
    })
    .unwrap();
    let line = "checkpoint step-4 failed to restore on a: \
                step-4/model-rank1.safetensors: checksum mismatch; falling back to step-2";
    assert!(
        s.events.iter().any(|(_, m)| m.contains(line)),
        "{:?}",
        s.events
    );
    let gen3 = s.configures_of(3);
    assert_eq!(gen3.len(), 2);
    assert!(gen3.iter().all(|c| c.step == 2
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-2"))));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed: Vec<u64> = s.replayed().iter().map(|p| p.step).collect();
    assert_eq!(replayed, vec![3, 4, 5]);
    let rec = &s.c.job("job").unwrap().rec;
    assert_eq!(rec.bad_checkpoints, vec![4]);
    assert!(rec.checkpoints.iter().all(|c| c.step != 4));
    assert_exactly_once(&s, &d, 1);
}

#[test]
fn with_no_good_checkpoint_left_the_job_replays_from_init_or_fails() {
    // From the init: the whole history is known.
    let mut s = Sim::new();
    for w in ["a", "b"] {
        s.worker(w);
    }
    let d = docs(30);
    s.submit(
        with(
            spec("steps = 5", "docs_per_step = 6", 1, 2),
            Sharding::Fsdp,
            2,
        ),
        d.clone(),
    );
    s.run_until(|s| s.committed.len() == 3);
    s.inbox.clear();
    s.kill("b");
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 2,
        step: 2,
        kind: WorkerErrorKind::RestoreFailed,
        message: "step-2/manifest.json: missing".into(),
    })
    .unwrap();
    let gen3 = s.configures_of(3);
    assert_eq!((gen3[0].step, gen3[0].restore_from.clone()), (0, None));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed: Vec<u64> = s.replayed().iter().map(|p| p.step).collect();
    assert_eq!(replayed, vec![1, 2, 3]);
    assert_exactly_once(&s, &d, 1);

    // Resumed from another job's checkpoint: nothing older to go back to.
    let mut r = Sim::new();
    r.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(with(
            spec("steps = 6", "docs_per_step = 4", 1, 1),
            Sharding::Fsdp,
            0,
        )),
        spec_toml: String::new(),
        docs: docs(30),
        start: Some(JobStart {
            step: 3,
            cursor: Default::default(),
            dir: "/ckpt/step-3".into(),
        }),
    })
    .unwrap();
    r.worker("a");
    r.inbox.clear();
    r.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 3,
        kind: WorkerErrorKind::RestoreFailed,
        message: "/ckpt/step-3/model.safetensors: truncated".into(),
    })
    .unwrap();
    assert_eq!(r.state(), JobState::Failed);
    let reason = &r.c.job("job").unwrap().rec.reason;
    assert!(reason.contains("no state to recover step 3"), "{reason}");
    // The cause the worker named reaches the job's reason (issue 14 item
    // 10: it said only "no state to recover").
    assert!(
        reason.contains("the last restore failed on a: /ckpt/step-3/model.safetensors: truncated"),
        "{reason}"
    );
}

#[test]
fn a_failed_state_sync_reforms_with_a_restore() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(
        with(
            spec("steps = 4", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            1,
        ),
        docs(20),
    );
    s.run_until(|s| s.committed.len() == 2);
    s.worker("b"); // joins at the next boundary
    s.run_until(|s| s.last_generation() == 2);
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "b".into(),
        job: "job".into(),
        generation: 2,
        step: 3,
        kind: WorkerErrorKind::StateSync,
        message: "broadcast from rank 0 timed out".into(),
    })
    .unwrap();
    let gen3 = s.configures_of(3);
    assert_eq!(gen3.len(), 2);
    assert!(gen3
        .iter()
        .all(|c| c.restore_from.is_some() && c.priors.iter().all(Option::is_none)));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Once restored, later generations may use memory again.
    assert!(!s.c.job("job").unwrap().restore_required());
}

#[test]
fn two_seconds_of_silence_declare_a_worker_lost_and_ddp_survivors_continue() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(
            spec("steps = 3", "docs_per_step = 4", 1, 2),
            Sharding::Ddp,
            0,
        ),
        docs(20),
    );
    s.run_until(|s| s.committed.len() == 1);
    s.inbox.clear();
    let last_b = s.c.worker("b").unwrap().last_seen_ms();
    s.now = last_b + 2_000 - 20; // each handle advances 10 ms
    s.handle(heartbeat("a".into())).unwrap();
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // exactly 2 s: not yet
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // 2.01 s
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.dead.push("b".into());
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 1);
    assert_eq!((gen2[0].step, gen2[0].restore_from.clone()), (1, None));
    assert!(gen2[0].priors[0].is_some());
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert!(s.replayed().is_empty());
}

#[test]
fn a_reported_stall_is_not_held_against_workers_but_a_silent_one_is_still_lost() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let seen = s.c.worker("b").unwrap().last_seen_ms();
    // The shell could not listen for 5 s (the lock held): 5.5 s of wall
    // silence is 0.5 s of silence while listening.
    s.now = seen + 5_500;
    s.handle(Event::Tick { stalled_ms: 5_000 }).unwrap();
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    // a heartbeats after the stall; b stays silent, and is lost once it has
    // been silent 2 s of listening time, stall or no stall.
    s.handle(heartbeat("a".into())).unwrap();
    s.now = seen + 5_000 + 2_000 - 10; // each handle advances 10 ms
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap(); // exactly 2 s: not yet
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    // A stall before a worker was last seen is no credit for it.
    s.now = s.c.worker("a").unwrap().last_seen_ms() + 2_000 - 10;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Lost);
}

#[test]
fn a_heartbeat_backlog_is_not_held_against_workers_but_a_silent_one_is_still_lost() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    let seen = s.c.worker("c").unwrap().last_seen_ms();
    let beat = |s: &mut Sim, w: &str| {
        let ev = Event::Heartbeat {
            worker: w.into(),
            lag_ms: Some(1_500),
        };
        s.handle(ev).unwrap();
    };
    // From here on the shell reads every heartbeat 1.5 s after it was sent
    // (it is behind, its tick on time); c's are queued behind a's and b's.
    s.now = seen + 1_500;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.heartbeat_backlog_ms(), 1_500);
    // 3.4 s of wall silence, 1.9 s of it while keeping up: not lost (it
    // was before the backlog counted).
    s.now = seen + 3_400;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_ne!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    // Silent on: lost once 2 s past the backlog, the others kept.
    s.now = seen + 3_600;
    beat(&mut s, "a");
    beat(&mut s, "b");
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("c").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
}
