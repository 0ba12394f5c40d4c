//! Replayed annotations, published policies, and step settings changed at run time (`accrue set`).

use super::*;

/// What a replayed plan must carry again per sequence: its advantage and
/// its reference log-prob.
type Scalars = (Option<f64>, Option<f64>);

/// Per document: the (advantage, ref_logp) its sequences carry in a plan,
/// by role.
pub(super) fn scalars_of(p: &PlannedStep) -> BTreeMap<(DocId, u32), Scalars> {
    p.ranks
        .iter()
        .flatten()
        .flat_map(|m| &m.seqs)
        .map(|q| ((q.doc, q.role), (q.advantage, q.ref_logp)))
        .collect()
}

/// The last plan of `step` that was dispatched for real (not a replay).
pub(super) fn committed_plan(s: &Sim, step: u64) -> Arc<PlannedStep> {
    s.plans
        .iter()
        .rev()
        .find(|p| p.step == step && !p.replay && p.kind == PlanKind::Train)
        .unwrap()
        .clone()
}

#[test]
fn replayed_dpo_and_pg_steps_carry_the_same_annotations() {
    let mut pg = with(
        spec("epochs = 1", "docs_per_step = 6", 1, 3),
        Sharding::Fsdp,
        2,
    );
    pg.data.format = crate::job::data::DataFormat::Rollouts;
    pg.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    let mut dpo = dpo_spec("steps = 6");
    dpo.parallel.sharding = Sharding::Fsdp;
    dpo.checkpoint.every_steps = 2;
    for (sp, d, key) in [
        (dpo, pairs(150), "ref_logp"),
        (pg, rollouts(12, 4), "advantage"),
    ] {
        let mut s = Sim::new();
        for w in ["a", "b", "c"] {
            s.worker(w);
        }
        s.submit(sp, d);
        s.run_until(|s| s.committed.len() == 3);
        s.inbox.clear();
        s.kill("c");
        s.run();
        assert_eq!(s.state(), JobState::Completed, "{key}");
        let replayed = s.replayed();
        assert_eq!(replayed.len(), 1, "{key}");
        let r = &replayed[0];
        let original = scalars_of(&committed_plan(&s, r.step));
        let carried = |&(advantage, ref_logp): &Scalars| match key {
            "advantage" => advantage.is_some(),
            _ => ref_logp.is_some(),
        };
        assert!(original.values().any(carried), "{key}");
        assert_eq!(scalars_of(r), original, "{key}: step {}", r.step);
        assert_eq!(r.normalizers, committed_plan(&s, r.step).normalizers);
    }
}

/// `rl.publish_every = 2`: after steps 2 and 4 every member is asked to
/// write the policy to OUTPUT_DIR/policy/step-N, and the watch stream
/// announces each once, after the last member answered.
#[test]
fn pg_publishes_the_policy_every_n_steps_once_all_ranks_wrote_it() {
    let mut s = Sim::new();
    // 15 groups, every third flat: 10 kept groups of 4, 2 groups a step.
    let d = rollouts(15, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 6", 1, 4);
    sp.data.format = crate::job::data::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.rl.publish_every = Some(2);
    s.submit(sp, d);
    s.worker("a");
    s.worker("b");
    // Answer until the first publish request is queued, then check that
    // one member's answer alone announces nothing.
    while s.publish_requests.is_empty() {
        assert!(s.step_once(), "no policy was requested");
    }
    let (first, step, _) = s.publish_requests[0].clone();
    assert_eq!(step, 2);
    let generation = s.c.job("job").unwrap().gen().unwrap().id;
    s.handle(Event::PolicyPublished {
        worker: first.clone(),
        job: "job".into(),
        generation,
        step: 2,
    })
    .unwrap();
    assert!(
        s.events.iter().all(|(k, _)| k != "policy"),
        "{:?}",
        s.events
    );
    s.inbox
        .retain(|(w, m)| !(w == &first && matches!(m, ToWorker::PublishPolicy { .. })));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 5);
    let root = std::path::Path::new("/tmp/accrue-core-test/policy");
    let mut asked: Vec<(String, u64, std::path::PathBuf)> = s.publish_requests.clone();
    asked.sort();
    assert_eq!(
        asked,
        vec![
            ("a".into(), 2, root.join("step-2")),
            ("a".into(), 4, root.join("step-4")),
            ("b".into(), 2, root.join("step-2")),
            ("b".into(), 4, root.join("step-4")),
        ]
    );
    let policy: Vec<&String> = s
        .events
        .iter()
        .filter(|(k, _)| k == "policy")
        .map(|(_, m)| m)
        .collect();
    assert_eq!(
        policy,
        vec![
            "policy of step 2 published to /tmp/accrue-core-test/policy/step-2",
            "policy of step 4 published to /tmp/accrue-core-test/policy/step-4",
        ]
    );
}
// Operator controls: live step settings, and the manifests that record
// what each step ran with.

pub(super) fn set(s: &mut Sim, update: JobUpdate) -> Result<()> {
    s.handle(Event::UpdateJob {
        job: "job".into(),
        update,
    })
}

pub(super) fn universe(d: &[Document]) -> Expectation {
    Expectation {
        universe: d.iter().map(|x| x.id).collect(),
        complete_epochs: 1,
        partial: false,
    }
}

#[test]
fn a_settings_change_applies_from_the_next_step_and_is_in_its_manifest() {
    let mut s = Sim::new();
    let d = docs(40);
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 1), d.clone());
    assert_eq!(s.c.job("job").unwrap().rec.total_steps, 10);
    s.worker("a");
    s.step_once(); // Ready → step 1 in flight
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            lr: Some(0.5),
            max_tokens: Some(100),
            ..Default::default()
        },
    )
    .unwrap();
    let rec = &s.c.job("job").unwrap().rec;
    assert_eq!(rec.changes.len(), 1);
    assert_eq!(rec.changes[0].from_step, 2, "never the in-flight step");
    assert_eq!(
        s.persisted.last().unwrap().changes,
        rec.changes,
        "persisted"
    );
    // 4 docs, then 36 at 6 per step.
    assert_eq!(rec.total_steps, 7);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sizes: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
    assert_eq!(sizes, vec![4, 6, 6, 6, 6, 6, 6]);
    let first = &s.manifests[0];
    assert_eq!(first.settings.docs_per_step(), Some(4));
    assert_eq!(
        (first.settings.max_tokens, first.settings.base_lr),
        (128, 1e-4)
    );
    assert_eq!(first.lr, 1e-4);
    for m in &s.manifests[1..] {
        assert_eq!(m.settings.docs_per_step(), Some(6));
        assert_eq!(
            (m.settings.max_tokens, m.settings.base_lr, m.lr),
            (100, 0.5, 0.5)
        );
        assert!(m.ranks.iter().flatten().all(|mb| mb.tokens <= 100));
    }
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn an_aborted_step_replanned_after_a_change_keeps_its_documents() {
    let mut s = Sim::new();
    let d = docs(30);
    s.worker("a");
    s.worker("b");
    s.submit(spec("epochs = 1", "docs_per_step = 4", 1, 2), d.clone());
    s.step_once();
    s.step_once(); // both ready → step 1 in flight
    let first_docs = s.plans[0].docs.clone();
    s.inbox.clear();
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(6),
            ..Default::default()
        },
    )
    .unwrap();
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(
        s.committed[0].1, first_docs,
        "the re-plan took the same documents"
    );
    let m = &s.manifests[0];
    assert_eq!(
        (m.step, m.attempts, m.world_size, m.generation),
        (1, 2, 1, 2)
    );
    assert_eq!(m.settings.docs_per_step(), Some(4));
    assert!(s.manifests[1..].iter().all(|m| m.attempts == 1));
    assert_eq!(s.committed[1].0.docs, 6);
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_bad_or_misplaced_update_is_refused_and_changes_nothing() {
    let mut s = Sim::new();
    s.submit(spec("steps = 2", "docs_per_step = 4", 1, 1), docs(20));
    let before = s.persisted.len();
    let e = set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(0),
            tokens_per_step: Some(10),
            ..Default::default()
        },
    )
    .unwrap_err();
    let CoreError::InvalidUpdate { problems, .. } = &e else {
        panic!("{e}");
    };
    let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(fields, vec!["batch.docs_per_step", "batch.tokens_per_step"]);
    assert!(
        e.to_string()
            .contains("batch.docs_per_step: must be at least 1"),
        "{e}"
    );
    let e = set(
        &mut s,
        JobUpdate {
            max_tokens: Some(10),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("data.max_tokens: document 0:"),
        "{e}"
    );
    assert!(s.c.job("job").unwrap().rec.changes.is_empty());
    assert_eq!(s.persisted.len(), before, "nothing persisted");
    let unknown = s.handle(Event::UpdateJob {
        job: "nope".into(),
        update: JobUpdate {
            lr: Some(1.0),
            ..Default::default()
        },
    });
    assert!(matches!(unknown, Err(CoreError::JobNotFound(_))));
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let late = set(
        &mut s,
        JobUpdate {
            lr: Some(1.0),
            ..Default::default()
        },
    );
    assert!(
        matches!(late, Err(CoreError::BadJobState { .. })),
        "{late:?}"
    );
}

#[test]
fn settings_changes_survive_a_coordinator_restart() {
    let mut s = Sim::new();
    s.submit(spec("steps = 4", "docs_per_step = 4", 1, 1), docs(30));
    s.worker("a");
    s.step_once();
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(5),
            lr: Some(0.25),
            ..Default::default()
        },
    )
    .unwrap();
    s.step_once(); // step 1 commits, step 2 is dispatched with the change
    let rec = s.persisted.last().unwrap().clone();
    assert_eq!(rec.step, 1);
    let history = s
        .committed
        .iter()
        .map(|(m, d)| super::CommittedStep {
            step: m.step,
            lr: m.lr,
            docs: d.clone().into(),
            cursor_after: m.cursor.clone(),
        })
        .collect();
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec),
        spec: Arc::new(spec("steps = 4", "docs_per_step = 4", 1, 1)),
        docs: docs(30),
        reference: Default::default(),
        history,
    })
    .unwrap();
    r.worker("z");
    r.after_rejoin_grace(); // the old member never comes back
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    assert_eq!(r.manifests.len(), 3);
    assert!(r
        .manifests
        .iter()
        .all(|m| m.settings.docs_per_step() == Some(5) && m.lr == 0.25));
}

#[test]
fn a_warmup_schedule_continues_with_the_new_base_lr() {
    let mut sp = spec("steps = 6", "docs_per_step = 2", 1, 1);
    sp.optimizer.warmup_steps = 4;
    sp.optimizer.lr = 1.0;
    let mut s = Sim::new();
    s.submit(sp, docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight at lr 0.25
    set(
        &mut s,
        JobUpdate {
            lr: Some(2.0),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    let lrs: Vec<f64> = s.manifests.iter().map(|m| m.lr).collect();
    assert_eq!(lrs, vec![0.25, 1.0, 1.5, 2.0, 2.0, 2.0]);
}

#[test]
fn drain_during_a_step_aborts_nothing_and_the_next_generation_is_smaller() {
    let mut s = Sim::new();
    let d = docs(24);
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(spec("epochs = 1", "docs_per_step = 6", 1, 3), d.clone());
    for _ in 0..3 {
        s.step_once(); // all ready → step 1 in flight
    }
    s.handle(Event::DrainWorker { worker: "c".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.aborts, vec![], "a drain aborts nothing");
    let shape: Vec<(u64, u32, u32)> = s
        .manifests
        .iter()
        .map(|m| (m.generation, m.world_size, m.attempts))
        .collect();
    assert_eq!(shape, vec![(1, 3, 1), (2, 2, 1), (2, 2, 1), (2, 2, 1)]);
    assert!(s
        .manifests
        .iter()
        .all(|m| m.ranks.len() == m.world_size as usize));
    assert_eq!(check_exactly_once(&s.manifests, 1, &universe(&d)), vec![]);
}

#[test]
fn a_paused_job_dispatches_nothing_until_resumed() {
    let mut s = Sim::new();
    s.submit(spec("steps = 3", "docs_per_step = 4", 1, 2), docs(20));
    s.worker("a");
    s.step_once(); // step 1 in flight
    s.handle(Event::PauseJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Paused);
    let plans = s.plans.len();
    // Time passes, a worker joins, an operator changes a setting: still
    // nothing is dispatched.
    s.now += 1_000;
    s.handle(heartbeat("a".into())).unwrap();
    s.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    s.worker("b");
    set(
        &mut s,
        JobUpdate {
            docs_per_step: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    assert_eq!(s.plans.len(), plans, "no plan while paused");
    assert_eq!(s.state(), JobState::Paused);
    assert_eq!(s.c.job("job").unwrap().rec.changes[0].from_step, 2);
    s.handle(Event::ResumeJob { job: "job".into() }).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let sizes: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
    assert_eq!(sizes, vec![4, 2, 2]);
}

#[test]
fn a_result_from_an_older_generation_changes_nothing() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(spec("steps = 2", "docs_per_step = 6", 1, 4), docs(30));
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    s.inbox.clear();
    // b dies with step 1 of generation 1 in flight: generation 2 forms.
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    let before = (
        s.inbox.len(),
        s.persisted.len(),
        s.c.job("job").unwrap().rec.clone(),
    );
    assert_eq!(before.2.generation, 2);
    // a's answer to generation 1's plan arrives late: it is ignored.
    s.handle(Event::StepResult {
        worker: "a".into(),
        job: "job".into(),
        generation: 1,
        step: 1,
        sums: MetricSums {
            loss_sum: 1.0,
            loss_tokens: 1,
            ..Default::default()
        },
        logps: Vec::new(),
        nonfinite: Vec::new(),
    })
    .unwrap();
    assert!(s.committed.is_empty());
    assert_eq!((s.inbox.len(), s.persisted.len()), (before.0, before.1));
    let after = &s.c.job("job").unwrap().rec;
    assert_eq!(
        (after.step, after.generation),
        (before.2.step, before.2.generation)
    );
    assert_eq!(after.cursor, before.2.cursor);
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].0.world_size, 1, "step 1 ran in generation 2");
}
