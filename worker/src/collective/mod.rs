//! Collectives between the ranks of one generation (DESIGN.md "Ranks and
//! collectives"): the [`Collective`] trait the trainers call, over flat
//! contiguous float32 tensors, and its backends:
//! - [`local::LocalGroup`]: ranks as threads of one process (tests, and the
//!   reference the other backends are checked against);
//! - [`tcp::CpuRing`]: the CPU TCP ring (`accrue-collective` crate) between
//!   worker processes;
//! - [`staged::Staged`]: a GPU rank's tensors over the ring, through pinned
//!   host memory;
//! - `nccl::NcclComm`: NCCL through cudarc (feature `cuda`).
//!
//! [`join`] forms a generation's collective and [`select`] decides which
//! backend it uses (NCCL when every member can, else the ring).
//!
//! Shard layout for reduce-scatter / all-gather is [`shard_range`]: the
//! first `len % world` ranks hold one element more, so any length works.

pub mod bytes;
pub mod join;
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod reshard;
pub mod select;
pub mod staged;
pub mod tcp;
pub mod timed;

/// `world` listeners on OS-picked loopback ports and their addresses: the
/// peers of a test ring.
#[cfg(test)]
pub(crate) fn loopback_peers(world: usize) -> (Vec<std::net::TcpListener>, Vec<String>) {
    let ls: Vec<_> = (0..world)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let peers = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    (ls, peers)
}

use std::sync::Arc;

use tch::Tensor;

/// A failed collective: one error for the ring and every backend here,
/// owned by `accrue-collective`.
pub use accrue_collective::CollectiveError;

/// The operations sharded data parallelism needs. All are in place on a
/// flat, contiguous float32 tensor of the same length on every rank, and
/// all ranks must call the same operations in the same order.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank ends with the element-wise sum over ranks.
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError>;
    /// Afterwards this rank's [`shard_range`] of `t` holds the sum over
    /// ranks; the rest of `t` is unspecified.
    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError>;
    /// Each rank contributes its [`shard_range`] of `t`; afterwards every
    /// rank holds all shards.
    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError>;
    /// Every rank ends with `root`'s `t`.
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError>;
    fn barrier(&mut self) -> Result<(), CollectiveError>;
    /// A handle that interrupts this collective from another thread: an
    /// operation blocked on a frozen peer returns
    /// [`CollectiveError::Aborted`] at once, and the collective is unusable
    /// afterwards (the generation is over). `None` when the backend cannot.
    fn abort_handle(&self) -> Option<AbortHandle> {
        None
    }
    /// Where the tensors this backend reduces must live (the CPU backends:
    /// the CPU; NCCL: its GPU).
    fn device(&self) -> tch::Device {
        tch::Device::Cpu
    }
}

/// Interrupts a collective from another thread (see
/// [`Collective::abort_handle`]).
pub type AbortHandle = Arc<dyn Fn() + Send + Sync>;

/// The elements of a flat tensor of `len` elements owned by `rank` of
/// `world`: contiguous, in rank order, the first `len % world` ranks one
/// element longer (defined in `accrue-collective`, shared by every backend).
pub use accrue_collective::shard_range;

/// A single rank: every operation is the identity (world size 1).
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _: &mut Tensor) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn reduce_scatter_sum(&mut self, _: &mut Tensor) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_gather(&mut self, _: &mut Tensor) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn broadcast(&mut self, _: &mut Tensor, _: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// Every rank's `ok`, agreed through an all-reduce (also a barrier): how
/// many ranks were not ok. Checkpoints use it so that a write that failed
/// on one rank fails on all.
pub fn count_failures(coll: &mut dyn Collective, ok: bool) -> Result<usize, CollectiveError> {
    let mut t = Tensor::from_slice(&[if ok { 0f32 } else { 1f32 }]).to_device(coll.device());
    coll.all_reduce_sum(&mut t)?;
    let failed = f32::try_from(&t.to_device(tch::Device::Cpu)).unwrap_or(1.0);
    Ok(failed.round() as usize)
}

/// Checks that `t` is a flat contiguous float32 CPU tensor (what the CPU
/// backends read and write through raw slices).
pub fn check_flat_f32_cpu(op: &'static str, t: &Tensor) -> Result<usize, CollectiveError> {
    let bad = |detail: String| CollectiveError::Invalid { op, detail };
    if t.kind() != tch::Kind::Float {
        return Err(bad(format!("expected float32, got {:?}", t.kind())));
    }
    if t.device() != tch::Device::Cpu {
        return Err(bad(format!("expected a CPU tensor, got {:?}", t.device())));
    }
    if t.dim() != 1 || !t.is_contiguous() {
        return Err(bad(format!(
            "expected a flat contiguous tensor, got shape {:?}",
            t.size()
        )));
    }
    Ok(t.numel())
}

/// The f32 elements of a tensor checked by [`check_flat_f32_cpu`].
///
/// # Safety
/// `t` must be a flat contiguous f32 CPU tensor, and no other reference to
/// its storage may be used while the slice lives.
pub unsafe fn as_f32_slice_mut(t: &mut Tensor) -> &mut [f32] {
    let n = t.numel();
    if n == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n)
}
