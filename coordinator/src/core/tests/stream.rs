//! Scenario tests of streamed policy-gradient jobs (`data.source =
//! "stream"`): rollouts pushed as events, groups trained exactly once,
//! backpressure, aborts and restarts.

use super::*;

pub(super) fn stream_spec(steps: &str, docs_per_step: u64, group: u32, capacity: u64) -> JobSpec {
    let mut sp = spec(steps, &format!("docs_per_step = {docs_per_step}"), 1, 4);
    sp.data.train.clear();
    sp.data.source = crate::job::data::DataSource::Stream;
    sp.data.format = crate::job::data::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.rl.group_size = Some(group);
    sp.rl.queue_capacity = Some(capacity);
    sp
}

pub(super) fn rollout(group: &str, reward: f64, version: u64) -> Rollout {
    let len = 6 + group.len() * 3;
    Rollout {
        routing: Default::default(),
        seq: Sequence::new(vec![7; len], vec![7; len]),
        reward,
        group: group.into(),
        policy_version: version,
        old_logprobs: None,
    }
}

/// `n` complete groups of 2 with a reward spread, named `{tag}{i}`.
pub(super) fn groups(tag: &str, n: usize, version: u64) -> Vec<Rollout> {
    (0..n)
        .flat_map(|i| {
            let g = format!("{tag}{i}");
            [rollout(&g, 0.0, version), rollout(&g, 1.0, version)]
        })
        .collect()
}

impl Sim {
    /// A fresh coordinator that restored a streamed job as a restart does:
    /// its record and spec, then its stored rollouts.
    pub(crate) fn restored_stream(
        rec: super::record::JobRecord,
        spec: JobSpec,
        stored: StoredStream,
    ) -> Sim {
        let mut r = Sim::new();
        r.handle(Event::RestoreJob {
            rec: Box::new(rec),
            spec: Arc::new(spec),
            docs: Vec::new().into(),
            reference: Default::default(),
            history: Vec::new(),
        })
        .unwrap();
        r.handle(Event::RestoreRollouts {
            job: "job".into(),
            stored,
        })
        .unwrap();
        r
    }

    pub(super) fn push(&mut self, rollouts: Vec<Rollout>) -> Result<AdmitCounts> {
        let before = self.rollout_writes.len();
        self.handle(Event::PushRollouts {
            job: "job".into(),
            rollouts,
        })?;
        Ok(self.rollout_writes[before..]
            .iter()
            .find_map(|w| w.counts)
            .expect("an admitted push is persisted with its counts"))
    }

    pub(super) fn stream(&self) -> &RolloutStream {
        self.c.job("job").unwrap().data.stream.as_ref().unwrap()
    }

    /// Rollouts the job's next step takes.
    pub(super) fn need(&self) -> u64 {
        let j = self.c.job("job").unwrap();
        j.settings().rollouts_needed(j.rec.step + 1)
    }

    pub(super) fn submit_stream(&mut self, spec: JobSpec) {
        self.submit(spec, Vec::new().into());
    }

    /// The rollouts the store would hold after every write so far, minus
    /// the writes listed in `lost` (indices into `rollout_writes`).
    pub(crate) fn stored(&self, lost: &[usize]) -> StoredStream {
        let mut meta = StreamMeta::default();
        let mut rows: BTreeMap<u64, Document> = BTreeMap::new();
        for (i, w) in self.rollout_writes.iter().enumerate() {
            if lost.contains(&i) {
                continue;
            }
            for d in &w.admit {
                rows.insert(d.id.line, d.clone());
            }
            for id in &w.remove {
                rows.remove(&id.line);
            }
            meta = w.meta;
        }
        StoredStream {
            meta,
            rollouts: rows.into_values().collect(),
        }
    }
}

pub(super) fn group_of(s: &Sim, id: &DocId) -> String {
    // Every admitted rollout is in some write's `admit`.
    s.rollout_writes
        .iter()
        .flat_map(|w| &w.admit)
        .find(|d| d.id == *id)
        .map(|d| match &d.body {
            DocBody::Rollout(r) => r.group.clone(),
            _ => unreachable!(),
        })
        .expect("a trained doc was admitted")
}

#[test]
fn streamed_groups_are_trained_exactly_once_and_incomplete_groups_wait() {
    let mut s = Sim::new();
    let mut sp = stream_spec("steps = 3", 4, 2, 100);
    sp.rl.max_staleness = Some(1);
    s.submit_stream(sp);
    s.worker("a");
    s.run();
    let job = s.c.job("job").unwrap();
    assert_eq!(job.rec.state, JobState::Running);
    assert_eq!(job.rec.reason, "waiting for rollouts: have 0 of 4");

    // One complete group and one half group: not a step yet.
    let c = s
        .push(vec![
            rollout("a", 0.0, 0),
            rollout("a", 1.0, 0),
            rollout("b", 0.5, 0),
        ])
        .unwrap();
    assert_eq!((c.accepted, c.queued), (3, 3));
    s.run();
    assert!(s.plans.is_empty(), "an incomplete group is never planned");
    assert_eq!(
        s.c.job("job").unwrap().rec.reason,
        "waiting for rollouts: have 2 of 4"
    );
    // "b" completes; "z" has equal rewards and is dropped when complete.
    let c = s
        .push(vec![
            rollout("z", 1.0, 0),
            rollout("b", 0.0, 0),
            rollout("z", 1.0, 0),
        ])
        .unwrap();
    assert_eq!(
        (c.accepted, c.zero_variance_groups, c.zero_variance_dropped),
        (3, 1, 2)
    );
    s.run();
    assert_eq!(s.committed.len(), 1);
    assert_eq!(
        s.c.job("job").unwrap().rec.reason,
        "waiting for rollouts: have 0 of 4"
    );

    // Step 1 committed: policy 0 is now one step old (admitted), a rollout
    // claiming policy 5 is from the future (rejected, counted).
    let mut more = groups("c", 4, 0);
    more.push(rollout("c0", 3.0, 5));
    let c = s.push(more).unwrap();
    assert_eq!((c.accepted, c.rejected_stale), (8, 1));
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 3);

    let mut seen = Vec::new();
    for (m, docs) in &s.committed {
        let mut per_group: BTreeMap<String, usize> = BTreeMap::new();
        for id in docs {
            *per_group.entry(group_of(&s, id)).or_default() += 1;
        }
        assert!(
            per_group.values().all(|&n| n == 2),
            "whole groups: {per_group:?}"
        );
        assert_eq!(docs.len(), 4, "docs_per_step = 4 in groups of 2");
        assert_eq!(m.extra["count/zero_variance_groups"], 1.0);
        assert_eq!(
            m.extra["count/rejected_stale"],
            if m.step == 1 { 0.0 } else { 1.0 }
        );
        assert_eq!(m.extra["staleness/max"], (m.step - 1) as f64);
        seen.extend(docs.iter().copied());
    }
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "no rollout trained twice");
    assert!(!seen.iter().any(|id| group_of(&s, id) == "z"));
    let groups_trained: std::collections::BTreeSet<String> =
        seen.iter().map(|id| group_of(&s, id)).collect();
    assert_eq!(
        groups_trained.into_iter().collect::<Vec<_>>(),
        ["a", "b", "c0", "c1", "c2", "c3"]
    );
    // The trained rollouts left the queue and the store; one group is left.
    assert_eq!(s.stream().queued_groups(), 0);
    let stored = s.stored(&[]);
    assert!(stored.rollouts.is_empty(), "{:?}", stored.rollouts);
    for p in &s.plans {
        for q in p.ranks.iter().flatten().flat_map(|m| &m.seqs) {
            assert!(q.advantage.is_some());
        }
    }
}

#[test]
fn a_full_queue_refuses_pushes_until_a_commit_frees_room() {
    let mut s = Sim::new();
    s.submit_stream(stream_spec("steps = 5", 2, 2, 4));
    s.push(groups("a", 2, 0)).unwrap();
    let writes = s.rollout_writes.len();
    let err = s.push(groups("b", 1, 0)).unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::QueueFull {
                buffered: 4,
                capacity: 4,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(s.stream().buffered(), 4, "a refused push changes nothing");
    assert_eq!(s.rollout_writes.len(), writes);
    assert!(!s.stream().has_room(1, s.need()));

    // A worker comes; the first commit frees a group's room.
    s.worker("w");
    while s.committed.is_empty() {
        assert!(s.step_once(), "the job trains a step");
    }
    assert!(s.stream().has_room(2, s.need()));
    let c = s.push(groups("b", 1, 0)).unwrap();
    assert_eq!(c.accepted, 2);

    // Cancelling ends pushes with the job's state.
    s.handle(Event::CancelJob { job: "job".into() }).unwrap();
    let err = s.push(groups("c", 1, 0)).unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
}

#[test]
fn filling_groups_never_deadlock_a_full_queue() {
    // Capacity taken by groups that are not complete: no commit could ever
    // free room, so pushes are let through rather than waiting forever.
    let mut s = Sim::new();
    s.submit_stream(stream_spec("steps = 1", 2, 2, 2));
    s.push(vec![rollout("a", 0.0, 0), rollout("b", 0.0, 0)])
        .unwrap();
    let c = s
        .push(vec![rollout("c", 0.0, 0), rollout("a", 1.0, 0)])
        .unwrap();
    assert_eq!((c.accepted, c.queued), (2, 4));
    assert!(s.stream().step_ready(s.need()));
    assert!(matches!(
        s.push(vec![rollout("b", 1.0, 0)]),
        Err(CoreError::QueueFull { .. })
    ));
}

#[test]
fn pushes_to_a_job_that_does_not_stream_are_refused() {
    let mut s = Sim::new();
    s.submit(spec("steps = 1", "docs_per_step = 2", 1, 1), docs(4));
    let err = s.push(groups("a", 1, 0)).unwrap_err();
    assert_eq!(err, CoreError::NotStreamed("job".into()));
    let err = s
        .handle(Event::PushRollouts {
            job: "nope".into(),
            rollouts: Vec::new(),
        })
        .unwrap_err();
    assert_eq!(err, CoreError::JobNotFound("nope".into()));
}

#[test]
fn an_aborted_streamed_step_replans_the_same_groups() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit_stream(stream_spec("steps = 2", 4, 2, 100));
    s.push(groups("g", 3, 0)).unwrap();
    while let Some((_, ToWorker::Configure { .. })) = s.inbox.front() {
        s.step_once();
    }
    let first = s.plans.last().expect("step 1 planned").clone();
    s.inbox.clear();
    // More groups arrive while the step is in flight; then a worker dies.
    s.push(groups("h", 2, 0)).unwrap();
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed[0].1, first.docs, "the same groups, re-planned");
    let all: Vec<DocId> = s.committed.iter().flat_map(|(_, d)| d.clone()).collect();
    let mut unique = all.clone();
    unique.sort();
    unique.dedup();
    assert_eq!((all.len(), unique.len()), (8, 8));
    assert_eq!(s.stream().queued_groups(), 1, "one group left for later");
}

#[test]
fn a_restart_keeps_every_acknowledged_rollout_and_trains_none_twice() {
    // `lose_delete`: the crash fell between the commit record and the
    // deletion of the committed group's rollouts.
    for lose_delete in [false, true] {
        let mut s = Sim::new();
        s.submit_stream(stream_spec("steps = 4", 2, 2, 100));
        s.worker("a");
        s.push(groups("g", 3, 0)).unwrap();
        s.push(vec![rollout("half", 0.0, 0)]).unwrap();
        while s.committed.is_empty() {
            assert!(s.step_once());
        }
        let delete = s.rollout_writes.len() - 1;
        assert!(!s.rollout_writes[delete].remove.is_empty());
        let lost: &[usize] = if lose_delete { &[delete] } else { &[] };
        let stored = s.stored(lost);
        assert_eq!(stored.rollouts.len(), if lose_delete { 7 } else { 5 });
        let rec = s.persisted.last().unwrap().clone();
        let trained_before = s.committed[0].1.clone();

        let mut r = Sim::restored_stream(rec, stream_spec("steps = 4", 2, 2, 100), stored);
        assert_eq!(r.stream().queued_groups(), 2, "lose_delete = {lose_delete}");
        assert_eq!(r.stream().buffered(), 5);
        // The worker comes back holding step 1 in memory (issue 6): no
        // restore, no replay (a streamed group left the queue once trained).
        let held = s.c.worker("a").unwrap().held.clone();
        assert_eq!(held.as_ref().map(|h| h.step), Some(1));
        r.worker_holding("a", held);
        r.run();
        assert!(r.replayed().is_empty());
        assert_eq!(r.committed.len(), 2);
        // The half group completes after the restart; ids continue.
        let c = r.push(vec![rollout("half", 1.0, 2)]).unwrap();
        assert_eq!(c.accepted, 1);
        let new_line = r.rollout_writes.last().unwrap().admit[0].id.line;
        assert_eq!(new_line, 8, "admission numbers are never reused");
        r.run();
        assert_eq!(r.state(), JobState::Completed);
        let mut all = trained_before;
        all.extend(r.committed.iter().flat_map(|(_, d)| d.clone()));
        let lines: Vec<u64> = {
            let mut l: Vec<u64> = all.iter().map(|d| d.line).collect();
            l.sort();
            l
        };
        assert_eq!(
            lines,
            [1, 2, 3, 4, 5, 6, 7, 8],
            "lose_delete = {lose_delete}"
        );
        // The owed deletion was written with the next write.
        let removed: Vec<u64> = r
            .rollout_writes
            .iter()
            .flat_map(|w| w.remove.iter().map(|d| d.line))
            .collect();
        for line in 1..=2 {
            assert_eq!(
                removed.contains(&line),
                lose_delete,
                "line {line} (lose_delete = {lose_delete})"
            );
        }
    }
}

/// Regression (issue 13): a streamed job accepted `accrue set
/// --docs-per-step`, kept planning the submitted size, and its manifests
/// recorded the new one. The change is honoured from the next step, and
/// each manifest records the size its step ran with.
#[test]
fn a_streamed_job_honours_a_docs_per_step_change_and_its_manifest_says_so() {
    let mut s = Sim::new();
    s.submit_stream(stream_spec("steps = 3", 2, 2, 100));
    s.worker("w");
    s.push(groups("a", 1, 0)).unwrap();
    s.run_until(|s| s.committed.len() == 1);
    s.handle(Event::UpdateJob {
        job: "job".into(),
        update: crate::job::settings::JobUpdate {
            docs_per_step: Some(4),
            ..Default::default()
        },
    })
    .unwrap();
    // One group is not a step of 4 any more: the job waits for a second.
    s.push(groups("b", 1, 0)).unwrap();
    s.run();
    assert_eq!(s.committed.len(), 1, "2 of 4 rollouts queued: no step yet");
    assert!(s.c.job("job").unwrap().rec.reason.contains("have 2 of 4"));
    s.push(groups("c", 3, 0)).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let docs: Vec<u64> = s.committed.iter().map(|(m, _)| m.docs).collect();
    assert_eq!(docs, vec![2, 4, 4]);
    let recorded: Vec<Option<u64>> = s
        .manifests
        .iter()
        .map(|m| m.settings.docs_per_step())
        .collect();
    assert_eq!(recorded, vec![Some(2), Some(4), Some(4)]);
    for (m, (metrics, _)) in s.manifests.iter().zip(&s.committed) {
        assert_eq!(m.docs().len() as u64, metrics.docs, "step {}", m.step);
    }
}

/// A step size the queue can never hold is refused, naming the field.
#[test]
fn a_streamed_job_refuses_a_step_larger_than_its_queue() {
    let mut s = Sim::new();
    s.submit_stream(stream_spec("steps = 3", 2, 2, 8));
    let err = s
        .handle(Event::UpdateJob {
            job: "job".into(),
            update: crate::job::settings::JobUpdate {
                docs_per_step: Some(9),
                ..Default::default()
            },
        })
        .unwrap_err();
    assert!(err.to_string().contains("rl.queue_capacity = 8"), "{err}");
    assert!(s.c.job("job").unwrap().rec.changes.is_empty());
}

/// Regression (issue 32, bug 2): pushed rollouts were checked against the
/// submitted `data.max_tokens`, not the live setting: after `accrue set
/// --max-tokens 16` a 24-token rollout was admitted and the next plan
/// failed the whole job. It is refused at the push, naming the rollout
/// and the live limit, and the job trains on.
#[test]
fn a_push_longer_than_the_live_max_tokens_is_refused_and_the_job_goes_on() {
    let mut s = Sim::new();
    s.submit_stream(stream_spec("steps = 2", 2, 2, 100));
    s.worker("w");
    s.handle(Event::UpdateJob {
        job: "job".into(),
        update: crate::job::settings::JobUpdate {
            max_tokens: Some(16),
            ..Default::default()
        },
    })
    .unwrap();
    // Group "long0" makes 6 + 5·3 = 21-token rollouts: within the
    // submitted 128, over the live 16.
    let err = s.push(groups("long", 1, 0)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("rollouts[0]"), "{msg}");
    assert!(msg.contains("21 tokens"), "{msg}");
    assert!(msg.contains("data.max_tokens = 16"), "{msg}");
    assert!(s.stream().groups().next().is_none(), "nothing was admitted");
    // Rollouts that fit are admitted and trained.
    s.push(groups("a", 2, 0)).unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.committed.len(), 2);
}
