//! Rollouts as a policy-gradient job's stream (issue 5): rollouts are
//! admitted (staleness), grouped (same prompt), given group-relative
//! advantages, and groups whose rewards are all equal are dropped before
//! planning — each counted, none silently. The stream's unit is a GROUP: the
//! cursor permutes groups, so a group never straddles two steps, while
//! `docs_per_step` still counts rollouts (a step takes whole groups until it
//! holds at least that many).

use std::collections::{BTreeMap, HashMap};

use crate::job::objective::PgParams;
use crate::rl::pg;
use crate::stream::cursor::Selection;
use crate::stream::doc::{DocBody, DocId, Document};
use crate::stream::plan::StepTarget;

/// A PG job's groups and advantages, computed once from its documents.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RolloutPlan {
    /// Kept groups in first-appearance order: indices into the job's docs.
    pub units: Vec<Vec<u32>>,
    /// Advantage of every kept rollout.
    pub advantage: HashMap<DocId, f64>,
    pub zero_variance_groups: u64,
    pub zero_variance_rollouts: u64,
    /// Rollouts refused at admission (too stale, or from a future policy).
    pub rejected_stale: u64,
}

impl RolloutPlan {
    pub fn rollouts(&self) -> usize {
        self.units.iter().map(Vec::len).sum()
    }
}

/// Groups `docs` (rollouts), admits them at committed step `step` under
/// `max_staleness`, and computes advantages.
pub fn prepare(
    docs: &[Document],
    pg: &PgParams,
    max_staleness: Option<u64>,
    step: u64,
) -> RolloutPlan {
    let mut plan = RolloutPlan::default();
    let mut groups: Vec<Vec<u32>> = Vec::new();
    let mut index: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, d) in docs.iter().enumerate() {
        let DocBody::Rollout(r) = &d.body else {
            continue;
        };
        if pg::admit(r.policy_version, step, max_staleness).is_err() {
            plan.rejected_stale += 1;
            continue;
        }
        let g = *index.entry(r.group.as_str()).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i as u32);
    }
    for members in groups {
        let rewards: Vec<f64> = members
            .iter()
            .map(|&i| match &docs[i as usize].body {
                DocBody::Rollout(r) => r.reward,
                _ => unreachable!("only rollouts are grouped"),
            })
            .collect();
        match pg::group_advantages(&rewards, pg.scale_by_std, pg.advantage_eps) {
            Some(adv) => {
                for (&i, a) in members.iter().zip(adv) {
                    plan.advantage.insert(docs[i as usize].id, a);
                }
                plan.units.push(members);
            }
            None => {
                plan.zero_variance_groups += 1;
                plan.zero_variance_rollouts += members.len() as u64;
            }
        }
    }
    plan
}

/// Chooses whole groups offered in order, each given as (tokens, rollouts):
/// `Docs(n)` takes groups until the step holds ≥ n rollouts; `Tokens(t)`
/// takes groups while the step stays ≤ t tokens (the first always).
/// Static microbatch targets are refused by spec validation for PG jobs.
pub fn select_groups(target: StepTarget, groups: impl Iterator<Item = (u64, u64)>) -> Selection {
    let mut consumed = 0;
    let (mut tokens, mut rollouts) = (0u64, 0u64);
    let mut groups = groups.peekable();
    while let Some(&(t, n)) = groups.peek() {
        let full = match target {
            StepTarget::Docs(want) => rollouts >= want,
            StepTarget::Tokens(want) => consumed > 0 && tokens.saturating_add(t) > want,
            StepTarget::MicrobatchesPerRank { .. } => consumed > 0,
        };
        if full {
            break;
        }
        groups.next();
        tokens = tokens.saturating_add(t);
        rollouts += n;
        consumed += 1;
    }
    Selection {
        taken: (0..consumed).collect(),
        consumed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::doc::{Rollout, Sequence};

    fn rollout(line: u64, group: &str, reward: f64, version: u64) -> Document {
        Document {
            id: DocId { file: 0, line },
            body: DocBody::Rollout(Rollout {
                routing: Default::default(),
                seq: Sequence::new(vec![1; 4], vec![1; 4]),
                reward,
                group: group.into(),
                policy_version: version,
                old_logprobs: None,
            }),
        }
    }

    fn pg() -> PgParams {
        crate::job::objective::ObjectiveSection {
            kind: crate::job::objective::ObjectiveKind::Pg,
            ..Default::default()
        }
        .pg()
        .unwrap()
    }

    #[test]
    fn groups_get_advantages_and_flat_groups_are_dropped_and_counted() {
        let docs = vec![
            rollout(1, "a", 1.0, 0),
            rollout(2, "b", 0.5, 0),
            rollout(3, "a", 0.0, 0),
            rollout(4, "b", 0.5, 0),
            rollout(5, "c", 1.0, 0),
            rollout(6, "c", 0.0, 0),
        ];
        let p = prepare(&docs, &pg(), None, 0);
        assert_eq!(p.units, vec![vec![0, 2], vec![4, 5]]);
        assert_eq!((p.zero_variance_groups, p.zero_variance_rollouts), (1, 2));
        let a = p.advantage[&DocId { file: 0, line: 1 }];
        let b = p.advantage[&DocId { file: 0, line: 3 }];
        assert!(a > 0.0 && (a + b).abs() < 1e-12);
        assert!(!p.advantage.contains_key(&DocId { file: 0, line: 2 }));
    }

    #[test]
    fn stale_rollouts_are_refused_at_admission() {
        let docs = vec![
            rollout(1, "a", 1.0, 3),
            rollout(2, "a", 0.0, 5),
            rollout(3, "a", 0.5, 1),
        ];
        let p = prepare(&docs, &pg(), Some(2), 5);
        assert_eq!(p.rejected_stale, 1);
        assert_eq!(p.units, vec![vec![0, 1]]);
    }

    #[test]
    fn steps_take_whole_groups() {
        let g = [(40, 4), (30, 3), (50, 4), (10, 1)];
        let s = select_groups(StepTarget::Docs(5), g.iter().copied());
        assert_eq!(s.consumed, 2, "4 < 5 so a second group is taken whole");
        let s = select_groups(StepTarget::Docs(4), g.iter().copied());
        assert_eq!(s.consumed, 1);
        let s = select_groups(StepTarget::Tokens(75), g.iter().copied());
        assert_eq!(s.consumed, 2);
        let s = select_groups(StepTarget::Tokens(10), g.iter().copied());
        assert_eq!(s.consumed, 1, "the first group is always taken");
        let s = select_groups(StepTarget::Docs(100), g.iter().copied());
        assert_eq!(s.consumed, 4);
    }
}
