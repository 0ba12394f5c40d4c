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
    /// Which physical GPU (`device::gpu_identity`; 0: unknown).
    pub gpu: u32,
}

/// Floats per member in the exchange table.
pub const WORDS: usize = 3;

impl Member {
    /// As floats for the exchange (see [`decode`]).
    pub fn encode(self) -> [f32; WORDS] {
        [
            f32::from(u8::from(self.cuda)),
            f32::from(u8::from(self.nccl)),
            self.gpu as f32,
        ]
    }
}

/// The members of a world, from the sum over ranks of a `WORDS × world`
/// table in which each rank wrote only its own [`Member::encode`] at
/// `WORDS·rank`.
pub fn decode(table: &[f32]) -> Vec<Member> {
    table
        .chunks_exact(WORDS)
        .map(|m| Member {
            cuda: m[0] > 0.5,
            nccl: m[1] > 0.5,
            gpu: m[2].round() as u32,
        })
        .collect()
}

/// Whether two members sit on the same physical GPU (NCCL refuses a
/// communicator with two ranks on one device).
fn shares_a_gpu(members: &[Member]) -> bool {
    let mut seen: Vec<u32> = members.iter().map(|m| m.gpu).filter(|&g| g != 0).collect();
    let n = seen.len();
    seen.sort_unstable();
    seen.dedup();
    seen.len() != n
}

/// The backend rank `me` of `members` uses. Every rank computes the same
/// answer for the generation (NCCL or not), and its own way to the ring.
pub fn choose(members: &[Member], me: usize, choice: CollectiveChoice) -> Backend {
    let all_nccl =
        !members.is_empty() && members.iter().all(|m| m.cuda && m.nccl) && !shares_a_gpu(members);
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
        gpu: 0,
    };
    const GPU: Member = Member {
        cuda: true,
        nccl: true,
        gpu: 0,
    };
    const GPU_NO_NCCL: Member = Member {
        cuda: true,
        nccl: false,
        gpu: 7,
    };

    fn on(gpu: u32) -> Member {
        Member { gpu, ..GPU }
    }

    #[test]
    fn two_ranks_on_one_gpu_take_the_staged_ring() {
        let shared = [on(5), on(9), on(5)];
        for me in 0..3 {
            assert_eq!(
                choose(&shared, me, CollectiveChoice::Auto),
                Backend::StagedRing
            );
        }
        let distinct = [on(5), on(9), on(16_777_215)];
        assert_eq!(choose(&distinct, 1, CollectiveChoice::Auto), Backend::Nccl);
        // Unknown identities (no nvidia-smi) are taken as distinct.
        assert_eq!(
            choose(&[GPU, GPU], 0, CollectiveChoice::Auto),
            Backend::Nccl
        );
    }

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
        let members = [GPU, CPU, GPU_NO_NCCL, on(16_777_215)];
        // What the all-reduce produces: each rank's own slot, zeros elsewhere, summed.
        let mut table = vec![0f32; WORDS * members.len()];
        for (r, m) in members.iter().enumerate() {
            table[WORDS * r..WORDS * (r + 1)].copy_from_slice(&m.encode());
        }
        assert_eq!(decode(&table), members);
    }
}
