//! Finding the documents that make a step non-finite (issue 14,
//! `faults.on_nonfinite = "bisect"`). The coordinator knows every document
//! of a failed step; it probes groups of them with forward/backward-only
//! plans (`PlanKind::Probe`: each group one microbatch, alone, no update)
//! and splits every group that is still non-finite in halves, until the
//! non-finite groups are single documents. Those are quarantined and the
//! step is planned again without them.
//!
//! A pure state machine: the planner turns [`Bisection::groups`] into a
//! probe plan, the lifecycle feeds back which groups were non-finite.

use crate::stream::doc::DocId;
use crate::stream::plan::Normalizers;

/// A bisection of one failed step, live only: a coordinator restarted
/// mid-way re-runs the step, which fails again and starts over.
#[derive(Debug, Clone, PartialEq)]
pub struct Bisection {
    /// The step that was non-finite.
    pub step: u64,
    /// The failed plan's normalisers: probes scale the loss as the step
    /// did, so an overflow reproduces.
    pub normalizers: Normalizers,
    /// What the step's failure said (kept with the quarantine).
    pub detail: String,
    /// Probe rounds run so far.
    pub rounds: u32,
    /// The groups the next probe runs; each fits one microbatch.
    groups: Vec<Vec<DocId>>,
    /// Documents found non-finite on their own.
    found: Vec<DocId>,
}

/// What a probe round leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Probe [`Bisection::groups`] again (the halves of the bad groups).
    Probe,
    /// Every non-finite group was narrowed to single documents.
    Found(Vec<DocId>),
    /// No group was non-finite (or no single document was, only their
    /// combination): not a property of any one document.
    NotReproduced,
    /// The round cap was reached with these documents still suspect.
    OutOfRounds(Vec<DocId>),
}

impl Bisection {
    /// Starts from the failed plan's microbatches (each group fits one,
    /// and the first round tells which of them failed). Empty groups are
    /// left out.
    pub fn new(
        step: u64,
        groups: Vec<Vec<DocId>>,
        normalizers: Normalizers,
        detail: String,
    ) -> Bisection {
        Bisection {
            step,
            normalizers,
            detail,
            rounds: 0,
            groups: groups.into_iter().filter(|g| !g.is_empty()).collect(),
            found: Vec::new(),
        }
    }

    /// The groups the next probe runs.
    pub fn groups(&self) -> &[Vec<DocId>] {
        &self.groups
    }

    /// Takes a probe's verdict (`bad[i]`: group `i` was non-finite) and
    /// decides what comes next; `max_rounds` caps the probes.
    pub fn observe(&mut self, bad: &[bool], max_rounds: u32) -> Next {
        assert_eq!(bad.len(), self.groups.len(), "one verdict per group");
        self.rounds += 1;
        let mut next = Vec::new();
        for (group, &bad) in std::mem::take(&mut self.groups).into_iter().zip(bad) {
            match group.len() {
                _ if !bad => {}
                1 => self.found.push(group[0]),
                n => {
                    let mut a = group;
                    let b = a.split_off(n / 2);
                    next.push(a);
                    next.push(b);
                }
            }
        }
        if next.is_empty() {
            return if self.found.is_empty() {
                Next::NotReproduced
            } else {
                Next::Found(std::mem::take(&mut self.found))
            };
        }
        if self.rounds >= max_rounds {
            let mut suspects = std::mem::take(&mut self.found);
            suspects.extend(next.into_iter().flatten());
            return Next::OutOfRounds(suspects);
        }
        self.groups = next;
        Next::Probe
    }
}

/// Where probe group `i` runs: `(rank, microbatch index)`. Under fsdp
/// every rank takes part in every microbatch and gradients are summed
/// across ranks as they are computed, so only rank 0 carries groups (the
/// others run empty microbatches alongside); elsewhere microbatches are
/// independent and the groups are spread round-robin.
pub fn slots(groups: usize, world_size: u32, coupled: bool) -> Vec<(u32, u32)> {
    let w = world_size.max(1) as usize;
    (0..groups)
        .map(|i| {
            if coupled {
                (0, i as u32)
            } else {
                ((i % w) as u32, (i / w) as u32)
            }
        })
        .collect()
}

/// Which groups a probe found non-finite, from what each rank flagged:
/// group `g` at `slots[g] = (r, i)` is bad when rank `r` flagged `i`, or
/// when a rank without a group at `i` did (under fsdp a non-finite value
/// reaches every rank running that microbatch).
pub fn verdict(
    slots: &[(u32, u32)],
    flagged: &std::collections::BTreeMap<u32, Vec<u32>>,
) -> Vec<bool> {
    let occupied: std::collections::BTreeSet<(u32, u32)> = slots.iter().copied().collect();
    let by_empty_rank = |i: u32| {
        flagged
            .iter()
            .any(|(&r, f)| !occupied.contains(&(r, i)) && f.contains(&i))
    };
    slots
        .iter()
        .map(|&(r, i)| flagged.get(&r).is_some_and(|f| f.contains(&i)) || by_empty_rank(i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(line: u64) -> DocId {
        DocId { file: 0, line }
    }

    /// Runs a bisection against `poison` (a group is bad when it holds
    /// one), returning the outcome and the rounds taken.
    fn run(groups: Vec<Vec<u64>>, poison: &[u64], max_rounds: u32) -> (Next, u32) {
        let groups = groups
            .into_iter()
            .map(|g| g.into_iter().map(id).collect())
            .collect();
        let mut b = Bisection::new(7, groups, Normalizers::default(), "nan".into());
        loop {
            let bad: Vec<bool> = b
                .groups()
                .iter()
                .map(|g| g.iter().any(|d| poison.contains(&d.line)))
                .collect();
            match b.observe(&bad, max_rounds) {
                Next::Probe => continue,
                other => return (other, b.rounds),
            }
        }
    }

    #[test]
    fn one_poison_document_among_many_is_found_in_logarithmic_rounds() {
        let groups = vec![(1..=16).collect(), (17..=40).collect(), vec![]];
        let (next, rounds) = run(groups, &[29], 24);
        assert_eq!(next, Next::Found(vec![id(29)]));
        // 1 round to find the microbatch, at most ceil(log2(24)) = 5 to
        // narrow it (fewer when a half is odd-sized).
        assert!((4..=6).contains(&rounds), "{rounds}");
    }

    #[test]
    fn several_poison_documents_in_several_microbatches_are_all_found() {
        let groups = vec![(1..=8).collect(), (9..=16).collect()];
        let (next, _) = run(groups, &[2, 3, 12], 24);
        let Next::Found(mut found) = next else {
            panic!("{next:?}")
        };
        found.sort();
        assert_eq!(found, vec![id(2), id(3), id(12)]);
    }

    #[test]
    fn a_failure_no_group_reproduces_is_reported_as_such() {
        let (next, rounds) = run(vec![(1..=8).collect()], &[], 24);
        assert_eq!((next, rounds), (Next::NotReproduced, 1));
    }

    #[test]
    fn a_failure_only_a_combination_produces_is_not_pinned_on_one_document() {
        let mut b = Bisection::new(
            1,
            vec![vec![id(1), id(2)]],
            Normalizers::default(),
            String::new(),
        );
        assert_eq!(b.observe(&[true], 24), Next::Probe);
        assert_eq!(b.groups(), &[vec![id(1)], vec![id(2)]]);
        assert_eq!(b.observe(&[false, false], 24), Next::NotReproduced);
    }

    #[test]
    fn probe_groups_spread_over_ranks_unless_coupled() {
        assert_eq!(
            slots(5, 2, false),
            vec![(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
        );
        assert_eq!(slots(3, 2, true), vec![(0, 0), (0, 1), (0, 2)]);
        let flagged = [(0, vec![1]), (1, vec![])].into_iter().collect();
        assert_eq!(
            verdict(&slots(4, 2, false), &flagged),
            vec![false, false, true, false]
        );
        // fsdp: rank 1 ran padding at index 2 and saw the non-finite value.
        let flagged = [(0, vec![]), (1, vec![2])].into_iter().collect();
        assert_eq!(
            verdict(&slots(3, 2, true), &flagged),
            vec![false, false, true]
        );
    }

    #[test]
    fn the_round_cap_stops_with_the_remaining_suspects() {
        let (next, rounds) = run(vec![(1..=64).collect()], &[5], 3);
        assert_eq!(rounds, 3);
        let Next::OutOfRounds(suspects) = next else {
            panic!("{next:?}")
        };
        assert!(suspects.contains(&id(5)));
        assert_eq!(suspects.len(), 16);
    }
}
