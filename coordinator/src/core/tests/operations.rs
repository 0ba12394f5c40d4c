//! Operations: max_tokens at run time, the checkpoint index, resolving a job by name or prefix.

use super::*;
use std::path::Path;

/// Regression (issue 13): after `accrue set --max-tokens` the workers
/// still computed padding against the submitted value, because a plan did
/// not carry its budget. Every plan sent carries the budget it was packed
/// with.
#[test]
fn max_tokens_set_at_run_time_reaches_the_plans_sent_to_workers() {
    let mut s = Sim::new();
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight with the submitted 128
    set(
        &mut s,
        JobUpdate {
            max_tokens: Some(70),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sent: Vec<u32> = s
        .plans
        .iter()
        .map(|p| {
            let msg = crate::shell::service::convert::to_worker(&ToWorker::Plan {
                job: "job".into(),
                generation: 1,
                rank: 0,
                group: 0,
                planned: p.clone(),
            });
            match msg.msg {
                Some(accrue_proto::v1::coordinator_message::Msg::StepPlan(w)) => w.max_tokens,
                other => panic!("expected a plan, got {other:?}"),
            }
        })
        .collect();
    assert_eq!(sent, vec![128, 70, 70, 70, 70]);
    for p in &s.plans[1..] {
        assert!(p.ranks.iter().flatten().all(|mb| mb.tokens() <= 70));
    }
}

/// Regression (issue 13): a replay packed with the submitted `max_tokens`,
/// undoing a lowered value (a memory limit the operator set). A replayed
/// step keeps its documents and learning rate and packs within the lowered
/// budget.
#[test]
fn a_replay_after_a_lowered_max_tokens_packs_with_the_lowered_value() {
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
    // Step 2 is checkpointed, step 3 committed (packed within 128).
    s.run_until(|s| s.committed.len() == 3);
    let original = committed_plan(&s, 3);
    let widest = |p: &PlannedStep| {
        p.ranks
            .iter()
            .flatten()
            .map(|mb| mb.tokens())
            .max()
            .unwrap()
    };
    assert!(
        widest(&original) > 64,
        "the original packing used > 64 tokens"
    );
    set(
        &mut s,
        JobUpdate {
            max_tokens: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    s.inbox.clear();
    s.kill("c");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let replayed = s.replayed();
    assert_eq!(replayed.len(), 1);
    let r = &replayed[0];
    assert_eq!(r.step, 3);
    assert_eq!(r.settings.max_tokens, 64);
    assert!(widest(r) <= 64, "replayed within the lowered budget");
    assert_eq!((r.docs.clone(), r.lr), (original.docs.clone(), original.lr));
    assert_eq!(r.normalizers, original.normalizers);
    assert_exactly_once(&s, &d, 1);
}

/// `checkpoint.keep` bounds the disk: a checkpoint that leaves the index
/// is deleted (after the record persisted), the job's own only — never the
/// checkpoint it resumed from — and never one still in the index.
#[test]
fn checkpoints_beyond_keep_are_deleted_but_never_the_resume_point() {
    let mut s = Sim::new();
    let mut sp = with(
        spec("steps = 6", "docs_per_step = 4", 1, 1),
        Sharding::Ddp,
        1,
    );
    sp.checkpoint.keep = 2;
    s.handle(Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(sp),
        spec_toml: String::new(),
        docs: docs(24),
        start: Some(JobStart {
            step: 0,
            cursor: Default::default(),
            dir: PathBuf::from("/elsewhere/imported"),
        }),
    })
    .unwrap();
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let kept: Vec<u64> =
        s.c.job("job")
            .unwrap()
            .rec
            .checkpoints
            .iter()
            .map(|c| c.step)
            .collect();
    assert_eq!(kept, vec![5, 6]);
    // Step 0 (the imported checkpoint) left the index but is not ours.
    assert_eq!(s.removed_checkpoints, vec![1, 2, 3, 4]);
}

/// Issue 18: operators name jobs by id, name or a unique id prefix.
#[test]
fn jobs_resolve_by_id_name_or_unique_prefix() {
    let mut s = Sim::new();
    let mut submit = |id: &str, name: &str, out: &str| {
        let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
        sp.job.name = name.into();
        sp.job.output_dir = out.into();
        s.handle(Event::SubmitJob {
            id: id.into(),
            spec: Arc::new(sp),
            spec_toml: String::new(),
            docs: docs(10),
            start: None,
        })
        .unwrap();
    };
    submit("ab12-x", "sft", "/o1");
    submit("ab34-y", "dpo", "/o2");
    let c = &s.c;
    assert_eq!(c.resolve_job("ab12-x").unwrap(), "ab12-x");
    assert_eq!(c.resolve_job("dpo").unwrap(), "ab34-y");
    assert_eq!(c.resolve_job("ab3").unwrap(), "ab34-y");
    assert_eq!(
        c.resolve_job("nope"),
        Err(CoreError::JobNotFound("nope".into()))
    );
    let Err(CoreError::AmbiguousJob { candidates, .. }) = c.resolve_job("ab") else {
        panic!("a prefix of two ids is ambiguous");
    };
    assert_eq!(candidates, vec!["ab12-x", "ab34-y"]);
    // A name wins over a prefix; an ended job of that name still answers
    // while no live one has it; two live ones are ambiguous.
    s.handle(Event::CancelJob {
        job: "ab12-x".into(),
    })
    .unwrap();
    assert_eq!(s.c.resolve_job("sft").unwrap(), "ab12-x");
    let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
    sp.job.name = "dpo".into();
    sp.job.output_dir = "/o3".into();
    s.handle(Event::SubmitJob {
        id: "cd56-z".into(),
        spec: Arc::new(sp),
        spec_toml: String::new(),
        docs: docs(10),
        start: None,
    })
    .unwrap();
    assert!(matches!(
        s.c.resolve_job("dpo"),
        Err(CoreError::AmbiguousJob { .. })
    ));
}

/// Issue 33 (8): output directories were compared by spelling; a nested
/// one, or another name for the same, passed while the first was live
/// (and checkpoint pruning could then delete the other job's files).
/// Compared by where they really are (the resolver is the shell's; here
/// `/link` leads to `/o/a`), each is refused naming the live job and both
/// directories; an ended job's directory, or a sibling, is free.
#[test]
fn an_output_dir_nested_in_or_resolving_to_a_live_jobs_is_refused() {
    let mut s = Sim::new();
    let mut sp = spec("steps = 2", "docs_per_step = 4", 1, 1);
    sp.job.output_dir = "/o/a".into();
    s.submit(sp, docs(10));
    let real = |p: &Path| -> PathBuf {
        match p.strip_prefix("/link") {
            Ok(rest) => Path::new("/o/a").join(rest),
            Err(_) => p.to_path_buf(),
        }
    };
    for (dir, nesting) in [
        ("/o/a", Nesting::Same),
        ("/link", Nesting::Same),
        ("/o/a/checkpoints", Nesting::Inside),
        ("/link/x", Nesting::Inside),
        ("/o", Nesting::Contains),
    ] {
        let e =
            s.c.check_output_free("second", Path::new(dir), real)
                .unwrap_err();
        let CoreError::OutputInUse(ref o) = e else {
            panic!("{dir}: {e}");
        };
        let (got, owner, owner_dir) = (o.nesting, &o.owner, &o.owner_dir);
        assert_eq!((got, owner.as_str()), (nesting, "job"), "{dir}");
        assert_eq!(owner_dir, Path::new("/o/a"));
        let msg = e.to_string();
        assert!(msg.contains(dir) && msg.contains("\"second\""), "{msg}");
    }
    s.c.check_output_free("second", Path::new("/o/ab"), real)
        .unwrap();
    s.handle(Event::CancelJob { job: "job".into() }).unwrap();
    s.c.check_output_free("second", Path::new("/o/a/checkpoints"), real)
        .unwrap();
}
