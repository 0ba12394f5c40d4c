//! Training scenarios: forming, dispatching and committing steps, exactly once per epoch; lost and stale workers, gathered results, heartbeats, pause, cancel, non-finite steps, joins, step modes, resuming a checkpoint.

use super::*;

#[test]
fn job_waits_pending_until_min_workers() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 2, 4), docs(20));
    s.worker("a");
    assert_eq!(s.state(), JobState::Pending);
    assert!(s
        .c
        .job("job")
        .unwrap()
        .rec
        .reason
        .contains("min_workers = 2"));
    assert!(
        s.inbox.is_empty(),
        "nothing is configured below min_workers"
    );
    s.worker("b");
    let ranks: Vec<u32> = s
        .inbox
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Configure { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect();
    assert_eq!(ranks, vec![0, 1]);
    assert_eq!(s.state(), JobState::Running);
}

#[test]
fn every_document_is_trained_exactly_once_per_epoch() {
    let mut s = Sim::new();
    let d = docs(23);
    s.submit(spec("epochs = 2", "docs_per_step = 5", 1, 4), d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let trained: Vec<DocId> = s
        .committed
        .iter()
        .flat_map(|(_, docs)| docs.clone())
        .collect();
    assert_eq!(trained.len(), 46);
    let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
    for id in &trained {
        *counts.entry(*id).or_default() += 1;
    }
    assert!(d.iter().all(|doc| counts[&doc.id] == 2), "{counts:?}");
    // Steps are consecutive and the loss is the token-weighted mean.
    for (i, (m, docs)) in s.committed.iter().enumerate() {
        assert_eq!(m.step, i as u64 + 1);
        assert_eq!(m.docs, docs.len() as u64);
        assert!((m.loss - 2.0).abs() < 1e-12);
    }
    // 46 docs at 5 per step: the last step is short.
    assert_eq!(s.committed.len(), 10);
    let last = s.persisted.last().unwrap();
    assert_eq!(last.state, JobState::Completed);
    assert_eq!(last.step, 10);
    assert_eq!(
        last.last_checkpoint,
        Some(10),
        "a final checkpoint is written"
    );
}

#[test]
fn lost_worker_aborts_step_and_replans_same_documents() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 4", "docs_per_step = 6", 1, 4), docs(30));
    // Answer the Configures, then capture step 1's plan without answering.
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    let first: Vec<Arc<PlannedStep>> = s
        .inbox
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Plan { planned, .. } => Some(planned.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(first.len(), 2);
    s.inbox.clear();
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    // The survivor is told to abort and is re-configured into generation 2.
    assert!(s
        .inbox
        .iter()
        .any(|(w, m)| w == "a" && matches!(m, ToWorker::Abort { step: 1, .. })));
    assert!(s
        .inbox
        .iter()
        .any(|(w, m)| w == "a" && matches!(m, ToWorker::Configure { generation: 2, .. })));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let (m1, docs1) = &s.committed[0];
    assert_eq!(m1.world_size, 1);
    assert_eq!(
        docs1, &first[0].docs,
        "the aborted step is re-planned with the same documents"
    );
}

#[test]
fn results_from_a_stale_generation_are_ignored() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(10));
    s.worker("a");
    s.step_once(); // Configure → Ready; step 1 dispatched
    s.handle(Event::StepResult {
        worker: "a".into(),
        job: "job".into(),
        generation: 99,
        step: 1,
        sums: MetricSums::default(),
        logps: Vec::new(),
        nonfinite: Vec::new(),
    })
    .unwrap();
    assert!(s.committed.is_empty());
    s.run();
    assert_eq!(s.committed.len(), 2);
}

/// Runs a 3-worker job to the end, train results gathered or per rank.
pub(super) fn three_worker_run(gather: bool) -> Sim {
    let mut s = Sim::new();
    s.gather = gather;
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("steps = 5", "docs_per_step = 7", 3, 3), docs(40));
    s.run();
    assert_eq!(s.state(), JobState::Completed, "gather {gather}");
    s
}

#[test]
fn gathered_results_commit_the_same_steps_as_results_sent_per_rank() {
    let (per_rank, gathered) = (three_worker_run(false), three_worker_run(true));
    assert_eq!(gathered.committed.len(), 5);
    let facts = |s: &Sim| -> Vec<_> {
        s.committed
            .iter()
            .map(|(m, docs)| {
                let sources: Vec<_> = m.sources.values().map(|x| (x.tokens, x.docs)).collect();
                let m = (
                    m.step,
                    m.loss,
                    m.tokens,
                    m.loss_tokens,
                    m.docs,
                    m.microbatches,
                );
                (m, sources, docs.clone())
            })
            .collect()
    };
    assert_eq!(facts(&per_rank), facts(&gathered));
    let cursors =
        |s: &Sim| -> Vec<_> { s.committed.iter().map(|(m, _)| m.cursor.clone()).collect() };
    assert_eq!(cursors(&per_rank), cursors(&gathered));
}

/// Three workers with step 1 dispatched and unanswered; its plan.
pub(super) fn step_1_unanswered() -> (Sim, Arc<PlannedStep>) {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("steps = 3", "docs_per_step = 6", 3, 3), docs(30));
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    let planned = s.plans.last().cloned().expect("step 1 dispatched");
    s.inbox.clear();
    (s, planned)
}

/// What a worker would report for `rank` of `p` (as `Sim` answers).
pub(super) fn result_of(p: &PlannedStep, rank: u32) -> RankResult {
    let mbs = &p.ranks[rank as usize];
    let rows: Vec<step::Rows> = mbs.iter().map(|m| m.rows()).collect();
    let loss_tokens: u64 = mbs
        .iter()
        .zip(&rows)
        .map(|(m, r)| step::rank_loss_tokens(&m.cu_seq_lens, &r.labels))
        .sum();
    RankResult {
        sums: MetricSums {
            loss_sum: loss_tokens as f64,
            loss_tokens,
            tokens: rows.iter().map(|r| r.token_ids.len() as u64).sum(),
            documents: mbs.iter().map(|m| m.seqs.len() as u64).sum(),
            microbatches: mbs.len() as u32,
            grad_norm: 1.0,
            ..Default::default()
        },
        ..Default::default()
    }
}

pub(super) fn gathered(worker: &str, p: &PlannedStep, results: Vec<(u32, RankResult)>) -> Event {
    Event::StepResults {
        worker: worker.into(),
        job: "job".into(),
        generation: 1,
        step: p.step,
        results,
    }
}

#[test]
fn gathered_results_are_taken_only_from_rank_0_and_only_whole() {
    let all = |p: &PlannedStep| (0..3).map(|r| (r, result_of(p, r))).collect::<Vec<_>>();
    // From rank 0, whole: the step commits.
    let (mut s, p) = step_1_unanswered();
    s.handle(gathered("a", &p, all(&p))).unwrap();
    assert_eq!(s.committed.len(), 1);
    assert!(s.ended_sessions.is_empty());
    // From another member: refused, its sender dropped, nothing committed.
    let (mut s, p) = step_1_unanswered();
    s.handle(gathered("b", &p, all(&p))).unwrap();
    assert!(s.committed.is_empty());
    assert_eq!(s.ended_sessions, vec!["b".to_string()]);
    // A rank missing, or one out of range: refused the same way.
    for results in [
        all(&p).into_iter().take(2).collect::<Vec<_>>(),
        all(&p).into_iter().map(|(r, x)| (r * 2, x)).collect(),
    ] {
        let (mut s, p) = step_1_unanswered();
        s.handle(gathered("a", &p, results)).unwrap();
        assert!(s.committed.is_empty());
        assert_eq!(s.ended_sessions, vec!["a".to_string()]);
        let why = s
            .events
            .iter()
            .map(|(_, m)| m.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        assert!(why.contains("not one result for each of 3 ranks"), "{why}");
    }
}

#[test]
fn a_gathered_entry_that_disagrees_with_its_plan_drops_that_ranks_worker() {
    let (mut s, p) = step_1_unanswered();
    let mut results: Vec<_> = (0..3).map(|r| (r, result_of(&p, r))).collect();
    results[2].1.sums.tokens += 1;
    s.handle(gathered("a", &p, results)).unwrap();
    assert!(s.committed.is_empty());
    assert_eq!(
        s.ended_sessions,
        vec!["c".to_string()],
        "rank 2 computed it; rank 0 only relayed it"
    );
    // With a replacement the job re-forms and trains the same documents.
    s.dead.push("c".into());
    s.worker("d");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].1, p.docs);
}

#[test]
fn queued_heartbeats_count_at_their_own_read_time_and_never_turn_back_the_clock() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let read_at = s.now + 500;
    s.now += 1_500;
    // Applied together just before a tick, each at the time it was read.
    s.handle(Event::Heartbeats {
        beats: vec![
            Beat {
                worker: "a".into(),
                at_ms: read_at,
                lag_ms: Some(0),
            },
            Beat {
                worker: "b".into(),
                at_ms: read_at - 400,
                lag_ms: Some(0),
            },
        ],
    })
    .unwrap();
    let seen = |s: &Sim, w: &str| s.c.worker(w).unwrap().last_seen_ms();
    assert_eq!((seen(&s, "a"), seen(&s, "b")), (read_at, read_at - 400));
    // A heartbeat read before a newer message does not move its time back.
    s.handle(heartbeat("a".into())).unwrap();
    let newer = seen(&s, "a");
    s.handle(Event::Heartbeats {
        beats: vec![Beat {
            worker: "a".into(),
            at_ms: read_at,
            lag_ms: Some(0),
        }],
    })
    .unwrap();
    assert_eq!(seen(&s, "a"), newer);
}

#[test]
fn heartbeat_timeout_declares_worker_lost() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 2), docs(10));
    s.worker("a");
    s.now += 1_500;
    s.handle(heartbeat("a".into())).unwrap();
    s.now += 1_500;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Configuring);
    s.now += 2_500;
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Lost);
    assert_eq!(s.state(), JobState::Pending);
}

#[test]
fn pause_takes_effect_at_the_step_boundary_and_resume_continues() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once(); // Ready → step 1 in flight
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    assert_eq!(
        s.state(),
        JobState::Running,
        "the in-flight step finishes first"
    );
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    assert_eq!(s.committed.len(), 1);
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 3);
}

#[test]
fn cancel_releases_workers_and_is_final() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once();
    s.handle(Event::CancelJob { job: "job".into() }).unwrap();
    assert_eq!(s.state(), JobState::Cancelled);
    assert!(s
        .inbox
        .iter()
        .any(|(_, m)| matches!(m, ToWorker::Release { .. })));
    assert_eq!(s.c.worker("a").unwrap().state, WorkerState::Idle);
    let err = s
        .handle(Event::CancelJob { job: "job".into() })
        .unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert!(matches!(
        s.handle(Event::PauseJob { job: "nope".into() }),
        Err(CoreError::JobNotFound(_))
    ));
}

#[test]
fn non_finite_loss_fails_the_job_naming_the_step() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once();
    s.handle(Event::WorkerError {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 1,
        kind: WorkerErrorKind::NonFinite,
        message: "loss is NaN in microbatch 2".into(),
    })
    .unwrap();
    assert_eq!(s.state(), JobState::Failed);
    let reason = &s.c.job("job").unwrap().rec.reason;
    assert!(
        reason.contains("step 1") && reason.contains("microbatch 2"),
        "{reason}"
    );
    assert!(s.committed.is_empty());
}

#[test]
fn drained_worker_leaves_at_the_boundary() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 2), docs(20));
    s.step_once();
    s.step_once(); // both ready → step 1 in flight
    s.handle(Event::DrainWorker { worker: "b".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].0.world_size, 2, "step 1 finished with both");
    assert!(s.committed[1..].iter().all(|(m, _)| m.world_size == 1));
    assert!(
        s.committed.iter().all(|(m, _)| m.docs == 4),
        "no step lost documents"
    );
    assert_eq!(s.c.worker("b").unwrap().state, WorkerState::Draining);
}

#[test]
fn restored_running_job_waits_for_workers_at_its_cursor() {
    let mut s = Sim::new();
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    for _ in 0..4 {
        s.step_once();
    }
    let rec = s.c.job("job").unwrap().rec.clone();
    assert!(rec.step >= 1);
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec.clone()),
        spec: Arc::new(spec("steps = 4", "docs_per_step = 4", 1, 1)),
        docs: docs(20),
        reference: Default::default(),
        history: Vec::new(),
    })
    .unwrap();
    let job = r.c.job("job").unwrap();
    assert_eq!(job.rec.state, JobState::Pending);
    assert_eq!(job.rec.cursor, rec.cursor);
    r.worker("z");
    r.after_rejoin_grace(); // the old members never come back
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    assert_eq!(r.committed.first().unwrap().0.step, rec.step + 1);
}

#[test]
fn a_joining_worker_enters_at_the_next_step_boundary() {
    let mut s = Sim::new();
    s.worker("a");
    s.submit(spec("steps = 3", "docs_per_step = 6", 1, 4), docs(30));
    s.step_once(); // Ready → step 1 in flight with one rank
    s.worker("b");
    assert!(
        !s.inbox.iter().any(|(w, _)| w == "b"),
        "nothing is sent to the joiner while step 1 is in flight"
    );
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let worlds: Vec<u32> = s.committed.iter().map(|(m, _)| m.world_size).collect();
    assert_eq!(worlds, vec![1, 2, 2]);
    assert!(s.committed.iter().all(|(m, _)| m.docs == 6));
    // Issue 6: the joiner syncs from the holder's memory at step 1; no
    // checkpoint is written first (before: a checkpoint of step 1, then a
    // restore from it).
    let gen2 = s.configures_of(2);
    assert_eq!(gen2.len(), 2);
    assert!(gen2.iter().all(|c| c.step == 1 && c.restore_from.is_none()));
    assert!(gen2[0].priors[0].is_some() && gen2[0].priors[1].is_none());
    assert!(!s.checkpoints.contains(&1), "{:?}", s.checkpoints);
}

/// Every step mode, end to end through planner and cursor: each document of
/// each epoch is trained exactly once, whatever carries over.
#[test]
fn every_step_mode_trains_each_document_once_per_epoch() {
    for batch in [
        "docs_per_step = 7",
        "tokens_per_step = 300",
        "microbatches_per_rank = 2",
    ] {
        let mut s = Sim::new();
        s.worker("a");
        s.worker("b");
        let d = docs(57);
        s.submit(spec("epochs = 2", batch, 1, 2), d.clone());
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{batch}");
        let mut counts: BTreeMap<DocId, u32> = BTreeMap::new();
        for (_, ids) in &s.committed {
            for id in ids {
                *counts.entry(*id).or_default() += 1;
            }
        }
        assert_eq!(counts.len(), d.len(), "{batch}");
        assert!(counts.values().all(|&c| c == 2), "{batch}: {counts:?}");
    }
}

#[test]
fn a_job_resumed_from_a_checkpoint_continues_at_its_step_and_cursor() {
    // Reference: six uninterrupted steps.
    let mut full = Sim::new();
    full.submit(spec("steps = 6", "docs_per_step = 4", 1, 1), docs(30));
    full.worker("a");
    full.run();
    assert_eq!(full.committed.len(), 6);
    let at3 = full.committed[2].0.cursor.clone();

    // The same job resumed from the step-3 checkpoint's manifest.
    let mut s = Sim::new();
    s.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(spec("steps = 6", "docs_per_step = 4", 1, 1)),
        spec_toml: String::new(),
        docs: docs(30),
        start: Some(JobStart {
            step: 3,
            cursor: at3,
            dir: "/ckpt/step-3".into(),
        }),
    })
    .unwrap();
    s.worker("a");
    let configure = s.inbox.front().map(|(_, m)| m.clone());
    let Some(ToWorker::Configure {
        step, restore_from, ..
    }) = configure
    else {
        panic!("expected a configure, got {configure:?}");
    };
    assert_eq!(step, 3);
    assert_eq!(restore_from, Some(PathBuf::from("/ckpt/step-3")));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let steps: Vec<u64> = s.committed.iter().map(|(m, _)| m.step).collect();
    assert_eq!(steps, vec![4, 5, 6]);
    for (resumed, reference) in s.committed.iter().zip(&full.committed[3..]) {
        assert_eq!(
            resumed.1, reference.1,
            "step {}: same documents",
            resumed.0.step
        );
        assert_eq!(resumed.0.cursor, reference.0.cursor);
    }
}

/// A checkpoint is durable only with its tokenizer files: a job whose
/// last checkpoint's workers are done completes only once the shell
/// acknowledged the files, and fails (never "completed") when writing them
/// failed — whenever the write finishes relative to the workers.
#[test]
fn a_job_completes_only_after_its_checkpoints_tokenizer_files() {
    for fails in [false, true] {
        let mut s = Sim::new();
        s.hold_tokenizer_acks = true;
        s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(8));
        s.worker("a");
        s.run();
        // Every worker message answered; the files are still being written.
        assert_eq!(s.committed.len(), 2);
        assert_eq!(
            s.state(),
            JobState::Running,
            "waits for the tokenizer files"
        );
        let acks: Vec<(JobId, u64)> = s.tokenizer_acks.drain(..).collect();
        assert!(acks.iter().any(|(_, step)| *step == 2), "{acks:?}");
        for (job, step) in acks {
            let event = match fails {
                false => Event::TokenizerWritten { job, step },
                true => Event::OutputFailed {
                    job,
                    what: format!("out/checkpoints/step-{step}: tokenizer files: disk full"),
                },
            };
            let _ = s.handle(event);
        }
        s.run();
        let job = s.c.job("job").unwrap();
        if fails {
            assert_eq!(job.rec.state, JobState::Failed);
            assert!(
                job.rec.reason.contains("tokenizer files"),
                "{}",
                job.rec.reason
            );
        } else {
            assert_eq!(job.rec.state, JobState::Completed, "{}", job.rec.reason);
        }
    }
}
