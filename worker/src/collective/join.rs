//! Joining a generation's collective (the IO around [`select::choose`]):
//! form the TCP ring of the generation's members, exchange what each
//! member is over it (one small all-reduce), then keep the ring, wrap it
//! in host staging for this rank's GPU, or build the generation's NCCL
//! communicator on top of it (rank 0's unique id broadcast over the ring).
//! One communicator per generation: a new generation joins again.

use std::net::TcpListener;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use super::select::{self, Backend, Member};
use super::staged::Staged;
use super::tcp::connect_cpu;
use super::{Collective, CollectiveError};
use crate::config::CollectiveChoice;

/// What a rank needs to join its generation.
#[derive(Debug, Clone)]
pub struct Join<'a> {
    pub rank: usize,
    pub world: usize,
    /// Every rank's collective address, by rank.
    pub peers: &'a [String],
    pub generation: u64,
    /// Bounds the connection and every later operation.
    pub timeout: Duration,
    /// This worker's device.
    pub device: Device,
    /// The job's `parallel.collective`.
    pub choice: CollectiveChoice,
    /// The generation's link key (from the Configure).
    pub link: accrue_collective::LinkKey,
}

/// Whether this process could run NCCL on `device`.
pub fn nccl_capable(device: Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        device.is_cuda() && super::nccl::nccl_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Joins the generation `j` describes; returns its collective and the
/// backend chosen.
pub fn join(
    listener: &TcpListener,
    j: &Join<'_>,
) -> Result<(Box<dyn Collective>, Backend), CollectiveError> {
    let mut ring = connect_cpu(
        listener,
        j.rank,
        j.world,
        j.peers,
        j.generation,
        j.timeout,
        j.link.clone(),
    )?;
    let me = Member {
        cuda: j.device.is_cuda(),
        nccl: nccl_capable(j.device),
        gpu: crate::device::gpu_identity(j.device),
    };
    if me.cuda && !me.nccl {
        tracing::warn!(
            device = ?j.device,
            "NCCL unavailable (built without the cuda feature, or libnccl.so not on the \
             loader path): this generation's collectives use the staged TCP ring"
        );
    }
    let w = select::WORDS;
    let mut table = vec![0f32; w * j.world];
    table[w * j.rank..w * (j.rank + 1)].copy_from_slice(&me.encode());
    let mut t = Tensor::from_slice(&table);
    ring.all_reduce_sum(&mut t)?;
    let table = Vec::<f32>::try_from(&t.to_kind(Kind::Float))
        .map_err(|e| CollectiveError::Setup(format!("reading the members' devices: {e}")))?;
    let members = select::decode(&table);
    let backend = select::choose(&members, j.rank, j.choice);
    if me.nccl && backend != Backend::Nccl && j.choice == CollectiveChoice::Auto {
        tracing::info!(
            device = ?j.device,
            "not every member can use NCCL on a GPU of its own (a CPU member, no NCCL, or two ranks \
             on one GPU): this generation's collectives use the staged TCP ring"
        );
    }
    let coll: Box<dyn Collective> = match backend {
        Backend::Ring => Box::new(ring),
        Backend::StagedRing => Box::new(Staged::new(Box::new(ring), j.device)),
        Backend::Nccl => nccl(ring, j)?,
    };
    Ok((coll, backend))
}

#[cfg(feature = "cuda")]
fn nccl(
    mut ring: super::tcp::CpuRing,
    j: &Join<'_>,
) -> Result<Box<dyn Collective>, CollectiveError> {
    let Device::Cuda(ordinal) = j.device else {
        return Err(CollectiveError::Setup(
            "nccl chosen for a rank not on a CUDA device".into(),
        ));
    };
    let comm = super::nccl::connect_nccl(ring.ring_mut(), ordinal, j.timeout)?;
    // The ring carried the id; the communicator carries everything else.
    drop(ring);
    Ok(Box::new(comm))
}

#[cfg(not(feature = "cuda"))]
fn nccl(_ring: super::tcp::CpuRing, _j: &Join<'_>) -> Result<Box<dyn Collective>, CollectiveError> {
    // `select::choose` picks NCCL only when this rank said it can.
    Err(CollectiveError::Setup(
        "nccl chosen, but this worker was built without the cuda feature".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU generation on the real ring: every rank takes the plain ring
    /// (the CUDA branches of the choice are `select`'s tests).
    #[test]
    fn cpu_members_join_the_plain_ring() {
        let world = 3;
        let (ls, peers) = crate::collective::loopback_peers(world);
        let handles: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let peers = peers.clone();
                std::thread::spawn(move || {
                    let j = Join {
                        rank,
                        world,
                        peers: &peers,
                        generation: 4,
                        timeout: Duration::from_secs(30),
                        device: Device::Cpu,
                        choice: CollectiveChoice::Auto,
                        link: crate::collective::tcp::test_link(),
                    };
                    let (mut c, backend) = join(&l, &j).unwrap();
                    let mut t = Tensor::from_slice(&[rank as f32 + 1.0]);
                    c.all_reduce_sum(&mut t).unwrap();
                    (backend, f32::try_from(&t).unwrap(), c.device())
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (Backend::Ring, 6.0, Device::Cpu));
        }
        assert!(!nccl_capable(Device::Cpu));
    }
}
