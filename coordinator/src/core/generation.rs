//! A generation: one fixed membership of a job (ranks 0..W-1, and a
//! disaggregated job's generators), which members reported Ready, and
//! where its state came from.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::recovery::Decision;
use super::types::{Peer, WorkerId};

/// A fixed membership of a job: ranks 0..W-1.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub id: u64,
    /// Worker of each rank.
    pub members: Vec<WorkerId>,
    /// Ranks that reported Ready for this generation ...
    ready: Vec<bool>,
    /// ... and how many: "all ready?" is asked on every event that may
    /// dispatch, so it is O(1), not a scan of W ranks (issue 19).
    ready_count: u32,
    /// The step its members hold: the configured step, then advanced by
    /// every replayed or committed step.
    pub step: u64,
    /// Where its state came from, and the steps it replays.
    pub decision: Decision,
    /// Formed under "restore from disk" (a state sync had failed): until it
    /// is ready, the next generation must restore from disk too.
    pub disk_only: bool,
    /// Each member's rank: every result, error and Ready looks its sender
    /// up, so this is O(log W), not a scan of the members (issue 19).
    /// Shared: a generation is cloned often and never changes.
    ranks: Arc<BTreeMap<WorkerId, u32>>,
    /// A disaggregated RL generation's generators (`rl.generators`):
    /// workers outside the training ranks that only generate. Empty in
    /// every other generation. (Boxed: most generations have none.)
    pub generators: Box<GeneratorSet>,
}

/// The generators of a disaggregated generation, by their rank among the
/// generators (what their `GeneratePlan`s carry), and which are ready.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GeneratorSet {
    pub members: Vec<WorkerId>,
    ready: Vec<bool>,
    ready_count: u32,
}

impl GeneratorSet {
    pub fn new(members: Vec<WorkerId>) -> GeneratorSet {
        GeneratorSet {
            ready: vec![false; members.len()],
            ready_count: 0,
            members,
        }
    }

    pub fn len(&self) -> u32 {
        self.members.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// A generator's rank among the generators (a scan: generators answer
    /// once per round, never on the per-step path).
    pub fn rank_of(&self, worker: &str) -> Option<u32> {
        self.members
            .iter()
            .position(|m| m == worker)
            .map(|i| i as u32)
    }

    pub fn all_ready(&self) -> bool {
        self.ready_count as usize == self.ready.len()
    }

    /// Notes generator `rank`'s Ready (again is a no-op).
    pub fn mark_ready(&mut self, rank: u32) {
        if let Some(r) = self.ready.get_mut(rank as usize).filter(|r| !**r) {
            *r = true;
            self.ready_count += 1;
        }
    }
}

impl Generation {
    /// A generation of `members` (rank = position), none ready yet.
    pub fn new(id: u64, members: Vec<WorkerId>, decision: Decision, disk_only: bool) -> Self {
        let ranks = Arc::new(
            members
                .iter()
                .enumerate()
                .map(|(r, m)| (m.clone(), r as u32))
                .collect(),
        );
        Generation {
            id,
            ready: vec![false; members.len()],
            ready_count: 0,
            members,
            step: decision.step,
            decision,
            disk_only,
            ranks,
            generators: Box::default(),
        }
    }

    /// The same generation with these generators beside its training ranks.
    pub fn with_generators(mut self, generators: Vec<WorkerId>) -> Self {
        self.generators = Box::new(GeneratorSet::new(generators));
        self
    }

    /// Every worker of the generation: the training ranks, then the
    /// generators.
    pub fn everyone(&self) -> impl Iterator<Item = &WorkerId> {
        self.members.iter().chain(&self.generators.members)
    }

    /// The training world size (generators are not in it).
    pub fn world_size(&self) -> u32 {
        self.members.len() as u32
    }

    pub fn all_ready(&self) -> bool {
        self.ready_count as usize == self.ready.len()
    }

    /// Notes `rank`'s Ready (again is a no-op); true when it was the last.
    pub fn mark_ready(&mut self, rank: u32) -> bool {
        match self.ready.get_mut(rank as usize) {
            Some(r) if !*r => {
                *r = true;
                self.ready_count += 1;
                self.all_ready()
            }
            _ => false,
        }
    }

    pub fn rank_of(&self, worker: &str) -> Option<u32> {
        self.ranks.get(worker).copied()
    }

    /// The worker at `peer`: a training rank, or a weight-ring rank
    /// (trainer rank 0, then the generators in order, as formed).
    pub fn member_of(&self, peer: Peer) -> Option<&WorkerId> {
        match peer {
            Peer::Rank(r) => self.members.get(r as usize),
            Peer::WeightRing(0) => self.members.first(),
            Peer::WeightRing(r) => self.generators.members.get(r as usize - 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::recovery::{Decision, Source};

    #[test]
    fn a_generation_counts_its_ready_ranks_once_each() {
        let members: Vec<WorkerId> = (0..3).map(|i| format!("w{i}")).collect();
        let decision = Decision {
            source: Source::Init,
            step: 0,
            target: 0,
        };
        let mut g = Generation::new(1, members, decision, false);
        assert!(!g.all_ready());
        assert!(!g.mark_ready(0));
        assert!(!g.mark_ready(0), "a repeated Ready is not a second rank");
        assert!(!g.mark_ready(7), "no such rank");
        assert!(!g.mark_ready(2));
        assert!(!g.all_ready());
        assert!(g.mark_ready(1), "the last rank completes it");
        assert!(g.all_ready());
        assert!(!g.mark_ready(1), "and only once");
        assert!(g.all_ready());
    }
}
