//! DPO and policy-gradient jobs: the cached reference pass, whole rollout groups, the KL pass.

use super::*;

pub(super) fn pairs(n: usize) -> Arc<[Document]> {
    let seq = |len: usize| Sequence::new(vec![7; len], vec![7; len]);
    (0..n)
        .map(|i| Document {
            id: DocId {
                file: 0,
                line: i as u64 + 1,
            },
            body: DocBody::Pair {
                chosen: seq(5 + (i * 13) % 40),
                rejected: seq(3 + (i * 29) % 50),
            },
        })
        .collect::<Vec<_>>()
        .into()
}

pub(super) fn dpo_spec(extra_job: &str) -> JobSpec {
    let mut s = spec(extra_job, "docs_per_step = 8", 1, 4);
    s.data.format = crate::job::data::DataFormat::Dpo;
    s.objective.kind = crate::job::objective::ObjectiveKind::Dpo;
    s
}

#[test]
fn dpo_reference_pass_runs_first_and_training_plans_carry_its_logps() {
    let mut s = Sim::new();
    let d = pairs(150);
    s.submit(dpo_spec("steps = 3"), d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Every pair cached exactly as the workers reported it.
    assert_eq!(s.stored_ref.len(), d.len());
    for doc in d.iter() {
        assert_eq!(
            s.stored_ref[&doc.id],
            RefEntry::Pair([fake_logp(doc.id, 0), fake_logp(doc.id, 1)])
        );
    }
    let kinds: Vec<PlanKind> = s.plans.iter().map(|p| p.kind).collect();
    let first_train = kinds.iter().position(|&k| k == PlanKind::Train).unwrap();
    assert!(first_train >= 1, "reference chunks come first: {kinds:?}");
    assert!(kinds[first_train..].iter().all(|&k| k == PlanKind::Train));
    // Training steps are numbered from 1 and carry ref_logp per sequence.
    assert_eq!(s.committed.len(), 3);
    assert_eq!(s.committed[0].0.step, 1);
    for p in &s.plans[first_train..] {
        for q in p.ranks.iter().flatten().flat_map(|m| &m.seqs) {
            let got = q.ref_logp.unwrap();
            assert_eq!(got, fake_logp(q.doc, q.role));
        }
    }
}

#[test]
fn dpo_reference_pass_resumes_from_the_store_and_survives_a_lost_worker() {
    let mut s = Sim::new();
    let d = pairs(150);
    s.submit(dpo_spec("steps = 2"), d.clone());
    s.worker("a");
    s.worker("b");
    // Run until the first chunk is cached, then kill a worker mid-chunk.
    while s.stored_ref.is_empty() {
        assert!(s.step_once());
    }
    let cached = s.stored_ref.clone();
    assert!(cached.len() < d.len());
    s.dead.push("b".into());
    s.handle(Event::SessionClosed { worker: "b".into() })
        .unwrap();
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(s.stored_ref.len(), d.len());

    // A restarted coordinator with a partial cache plans only the rest.
    let rec = s.c.job("job").unwrap().rec.clone();
    let mut r = Sim::new();
    let mut rec0 = rec.clone();
    rec0.state = JobState::Running;
    rec0.step = 0;
    rec0.cursor = Default::default();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec0),
        spec: Arc::new(dpo_spec("steps = 2")),
        docs: d.clone(),
        reference: cached.clone(),
        history: Vec::new(),
    })
    .unwrap();
    r.worker("z");
    r.after_rejoin_grace(); // the old members never come back
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    let planned_again: Vec<DocId> = r
        .plans
        .iter()
        .filter(|p| p.kind == PlanKind::Reference)
        .flat_map(|p| p.docs.clone())
        .collect();
    assert_eq!(planned_again.len(), d.len() - cached.len());
    assert!(planned_again.iter().all(|id| !cached.contains_key(id)));

    // A complete cache skips the pass.
    let mut q = Sim::new();
    let mut rec1 = rec;
    rec1.state = JobState::Running;
    rec1.step = 0;
    rec1.cursor = Default::default();
    q.handle(Event::RestoreJob {
        rec: Box::new(rec1),
        spec: Arc::new(dpo_spec("steps = 2")),
        docs: d,
        reference: s.stored_ref.clone(),
        history: Vec::new(),
    })
    .unwrap();
    q.worker("y");
    q.after_rejoin_grace(); // the old members never come back
    q.run();
    assert!(q.plans.iter().all(|p| p.kind == PlanKind::Train));
    assert_eq!(q.committed.len(), 2);
}

pub(super) fn rollouts(groups: usize, size: usize) -> Arc<[Document]> {
    let mut out = Vec::new();
    for g in 0..groups {
        for k in 0..size {
            let line = (out.len() + 1) as u64;
            // Every third group has equal rewards (no signal).
            let reward = if g % 3 == 2 { 1.0 } else { k as f64 };
            out.push(Document {
                id: DocId { file: 0, line },
                body: DocBody::Rollout(crate::stream::doc::Rollout {
                    routing: Default::default(),
                    seq: Sequence::new(
                        vec![7; 6 + (line as usize * 7) % 30],
                        vec![7; 6 + (line as usize * 7) % 30],
                    ),
                    reward,
                    group: format!("g{g}"),
                    policy_version: 0,
                    old_logprobs: None,
                }),
            });
        }
    }
    out.into()
}

#[test]
fn pg_steps_take_whole_groups_and_train_every_kept_rollout_once() {
    let mut s = Sim::new();
    let d = rollouts(9, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 6", 1, 4);
    sp.data.format = crate::job::data::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    s.submit(sp, d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let group_of = |id: &DocId| (id.line - 1) / 4;
    let mut seen = Vec::new();
    for (m, docs) in &s.committed {
        // Whole groups only: every group present has all 4 rollouts.
        let mut counts = BTreeMap::new();
        for id in docs {
            *counts.entry(group_of(id)).or_insert(0) += 1;
        }
        assert!(
            counts.values().all(|&c| c == 4),
            "step {}: {counts:?}",
            m.step
        );
        assert!(docs.len() >= 6 || m.step == s.committed.len() as u64);
        assert_eq!(m.extra["count/zero_variance_groups"], 3.0);
        assert_eq!(m.extra["staleness/max"], (m.step - 1) as f64);
        seen.extend(docs.iter().copied());
    }
    seen.sort();
    let kept: Vec<DocId> = d
        .iter()
        .filter(|doc| group_of(&doc.id) % 3 != 2)
        .map(|doc| doc.id)
        .collect();
    assert_eq!(
        seen, kept,
        "each kept rollout exactly once, flat groups never"
    );
    for p in &s.plans {
        for q in p.ranks.iter().flatten().flat_map(|m| &m.seqs) {
            assert!(q.advantage.is_some());
        }
    }
}

#[test]
fn pg_kl_with_a_cached_reference_runs_a_per_token_pass_first_and_plans_carry_it() {
    let mut s = Sim::new();
    let d = rollouts(9, 4);
    let mut sp = spec("epochs = 1", "docs_per_step = 8", 1, 4);
    sp.data.format = crate::job::data::DataFormat::Rollouts;
    sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
    sp.objective.kl_coef = Some(0.05);
    s.submit(sp, d.clone());
    s.worker("a");
    s.worker("b");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    // Every rollout (flat groups too: the pass runs before grouping
    // matters) cached with one log-prob per token, as reported.
    assert_eq!(s.stored_ref.len(), d.len());
    for doc in d.iter() {
        let want: Vec<f32> = (0..doc.tokens() as usize)
            .map(|j| fake_token_logp(doc.id, j))
            .collect();
        assert_eq!(s.stored_ref[&doc.id], RefEntry::Tokens(want.into()));
    }
    let first_train = s
        .plans
        .iter()
        .position(|p| p.kind == PlanKind::Train)
        .unwrap();
    assert!(first_train >= 1, "the reference pass comes first");
    // Training rows carry each sequence's reference log-probs, aligned
    // with the tokens, and no DPO scalar.
    let mut rows = 0;
    for p in &s.plans[first_train..] {
        assert_eq!(p.kind, PlanKind::Train);
        for m in p.ranks.iter().flatten().filter(|m| !m.seqs.is_empty()) {
            let ref_logprobs = m.ref_logprobs();
            assert_eq!(ref_logprobs.len() as u64, m.tokens());
            for (q, w) in m.seqs.iter().zip(m.cu_seq_lens.windows(2)) {
                let got = &ref_logprobs[w[0] as usize..w[1] as usize];
                let want: Vec<f32> = (0..got.len()).map(|j| fake_token_logp(q.doc, j)).collect();
                assert_eq!(got, want.as_slice(), "{}", q.doc);
                assert!(q.ref_logp.is_none());
            }
            rows += 1;
        }
    }
    assert!(rows > 0);
}

#[test]
fn pg_without_kl_or_with_a_live_reference_needs_no_pass() {
    for (kl, reference) in [
        (0.0, None),
        (0.05, Some(crate::job::objective::Reference::Live)),
    ] {
        let mut s = Sim::new();
        let mut sp = spec("epochs = 1", "docs_per_step = 8", 1, 4);
        sp.data.format = crate::job::data::DataFormat::Rollouts;
        sp.objective.kind = crate::job::objective::ObjectiveKind::Pg;
        sp.objective.kl_coef = Some(kl);
        sp.objective.reference = reference;
        s.submit(sp, rollouts(3, 4));
        s.worker("a");
        s.run();
        assert_eq!(s.state(), JobState::Completed);
        assert!(s.plans.iter().all(|p| p.kind == PlanKind::Train));
        assert!(s.stored_ref.is_empty());
        let mbs = s.plans.iter().flat_map(|p| p.ranks.iter().flatten());
        assert!(mbs.into_iter().all(|m| m.ref_logprobs().is_empty()));
    }
}
