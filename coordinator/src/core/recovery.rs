//! Recovery of model state when a generation forms (DESIGN.md "Elasticity",
//! issue 6 items 3–4): pure decisions, no I/O.
//!
//! A new generation of a job at committed step `s` gets its state from one
//! of three sources, chosen by [`decide`]:
//! - **memory**: members that still hold a step `k ≤ s` (their `HeldState`)
//!   act as priors; the others receive the state over the collective
//!   (broadcast for ddp, resharding for zero2/fsdp), no disk involved. Under
//!   ddp one holder is enough (every replica is whole); under zero2/fsdp the
//!   holders must cover every rank of one complete earlier layout, or some
//!   shard of the optimizer state is gone.
//! - **checkpoint**: every member restores the newest good checkpoint
//!   `c ≤ s` of the job's index, resharded to the new world size.
//! - **init**: the model's own initialisation (step 0), allowed only while
//!   the job's replay history reaches back to its first step.
//!
//! Whatever the source's step `k`, the committed steps `k+1..=s` are then
//! replayed (`super::planner`'s replay source): the same documents (from
//! the step's stored manifest), the same learning rate, re-packed for the
//! current world size.
//! The normalisers come from the documents, so the update is the same
//! whatever the world size; replayed steps never commit again.
//!
//! The higher of the memory step and the checkpoint step wins (less replay);
//! on a tie memory wins (no disk).

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use super::types::{CheckpointEntry, HeldState};
use crate::job::parallel::Sharding;

/// Where a generation's state comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// `priors[i]` is member i's held layout when it holds the configured
    /// step; members without one receive the state from those with one.
    Memory { priors: Vec<Option<HeldState>> },
    /// Every member restores this checkpoint.
    Checkpoint(CheckpointEntry),
    /// The model's own initialisation (step 0).
    Init,
}

/// How a new generation starts: from `source` at `step`, then replaying
/// the committed steps up to `target`.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub source: Source,
    /// The step the members hold once configured (`Configure.step`).
    pub step: u64,
    /// The job's committed step.
    pub target: u64,
}

impl Decision {
    /// The committed steps to replay, if any.
    pub fn replay(&self) -> Option<RangeInclusive<u64>> {
        (self.step < self.target).then(|| self.step + 1..=self.target)
    }

    /// The checkpoint directory members restore from, if any.
    pub fn restore_from(&self) -> Option<PathBuf> {
        match &self.source {
            Source::Checkpoint(c) => Some(c.dir.clone()),
            _ => None,
        }
    }

    /// Member i's prior layout (memory source only).
    pub fn prior(&self, i: usize) -> Option<&HeldState> {
        match &self.source {
            Source::Memory { priors } => priors.get(i).and_then(Option::as_ref),
            _ => None,
        }
    }

    /// One line for logs and watch events.
    pub fn describe(&self) -> String {
        let from = match &self.source {
            Source::Memory { priors } => {
                let n = priors.iter().flatten().count();
                format!("{n} member(s) holding step {} in memory", self.step)
            }
            Source::Checkpoint(c) => format!("checkpoint step-{}", c.step),
            Source::Init => "the model init".to_string(),
        };
        match self.replay() {
            Some(r) => format!(
                "state from {from}; replaying steps {}..={}",
                r.start(),
                r.end()
            ),
            None => format!("state from {from}"),
        }
    }
}

/// Members `rank..rank + count` hold the configured step as ranks
/// `prior_rank..prior_rank + count` of `prior_world`: the priors in the
/// form every member is sent (issue 19: survivors keep their order, so a
/// re-formed generation is a few runs however many members it has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorRun {
    pub rank: u32,
    pub count: u32,
    pub prior_rank: u32,
    pub prior_world: u32,
}

/// The priors by rank as runs; members holding nothing are in no run.
pub fn prior_runs(priors: &[Option<HeldState>]) -> Vec<PriorRun> {
    let mut runs: Vec<PriorRun> = Vec::new();
    for (i, p) in priors.iter().enumerate() {
        let Some(p) = p else { continue };
        let i = i as u32;
        match runs.last_mut() {
            Some(r)
                if r.rank + r.count == i
                    && r.prior_rank + r.count == p.rank
                    && r.prior_world == p.world_size =>
            {
                r.count += 1
            }
            _ => runs.push(PriorRun {
                rank: i,
                count: 1,
                prior_rank: p.rank,
                prior_world: p.world_size,
            }),
        }
    }
    runs
}

/// Everything [`decide`] looks at.
#[derive(Debug, Clone)]
pub struct Situation<'a> {
    pub sharding: Sharding,
    /// The job's committed step.
    pub committed: u64,
    /// Each member's held state for this job (None: nothing usable).
    pub members: &'a [Option<HeldState>],
    /// Good checkpoints, ascending by step.
    pub checkpoints: &'a [CheckpointEntry],
    /// Committed steps after this one can be replayed.
    pub history_from: u64,
    /// Falling back to the model init is allowed (the job started at step
    /// 0 and its history reaches back to it).
    pub init_allowed: bool,
    /// False after a failed state sync: restore from disk.
    pub memory_allowed: bool,
}

/// No source of state can reach the committed step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "no state to recover step {committed} from: no member holds it in memory, \
     no good checkpoint at or before it, and the model init is not an option \
     (replay history starts after step {history_from})"
)]
pub struct NoSource {
    pub committed: u64,
    pub history_from: u64,
}

/// Chooses where a new generation's state comes from.
pub fn decide(s: &Situation<'_>) -> Result<Decision, NoSource> {
    let replayable = |k: u64| k == s.committed || (k >= s.history_from && k < s.committed);
    let memory = if s.memory_allowed {
        match s.sharding {
            Sharding::Ddp => ddp_holders(s.members, &replayable),
            Sharding::Zero2 | Sharding::Fsdp => complete_layout(s.members, &replayable),
        }
    } else {
        None
    };
    let checkpoint = s
        .checkpoints
        .iter()
        .rev()
        .find(|c| c.step <= s.committed && replayable(c.step));
    let decision = |source, step| Decision {
        source,
        step,
        target: s.committed,
    };
    Ok(match (memory, checkpoint) {
        (Some((k, priors)), c) if c.is_none_or(|c| k >= c.step) => {
            decision(Source::Memory { priors }, k)
        }
        (_, Some(c)) => decision(Source::Checkpoint(c.clone()), c.step),
        (None, None) if s.init_allowed && replayable(0) => decision(Source::Init, 0),
        _ => {
            return Err(NoSource {
                committed: s.committed,
                history_from: s.history_from,
            })
        }
    })
}

/// ddp: the highest usable step any member holds, and its holders.
fn ddp_holders(
    members: &[Option<HeldState>],
    usable: &impl Fn(u64) -> bool,
) -> Option<(u64, Vec<Option<HeldState>>)> {
    let k = members
        .iter()
        .flatten()
        .map(|h| h.step)
        .filter(|&k| usable(k))
        .max()?;
    let priors = members
        .iter()
        .map(|h| h.clone().filter(|h| h.step == k))
        .collect();
    Some((k, priors))
}

/// zero2/fsdp: the highest usable step whose holders cover every rank of
/// one earlier layout, with one prior per rank of that layout.
fn complete_layout(
    members: &[Option<HeldState>],
    usable: &impl Fn(u64) -> bool,
) -> Option<(u64, Vec<Option<HeldState>>)> {
    // (step, generation, world) → rank → member index.
    let mut layouts: BTreeMap<(u64, u64, u32), BTreeMap<u32, usize>> = BTreeMap::new();
    for (i, h) in members.iter().enumerate() {
        let Some(h) = h
            .as_ref()
            .filter(|h| usable(h.step) && h.rank < h.world_size)
        else {
            continue;
        };
        layouts
            .entry((h.step, h.generation, h.world_size))
            .or_default()
            .entry(h.rank)
            .or_insert(i);
    }
    // Highest step first, then the newest generation.
    let ((step, _, _), ranks) = layouts
        .into_iter()
        .rev()
        .find(|((_, _, world), ranks)| ranks.len() == *world as usize)?;
    let mut priors = vec![None; members.len()];
    for i in ranks.into_values() {
        priors[i] = members[i].clone();
    }
    Some((step, priors))
}

/// Orders candidate members so that holders of the job's state come first
/// (highest step, newest layout, by rank), then the rest by `seq`; a
/// generation takes the first `max_workers`.
pub fn member_order(job: &str, candidates: &mut [(String, u64, Option<HeldState>)]) {
    candidates.sort_by_key(|(_, seq, held)| {
        let h = held.as_ref().filter(|h| h.job == job);
        (
            h.is_none(),
            std::cmp::Reverse(h.map_or(0, |h| h.step)),
            std::cmp::Reverse(h.map_or(0, |h| h.generation)),
            h.map_or(0, |h| h.rank),
            *seq,
        )
    });
}

/// Adds a complete checkpoint to `index` (ascending, no duplicates) and
/// keeps the newest `keep` (0 keeps all). Returns the entries dropped,
/// oldest first: history up to the oldest retained one is no longer needed.
pub fn add_checkpoint(
    index: &mut Vec<CheckpointEntry>,
    entry: CheckpointEntry,
    keep: usize,
) -> Vec<CheckpointEntry> {
    index.retain(|c| c.step != entry.step);
    let at = index.partition_point(|c| c.step < entry.step);
    index.insert(at, entry);
    if keep == 0 || index.len() <= keep {
        return Vec::new();
    }
    index.drain(..index.len() - keep).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(step: u64, generation: u64, world_size: u32, rank: u32) -> Option<HeldState> {
        Some(HeldState {
            job: "j".into(),
            step,
            world_size,
            rank,
            generation,
        })
    }

    #[test]
    fn survivors_in_order_are_one_run_per_gap() {
        // Four of five survivors keep their order, a newcomer holds nothing.
        let priors = [
            held(3, 1, 5, 0),
            held(3, 1, 5, 2),
            held(3, 1, 5, 3),
            None,
            held(3, 1, 5, 4),
        ];
        let run = |rank, count, prior_rank| PriorRun {
            rank,
            count,
            prior_rank,
            prior_world: 5,
        };
        assert_eq!(
            prior_runs(&priors),
            vec![run(0, 1, 0), run(1, 2, 2), run(4, 1, 4)]
        );
        let many: Vec<_> = (0..4096).map(|r| held(3, 1, 4096, r)).collect();
        assert_eq!(prior_runs(&many).len(), 1);
        assert!(prior_runs(&[None, None]).is_empty());
    }

    fn ck(step: u64) -> CheckpointEntry {
        CheckpointEntry {
            step,
            dir: format!("/ck/step-{step}").into(),
        }
    }

    fn situation<'a>(
        sharding: Sharding,
        committed: u64,
        members: &'a [Option<HeldState>],
        checkpoints: &'a [CheckpointEntry],
    ) -> Situation<'a> {
        Situation {
            sharding,
            committed,
            members,
            checkpoints,
            history_from: 0,
            init_allowed: true,
            memory_allowed: true,
        }
    }

    #[test]
    fn ddp_one_holder_of_the_committed_step_is_enough() {
        let members = [held(7, 3, 3, 1), None, held(6, 2, 3, 0)];
        let d = decide(&situation(Sharding::Ddp, 7, &members, &[ck(6)])).unwrap();
        assert_eq!(d.step, 7);
        assert_eq!(d.replay(), None);
        assert_eq!(d.restore_from(), None);
        assert!(d.prior(0).is_some());
        assert!(d.prior(1).is_none() && d.prior(2).is_none());
    }

    #[test]
    fn sharded_holders_must_cover_a_complete_layout() {
        // Ranks 0 and 1 of a world of 3 survive: rank 2's shard is gone.
        let members = [held(7, 3, 3, 0), held(7, 3, 3, 1)];
        for sharding in [Sharding::Zero2, Sharding::Fsdp] {
            let d = decide(&situation(sharding, 7, &members, &[ck(4), ck(6)])).unwrap();
            assert_eq!(d.source, Source::Checkpoint(ck(6)), "{sharding:?}");
            assert_eq!(d.replay(), Some(7..=7));
        }
        // A join 2 → 3: both ranks of the world of 2 are present.
        let members = [held(7, 3, 2, 1), held(7, 3, 2, 0), None];
        let d = decide(&situation(Sharding::Fsdp, 7, &members, &[ck(6)])).unwrap();
        assert_eq!(d.step, 7);
        assert_eq!(d.prior(0).unwrap().rank, 1);
        assert_eq!(d.prior(1).unwrap().rank, 0);
        assert!(d.prior(2).is_none());
    }

    #[test]
    fn layouts_of_different_generations_do_not_combine() {
        let members = [held(7, 3, 2, 0), held(7, 4, 2, 1)];
        let d = decide(&situation(Sharding::Fsdp, 7, &members, &[ck(5)])).unwrap();
        assert_eq!(d.source, Source::Checkpoint(ck(5)));
    }

    #[test]
    fn the_newer_of_memory_and_checkpoint_wins_and_ties_go_to_memory() {
        // A ddp survivor stopped mid-replay at step 5; the checkpoint is 4.
        let members = [held(5, 9, 2, 0)];
        let d = decide(&situation(Sharding::Ddp, 8, &members, &[ck(4)])).unwrap();
        assert_eq!((d.step, d.replay()), (5, Some(6..=8)));
        assert!(matches!(d.source, Source::Memory { .. }));
        let d = decide(&situation(Sharding::Ddp, 8, &members, &[ck(6)])).unwrap();
        assert_eq!(d.source, Source::Checkpoint(ck(6)));
        let d = decide(&situation(Sharding::Ddp, 8, &members, &[ck(5)])).unwrap();
        assert!(matches!(d.source, Source::Memory { .. }));
    }

    #[test]
    fn uncommitted_or_unreplayable_memory_is_not_used() {
        // Step 9 was applied but never committed; step 2 is below history.
        let members = [held(9, 3, 2, 0), held(2, 1, 2, 1)];
        let index = [ck(4)];
        let mut s = situation(Sharding::Ddp, 8, &members, &index);
        s.history_from = 4;
        s.init_allowed = false;
        assert_eq!(decide(&s).unwrap().source, Source::Checkpoint(ck(4)));
    }

    #[test]
    fn no_state_anywhere_falls_back_to_init_or_fails() {
        let d = decide(&situation(Sharding::Fsdp, 3, &[None, None], &[])).unwrap();
        assert_eq!((d.source.clone(), d.replay()), (Source::Init, Some(1..=3)));
        let mut s = situation(Sharding::Fsdp, 3, &[None], &[]);
        s.init_allowed = false;
        s.history_from = 2;
        let err = decide(&s).unwrap_err();
        assert!(
            err.to_string().contains("history starts after step 2"),
            "{err}"
        );
        // A job at step 0 with fresh workers simply starts from the init.
        let d = decide(&situation(Sharding::Ddp, 0, &[None], &[])).unwrap();
        assert_eq!((d.replay(), d.source), (None, Source::Init));
    }

    #[test]
    fn a_failed_state_sync_forces_a_restore() {
        let members = [held(8, 3, 1, 0)];
        let index = [ck(6)];
        let mut s = situation(Sharding::Ddp, 8, &members, &index);
        s.memory_allowed = false;
        assert_eq!(decide(&s).unwrap().source, Source::Checkpoint(ck(6)));
    }

    #[test]
    fn holders_are_ordered_first_by_step_then_rank() {
        let mut c = vec![
            ("new".to_string(), 1, None),
            ("r1".to_string(), 5, held(4, 2, 2, 1)),
            ("other-job".to_string(), 0, {
                let mut h = held(9, 9, 1, 0);
                h.as_mut().unwrap().job = "x".into();
                h
            }),
            ("r0".to_string(), 7, held(4, 2, 2, 0)),
            ("old".to_string(), 2, held(3, 1, 1, 0)),
        ];
        member_order("j", &mut c);
        let ids: Vec<&str> = c.iter().map(|(id, _, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["r0", "r1", "old", "other-job", "new"]);
    }

    use proptest::prelude::*;

    fn any_held() -> impl Strategy<Value = Option<HeldState>> {
        prop::option::of((0u64..8, 1u64..4, 1u32..4, 0u32..4).prop_map(
            |(step, gen, world, rank)| HeldState {
                job: "j".into(),
                step,
                world_size: world,
                rank: rank % world,
                generation: gen,
            },
        ))
    }

    proptest! {
        /// Whatever the members hold: the source never lies ahead of the
        /// committed step, priors hold exactly the configured step, and a
        /// sharded memory source covers every rank of one layout once.
        #[test]
        fn decisions_are_consistent(
            members in prop::collection::vec(any_held(), 0..6),
            committed in 0u64..8,
            history_from in 0u64..8,
            ckpts in prop::collection::btree_set(0u64..8, 0..4),
            sharded in any::<bool>(),
        ) {
            let index: Vec<CheckpointEntry> = ckpts.into_iter().map(ck).collect();
            let history_from = history_from.min(committed);
            let sharding = if sharded { Sharding::Fsdp } else { Sharding::Ddp };
            let s = Situation {
                sharding,
                committed,
                members: &members,
                checkpoints: &index,
                history_from,
                init_allowed: history_from == 0,
                memory_allowed: true,
            };
            let Ok(d) = decide(&s) else { return Ok(()) };
            prop_assert!(d.step <= committed);
            prop_assert!(d.step == committed || d.step >= history_from);
            match &d.source {
                Source::Memory { priors } => {
                    prop_assert_eq!(priors.len(), members.len());
                    let held: Vec<&HeldState> = priors.iter().flatten().collect();
                    prop_assert!(!held.is_empty());
                    prop_assert!(held.iter().all(|h| h.step == d.step));
                    if sharded {
                        let world = held[0].world_size;
                        let mut ranks: Vec<u32> = held.iter().map(|h| h.rank).collect();
                        ranks.sort();
                        prop_assert_eq!(ranks, (0..world).collect::<Vec<_>>());
                        prop_assert!(held.iter().all(|h| h.generation == held[0].generation));
                    }
                }
                Source::Checkpoint(c) => prop_assert!(index.contains(c)),
                Source::Init => prop_assert_eq!(d.step, 0),
            }
        }
    }

    #[test]
    fn the_index_keeps_the_newest_checkpoints() {
        let mut index = vec![];
        assert_eq!(add_checkpoint(&mut index, ck(2), 2), vec![]);
        assert_eq!(add_checkpoint(&mut index, ck(6), 2), vec![]);
        assert_eq!(add_checkpoint(&mut index, ck(4), 2), vec![ck(2)]);
        assert_eq!(index, vec![ck(4), ck(6)]);
        assert_eq!(add_checkpoint(&mut index, ck(6), 2), vec![], "no duplicate");
        let mut all = vec![];
        for s in 1..=5 {
            assert_eq!(add_checkpoint(&mut all, ck(s), 0), vec![]);
        }
        assert_eq!(all.len(), 5);
    }
}
