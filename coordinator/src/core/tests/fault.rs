//! Scenario tests of failures that must never hang a job or end it as a
//! false success (issue 14): the final checkpoint before "completed",
//! checkpoint write failures, the step deadline and the attempt cap.

use super::*;

pub(super) fn checkpoints_of(s: &Sim) -> Vec<u64> {
    s.c.job("job")
        .unwrap()
        .rec
        .checkpoints
        .iter()
        .map(|c| c.step)
        .collect()
}

/// Answers the held checkpoint messages (every rank durable).
pub(super) fn release_checkpoints(s: &mut Sim) {
    let held = s.held_checkpoints.replace(Vec::new()).unwrap_or_default();
    for (worker, msg) in held {
        if let ToWorker::Checkpoint { job, step, .. } = msg {
            s.handle(Event::CheckpointDone { worker, job, step })
                .unwrap();
        }
    }
}

#[test]
fn a_job_completes_only_once_its_final_checkpoint_is_durable() {
    let mut s = Sim::new();
    s.held_checkpoints = Some(Vec::new());
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 2), docs(20));
    s.run();
    // Every step trained; the final checkpoint is still being written.
    assert_eq!(s.committed.len(), 3);
    assert_eq!(s.state(), JobState::Running);
    assert!(s.persisted.iter().all(|r| r.state != JobState::Completed));
    assert!(s.inbox.is_empty(), "nothing is dispatched meanwhile");
    release_checkpoints(&mut s);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(checkpoints_of(&s).last(), Some(&3));
    let completed = s
        .persisted
        .iter()
        .find(|r| r.state == JobState::Completed)
        .expect("a completed record");
    assert!(completed.checkpoints.iter().any(|c| c.step == 3));
}

#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_job_even_from_an_ended_generation() {
    let mut s = Sim::new();
    s.held_checkpoints = Some(Vec::new());
    s.worker("a");
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(20));
    s.run();
    assert_eq!(s.state(), JobState::Running);
    // The write fails after its generation was replaced: a stale
    // generation id must not make the failure disappear.
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 0,
        step: 2,
        kind: WorkerErrorKind::CheckpointWrite,
        message: "checkpoint of step 2 to /out/checkpoints/step-2: Not a directory".into(),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let rec = &s.c.job("job").unwrap().rec;
    assert!(
        rec.reason.contains("checkpoint of step 2"),
        "{}",
        rec.reason
    );
    assert!(rec.reason.contains("Not a directory"), "{}", rec.reason);
}

#[test]
fn a_writer_lost_during_the_final_checkpoint_is_replaced_before_the_job_completes() {
    let mut s = Sim::new();
    s.held_checkpoints = Some(Vec::new());
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 2), docs(20));
    s.run();
    assert_eq!(s.committed.len(), 3);
    // b dies with its part unwritten; a's part arrives but is not enough.
    s.held_checkpoints = None;
    s.kill("b");
    s.handle(Event::CheckpointDone {
        worker: "a".into(),
        job: "job".into(),
        step: 3,
    })
    .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(checkpoints_of(&s).last(), Some(&3));
    assert_eq!(s.committed.len(), 3, "no step trained twice");
}

#[test]
fn a_member_silent_past_the_step_deadline_is_lost_and_its_step_replanned() {
    let mut s = Sim::new();
    let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 2);
    sp.faults.step_timeout_s = Some(30.0);
    s.worker("a");
    s.worker("b");
    s.submit(sp, docs(20));
    // Configure both, then b's trainer hangs: its process still heartbeats.
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    s.dead.push("b".into());
    s.run();
    assert_eq!(s.committed.len(), 0);
    for _ in 0..2 {
        s.now += 14_000;
        for w in ["a", "b"] {
            s.handle(heartbeat(w.into())).unwrap();
        }
        s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    }
    assert_eq!(s.state(), JobState::Running, "28 s: within the deadline");
    s.now += 3_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    let b = s.c.worker("b").unwrap();
    assert_eq!(b.state, WorkerState::Lost);
    assert!(s
        .events
        .iter()
        .any(|(k, m)| k == "generation" && m.contains("step deadline") && m.contains("worker b")));
    // The survivor trains the same documents and finishes the job.
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 2);
}

#[test]
fn without_a_configured_timeout_the_deadline_follows_observed_steps_with_a_floor() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 2), docs(20));
    s.run_until(|s| s.committed.len() == 1);
    s.dead.push("b".into());
    s.run();
    // Steps here take milliseconds; the deadline is still the floor.
    s.now += deadline::FLOOR_MS as i64 - 1_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_ne!(s.c.worker("b").unwrap().state, WorkerState::Lost);
    s.now += 2_000;
    for w in ["a", "b"] {
        s.handle(heartbeat(w.into())).unwrap();
    }
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Lost);
}

#[test]
fn a_step_that_never_commits_fails_the_job_after_max_step_attempts() {
    let mut s = Sim::new();
    let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
    sp.faults.max_step_attempts = 3;
    s.submit(sp, docs(20));
    // Each attempt's worker dies mid-step (an OOM kill, say) and a fresh
    // one takes its place.
    for i in 0..4 {
        let w = format!("w{i}");
        s.worker(&w);
        s.run_until(|s| {
            s.inbox
                .iter()
                .any(|(_, m)| matches!(m, ToWorker::Plan { .. }))
                || s.state() == JobState::Failed
        });
        if s.state() == JobState::Failed {
            break;
        }
        s.inbox.clear();
        s.kill(&w);
    }
    assert_eq!(s.state(), JobState::Failed);
    assert_eq!(s.plans.len(), 3, "three attempts, no fourth");
    let rec = &s.c.job("job").unwrap().rec;
    assert!(rec.reason.contains("dispatched 3 times"), "{}", rec.reason);
    assert!(rec.reason.contains("lost"), "{}", rec.reason);
}

pub(super) fn bisecting(sp: JobSpec) -> JobSpec {
    let mut sp = sp;
    sp.faults.on_nonfinite = crate::job::faults::OnNonFinite::Bisect;
    sp
}

pub(super) fn id(line: u64) -> DocId {
    DocId { file: 0, line }
}

/// Quarantined ids of the job, in the order found.
pub(super) fn quarantine(s: &Sim) -> Vec<DocId> {
    s.c.job("job")
        .unwrap()
        .rec
        .quarantine
        .iter()
        .map(|q| q.doc)
        .collect()
}

#[test]
fn a_poison_document_is_bisected_out_quarantined_and_every_other_trained_once() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let mut s = Sim::new();
        let mut sp = bisecting(spec("epochs = 2", "docs_per_step = 8", 1, 2));
        sp.parallel.sharding = sharding;
        let d = docs(40);
        s.poison = vec![id(13)];
        s.worker("a");
        s.worker("b");
        s.submit(sp, d.clone());
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{sharding:?}");
        assert_eq!(quarantine(&s), vec![id(13)], "{sharding:?}");
        // Found once, in the first epoch; the second epoch passes it over.
        let q = &s.c.job("job").unwrap().rec.quarantine[0];
        assert!(q.detail.contains("non-finite loss"), "{}", q.detail);
        let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
        for (_, docs) in &s.committed {
            for doc in docs {
                *counts.entry(*doc).or_default() += 1;
            }
        }
        for doc in d.iter() {
            let want = if doc.id == id(13) { 0 } else { 2 };
            assert_eq!(
                counts.get(&doc.id).copied().unwrap_or(0),
                want,
                "{sharding:?} {}",
                doc.id
            );
        }
        // Steps stay full: the quarantined document's slot is taken by the next.
        let sizes: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
        assert!(
            sizes.iter().take(9).all(|&n| n == 8),
            "{sharding:?} {sizes:?}"
        );
        let probes = s.plans.iter().filter(|p| p.kind == PlanKind::Probe).count();
        assert!(
            (2..=6).contains(&probes),
            "{sharding:?}: {probes} probe rounds"
        );
        if sharding == Sharding::Fsdp {
            for p in s.plans.iter().filter(|p| p.kind == PlanKind::Probe) {
                assert!(
                    p.ranks[1].iter().all(|m| m.tokens() == 0),
                    "fsdp probes run on rank 0"
                );
            }
        }
        assert!(s
            .events
            .iter()
            .any(|(k, m)| k == "quarantine" && m.contains("document 0:13 quarantined")));
        let rec = s.persisted.last().unwrap();
        assert_eq!(rec.quarantine.len(), 1, "the quarantine is persisted");
    }
}

#[test]
fn without_bisect_a_non_finite_step_fails_the_job_naming_it() {
    let mut s = Sim::new();
    s.poison = vec![id(3)];
    s.worker("a");
    s.submit(spec("epochs = 1", "docs_per_step = 8", 1, 1), docs(40));
    s.run();
    assert_eq!(s.state(), JobState::Failed);
    assert!(quarantine(&s).is_empty());
    let rec = &s.c.job("job").unwrap().rec;
    assert!(rec.reason.contains("non-finite"), "{}", rec.reason);
}

#[test]
fn a_non_finite_step_no_probe_reproduces_fails_the_job() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(
        bisecting(spec("steps = 4", "docs_per_step = 8", 1, 1)),
        docs(40),
    );
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    // A transient NaN: the step fails once; its documents are all fine.
    s.inbox.clear();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 1,
        kind: WorkerErrorKind::NonFinite,
        message: "gradient norm NaN".into(),
    })
    .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Failed);
    let rec = &s.c.job("job").unwrap().rec;
    assert!(
        rec.reason.contains("none of its microbatches or documents"),
        "{}",
        rec.reason
    );
}

#[test]
fn a_bisection_out_of_rounds_fails_the_job_listing_the_suspects() {
    let mut s = Sim::new();
    let mut sp = bisecting(spec("steps = 4", "docs_per_step = 16", 1, 1));
    sp.faults.max_bisect_rounds = 2;
    s.poison = vec![id(5)];
    s.worker("a");
    s.submit(sp, docs(40));
    s.run();
    assert_eq!(s.state(), JobState::Failed);
    let rec = &s.c.job("job").unwrap().rec;
    assert!(rec.reason.contains("max_bisect_rounds"), "{}", rec.reason);
    assert!(rec.reason.contains("0:5"), "{}", rec.reason);
}

#[test]
fn released_documents_return_to_the_stream_and_unknown_ones_are_refused() {
    let mut s = Sim::new();
    s.poison = vec![id(2), id(7)];
    s.worker("a");
    s.submit(
        bisecting(spec("steps = 3", "docs_per_step = 4", 1, 1)),
        docs(12),
    );
    s.run();
    let mut q = quarantine(&s);
    q.sort();
    assert_eq!(q, vec![id(2), id(7)]);
    let e = s
        .handle(Event::ReleaseQuarantine {
            job: "job".into(),
            docs: Some(vec![id(2), id(3)]),
        })
        .unwrap_err();
    assert!(e.to_string().contains("0:3"), "{e}");
    assert_eq!(quarantine(&s).len(), 2, "nothing released on error");
    s.handle(Event::ReleaseQuarantine {
        job: "job".into(),
        docs: Some(vec![id(7)]),
    })
    .unwrap();
    assert_eq!(quarantine(&s), vec![id(2)]);
    s.handle(Event::ReleaseQuarantine {
        job: "job".into(),
        docs: None,
    })
    .unwrap();
    assert!(quarantine(&s).is_empty());
    assert!(s
        .events
        .iter()
        .any(|(k, m)| k == "quarantine" && m.contains("released")));
}

/// A model init that cannot be loaded (corrupted after submit) fails the
/// job naming the worker's cause, instead of re-forming generations that
/// load it again forever.
#[test]
fn an_init_that_fails_to_load_fails_the_job_naming_the_cause() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(10));
    for _ in 0..20 {
        let Some((w, ToWorker::Configure { generation, .. })) = s.inbox.pop_front() else {
            break;
        };
        s.handle(Event::WorkerError {
            worker: w,
            job: "job".into(),
            generation,
            step: 0,
            kind: WorkerErrorKind::RestoreFailed,
            message: "/models/init/model.safetensors: header is not valid JSON".into(),
        })
        .unwrap();
    }
    assert_eq!(s.state(), JobState::Failed, "{:?}\n{:?}", s.events, s.inbox);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(reason.contains("header is not valid JSON"), "{reason}");
}

/// A probe naming a microbatch it was not given, or counting more tokens
/// than planned, is refused; the bisection still finds the poison.
#[test]
fn a_probe_result_that_disagrees_with_its_plan_is_refused() {
    for (bad, want) in [(0u32, "non-finite microbatch"), (1, "tokens")] {
        let mut s = Sim::new();
        s.poison = vec![id(13)];
        for w in ["a", "b", "c"] {
            s.worker(w);
        }
        s.submit(
            bisecting(spec("epochs = 1", "docs_per_step = 8", 1, 3)),
            docs(40),
        );
        let (generation, rank, planned) = take_plan(&mut s, "c", PlanKind::Probe);
        let mbs = &planned.ranks[rank as usize];
        let mut sums = forward_sums(mbs);
        let mut nonfinite = Vec::new();
        match bad {
            0 => nonfinite.push(mbs.len() as u32),
            _ => sums.tokens += 1,
        }
        let result = RankResult {
            sums,
            logps: Vec::new(),
            nonfinite,
        };
        let step = planned.step;
        assert_refused(&mut s, "c", generation, step, result, "probe of step", want);
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{want}");
        assert_eq!(
            quarantine(&s),
            vec![id(13)],
            "{want}: the poison is set aside"
        );
    }
}
