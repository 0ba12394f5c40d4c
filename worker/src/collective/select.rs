//! Which backend carries a generation's collectives (issue 15): decided
//! once per generation, identically on every rank, from what each member
//! says about itself over the generation's TCP ring right after it forms
//! (its device, and whether it can load NCCL) and the job's
//! `parallel.collective`:
//! - every member on CUDA with NCCL, and the job does not force the ring:
//!   [`Backend::Nccl`] — every collective on device tensors;
//! - otherwise the TCP ring: [`Backend::Ring`] for a CPU member,
//!   [`Backend::StagedRing`] for a CUDA member (its tensors go through a
//!   pinned host buffer, see [`super::staged`]), so a GPU worker never
//!   depends on NCCL being present and mixed CPU/GPU generations work.
//!
//! Why the members' own word over the ring rather than their registration:
//! it is what each process can actually do now (the NCCL library loads,
//! the binary was built with `cuda`), every rank reads the same table, and
//! the coordinator stays free of device logic.

use crate::config::CollectiveChoice;

/// The backend of one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The CPU TCP ring on host tensors.
    Ring,
    /// The TCP ring, this rank's device tensors staged through pinned
    /// host memory.
    StagedRing,
    /// NCCL on device tensors.
    Nccl,
}

/// What a member says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Member {
    /// It trains on a CUDA device.
    pub cuda: bool,
    /// It can build an NCCL communicator (built with `cuda`, libnccl
    /// loads, on a CUDA device).
    pub nccl: bool,
}

impl Member {
    /// As two floats for the exchange (see [`decode`]).
    pub fn encode(self) -> [f32; 2] {
        [
            f32::from(u8::from(self.cuda)),
            f32::from(u8::from(self.nccl)),
        ]
    }
}

/// The members of a world, from the sum over ranks of a `2 × world` table
/// in which each rank wrote only its own [`Member::encode`] at `2·rank`.
pub fn decode(table: &[f32]) -> Vec<Member> {
    table
        .chunks_exact(2)
        .map(|m| Member {
            cuda: m[0] > 0.5,
            nccl: m[1] > 0.5,
        })
        .collect()
}

/// The backend rank `me` of `members` uses. Every rank computes the same
/// answer for the generation (NCCL or not), and its own way to the ring.
pub fn choose(members: &[Member], me: usize, choice: CollectiveChoice) -> Backend {
    let all_nccl = !members.is_empty() && members.iter().all(|m| m.cuda && m.nccl);
    if all_nccl && choice == CollectiveChoice::Auto {
        return Backend::Nccl;
    }
    if members.get(me).is_some_and(|m| m.cuda) {
        Backend::StagedRing
    } else {
        Backend::Ring
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: Member = Member {
        cuda: false,
        nccl: false,
    };
    const GPU: Member = Member {
        cuda: true,
        nccl: true,
    };
    const GPU_NO_NCCL: Member = Member {
        cuda: true,
        nccl: false,
    };

    #[test]
    fn all_cuda_with_nccl_is_nccl_unless_the_ring_is_forced() {
        let four = [GPU; 4];
        for me in 0..4 {
            assert_eq!(choose(&four, me, CollectiveChoice::Auto), Backend::Nccl);
            assert_eq!(
                choose(&four, me, CollectiveChoice::Ring),
                Backend::StagedRing
            );
        }
    }

    #[test]
    fn mixed_worlds_take_the_ring_each_rank_its_own_way() {
        let mixed = [GPU, CPU, GPU];
        let got: Vec<Backend> = (0..3)
            .map(|me| choose(&mixed, me, CollectiveChoice::Auto))
            .collect();
        assert_eq!(
            got,
            [Backend::StagedRing, Backend::Ring, Backend::StagedRing]
        );
        // One GPU without NCCL keeps the whole generation on the ring.
        let partial = [GPU, GPU_NO_NCCL];
        assert_eq!(
            choose(&partial, 0, CollectiveChoice::Auto),
            Backend::StagedRing
        );
        assert_eq!(
            choose(&[CPU, CPU], 1, CollectiveChoice::Auto),
            Backend::Ring
        );
    }

    #[test]
    fn the_exchange_table_round_trips() {
        let members = [GPU, CPU, GPU_NO_NCCL];
        // What the all-reduce produces: each rank's own slot, zeros elsewhere, summed.
        let mut table = vec![0f32; 6];
        for (r, m) in members.iter().enumerate() {
            table[2 * r..2 * r + 2].copy_from_slice(&m.encode());
        }
        assert_eq!(decode(&table), members);
    }
}
