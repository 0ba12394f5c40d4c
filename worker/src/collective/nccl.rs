//! The GPU backend (feature `cuda`): [`NcclComm`] implements [`Collective`]
//! for flat f32 CUDA tensors with NCCL through cudarc's raw bindings
//! (libraries loaded at run time, so this builds on machines without CUDA;
//! calling it without libcuda panics, so check `tch::Cuda::is_available()`
//! first). Shaped like [`super::tcp::CpuRing`]: same operations, same shard
//! layout ([`shard_range`]; uneven shards are padded internally because
//! NCCL's reduce-scatter and all-gather need equal counts), synchronous, one
//! deadline per operation.
//!
//! Bootstrap: rank 0 creates the NCCL unique id and it reaches the other
//! ranks through [`TcpRing::broadcast_bytes`] over the generation's CPU ring
//! (which [`super::join`] forms first, for the backend choice too). The id
//! embeds rank 0's bootstrap listener, so only rank 0 can make it: the
//! coordinator could at best relay it, which would cost a round trip
//! through it per generation; the ring already ties it to the generation
//! and keeps CUDA out of the coordinator (it never links cudarc).
//! `ncclCommInitRank` blocks until every rank joins, so it runs on a helper
//! thread bounded by the collective timeout: a rank that died between the
//! ring and the communicator is an error, not a hang.
//!
//! Aborts: [`Collective::abort_handle`] sets a flag the polling loop reads
//! every 50 µs; the loop then aborts the communicator (`ncclCommAbort`) on
//! the thread that owns it, so a step blocked on a frozen peer ends at
//! once when the coordinator moves to a newer generation.
//!
//! Streams: tch does not expose PyTorch's current stream; the worker never
//! sets one, so the current stream is the legacy default stream, and NCCL is
//! enqueued there (the null stream), ordered after the kernels that produced
//! the tensor. Each operation then polls that stream until it completes,
//! checking `ncclCommGetAsyncError`, and aborts the communicator at the
//! deadline: a dead peer becomes an error, not a hang. NCCL does not say
//! which peer failed, so those errors name none.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accrue_collective::TcpRing;
use cudarc::driver::{sys as cu, CudaContext};
use cudarc::nccl::{result as nccl, sys};
use tch::{Device, Kind, Tensor};

use super::{shard_range, AbortHandle, Collective, CollectiveError};

/// Whether this process can build an NCCL communicator: libcuda and
/// libnccl load (cudarc loads them at run time; calling into a missing one
/// panics, so this is asked first).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen the libraries.
    unsafe { cudarc::driver::sys::is_culib_present() && sys::is_culib_present() }
}

/// One rank of an NCCL communicator.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    device: Device,
    rank: usize,
    world: usize,
    seq: u64,
    timeout: Duration,
    aborted: bool,
    /// Set from another thread ([`Collective::abort_handle`]).
    abort: Arc<AtomicBool>,
}

/// The communicator handle crossing from the init thread.
struct SendComm(sys::ncclComm_t);
// SAFETY: a raw handle, used by one thread at a time.
unsafe impl Send for SendComm {}

// SAFETY: an NCCL communicator may be used from any thread, one at a time
// (`&mut self` on every operation guarantees that).
unsafe impl Send for NcclComm {}

/// Creates the NCCL communicator of `ring`'s generation on CUDA device
/// `ordinal`: rank 0 makes the unique id, the ring broadcasts it.
pub fn connect_nccl(
    ring: &mut TcpRing,
    ordinal: usize,
    timeout: Duration,
) -> Result<NcclComm, CollectiveError> {
    let setup = |what: &str, e: &dyn std::fmt::Debug| {
        CollectiveError::Setup(format!("nccl {what} on cuda:{ordinal}: {e:?}"))
    };
    let ctx = CudaContext::new(ordinal).map_err(|e| setup("context", &e))?;
    ctx.bind_to_thread().map_err(|e| setup("context", &e))?;
    let (rank, world) = (ring.rank(), ring.world_size());
    let mut id = if rank == 0 {
        let id = nccl::get_uniqueid().map_err(|e| setup("unique id", &e))?;
        id.internal.iter().map(|&c| c as u8).collect()
    } else {
        Vec::new()
    };
    ring.broadcast_bytes(&mut id, 0)?;
    let mut unique = sys::ncclUniqueId { internal: [0; 128] };
    if id.len() != unique.internal.len() {
        return Err(setup(
            "unique id",
            &format!("{} bytes from rank 0", id.len()),
        ));
    }
    for (d, s) in unique.internal.iter_mut().zip(&id) {
        *d = *s as std::ffi::c_char;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let init_ctx = ctx.clone();
    std::thread::spawn(move || {
        let result = init_ctx
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))
            .and_then(|()| {
                let mut comm = std::ptr::null_mut();
                // SAFETY: `comm` is an out-pointer; rank and world come from the ring.
                unsafe { nccl::comm_init_rank(&mut comm, world as i32, unique, rank as i32) }
                    .map(|_| SendComm(comm))
                    .map_err(|e| format!("{e:?}"))
            });
        let _ = tx.send(result);
    });
    let comm = match rx.recv_timeout(timeout) {
        Ok(Ok(c)) => c.0,
        Ok(Err(e)) => return Err(setup("init", &e)),
        // The init thread stays blocked in NCCL's bootstrap until it gives
        // up; the generation is over either way.
        Err(_) => {
            let secs = timeout.as_secs_f64();
            return Err(setup(
                "init",
                &format!("ranks did not all join within {secs:.1}s"),
            ));
        }
    };
    Ok(NcclComm {
        comm,
        ctx,
        device: Device::Cuda(ordinal),
        rank,
        world,
        seq: 0,
        timeout,
        aborted: false,
        abort: Arc::new(AtomicBool::new(false)),
    })
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted {
            // SAFETY: created by comm_init_rank, not yet destroyed.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

fn ptr(t: &Tensor, elems: usize) -> *mut c_void {
    // SAFETY (of the arithmetic): `elems` lies within the tensor.
    unsafe { (t.data_ptr() as *mut f32).add(elems) as *mut c_void }
}

impl NcclComm {
    fn check(&mut self, op: &'static str, t: &Tensor) -> Result<usize, CollectiveError> {
        let bad = |detail: String| CollectiveError::Invalid { op, detail };
        if self.abort.load(Ordering::Relaxed) {
            return Err(CollectiveError::Aborted { op, seq: self.seq });
        }
        if self.aborted {
            return Err(CollectiveError::Setup(format!(
                "{op}: nccl communicator aborted by an earlier error"
            )));
        }
        if t.kind() != Kind::Float || t.device() != self.device {
            return Err(bad(format!(
                "expected float32 on {:?}, got {:?} on {:?}",
                self.device,
                t.kind(),
                t.device()
            )));
        }
        if t.dim() != 1 || !t.is_contiguous() {
            return Err(bad(format!(
                "expected a flat contiguous tensor, got {:?}",
                t.size()
            )));
        }
        self.seq += 1;
        Ok(t.numel())
    }

    /// Enqueues `f` on the default stream and waits for it under the deadline.
    fn run(
        &mut self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<(), CollectiveError> {
        let fail = |this: &mut Self, detail: String| {
            // SAFETY: valid communicator; aborting unblocks its kernels.
            let _ = unsafe { nccl::comm_abort(this.comm) };
            this.aborted = true;
            CollectiveError::Setup(format!("{op} #{}: {detail}", this.seq))
        };
        self.ctx
            .bind_to_thread()
            .map_err(|e| CollectiveError::Setup(format!("{op}: cuda context: {e:?}")))?;
        if let Err(e) = f(self.comm, std::ptr::null_mut()) {
            return Err(fail(self, format!("nccl error {:?}", e.0)));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            // SAFETY: the null stream is the legacy default stream.
            match unsafe { cu::cuStreamQuery(std::ptr::null_mut()) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(fail(self, format!("cuda stream error {e:?}"))),
            }
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: valid communicator and out-pointer.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            if !matches!(
                async_err,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                return Err(fail(self, format!("nccl async error {async_err:?}")));
            }
            if self.abort.load(Ordering::Relaxed) {
                // SAFETY: valid communicator; aborting unblocks its kernels.
                let _ = unsafe { nccl::comm_abort(self.comm) };
                self.aborted = true;
                return Err(CollectiveError::Aborted { op, seq: self.seq });
            }
            if Instant::now() >= deadline {
                let secs = self.timeout.as_secs_f64();
                return Err(fail(
                    self,
                    format!("timed out after {secs:.1}s (nccl names no peer)"),
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// A zeroed buffer of `world` equal shards of `m` elements.
    fn padded(&self, m: usize) -> Tensor {
        Tensor::zeros([(m * self.world) as i64], (Kind::Float, self.device))
    }
}

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;

fn narrow(t: &Tensor, start: usize, len: usize) -> Tensor {
    t.narrow(0, start as i64, len as i64)
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = self.check("all_reduce", t)?;
        if n == 0 {
            return Ok(());
        }
        let p = ptr(t, 0);
        // SAFETY: in place on n valid device floats.
        self.run("all_reduce", |c, s| unsafe {
            nccl::all_reduce(p, p, n, F32, SUM, c, s)
        })
    }

    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = self.check("reduce_scatter", t)?;
        let (w, r) = (self.world, self.rank);
        let m = n.div_ceil(w);
        if m == 0 {
            return Ok(());
        }
        if n % w == 0 {
            let (src, dst) = (ptr(t, 0), ptr(t, r * m));
            // SAFETY: NCCL's in-place form (recv = send + rank·count).
            return self.run("reduce_scatter", |c, s| unsafe {
                nccl::reduce_scatter(src, dst, m, F32, SUM, c, s)
            });
        }
        let padded = self.padded(m);
        for k in 0..w {
            let sr = shard_range(n, w, k);
            narrow(&padded, k * m, sr.len()).copy_(&narrow(t, sr.start, sr.len()));
        }
        let out = Tensor::zeros([m as i64], (Kind::Float, self.device));
        let (src, dst) = (ptr(&padded, 0), ptr(&out, 0));
        // SAFETY: `padded` holds w·m floats, `out` m; both live until synced.
        self.run("reduce_scatter", |c, s| unsafe {
            nccl::reduce_scatter(src, dst, m, F32, SUM, c, s)
        })?;
        let own = shard_range(n, w, r);
        narrow(t, own.start, own.len()).copy_(&narrow(&out, 0, own.len()));
        Ok(())
    }

    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        let n = self.check("all_gather", t)?;
        let (w, r) = (self.world, self.rank);
        let m = n.div_ceil(w);
        if m == 0 {
            return Ok(());
        }
        if n % w == 0 {
            let (src, dst) = (ptr(t, r * m), ptr(t, 0));
            // SAFETY: NCCL's in-place form (send = recv + rank·count).
            return self.run("all_gather", |c, s| unsafe {
                nccl::all_gather(src, dst, m, F32, c, s)
            });
        }
        let padded = self.padded(m);
        let own = shard_range(n, w, r);
        narrow(&padded, r * m, own.len()).copy_(&narrow(t, own.start, own.len()));
        let (src, dst) = (ptr(&padded, r * m), ptr(&padded, 0));
        // SAFETY: in place within `padded` (w·m floats), alive until synced.
        self.run("all_gather", |c, s| unsafe {
            nccl::all_gather(src, dst, m, F32, c, s)
        })?;
        for k in 0..w {
            let sr = shard_range(n, w, k);
            narrow(t, sr.start, sr.len()).copy_(&narrow(&padded, k * m, sr.len()));
        }
        Ok(())
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        let n = self.check("broadcast", t)?;
        if root >= self.world {
            return Err(CollectiveError::Invalid {
                op: "broadcast",
                detail: format!("root {root} outside world {}", self.world),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let p = ptr(t, 0);
        let root = root as i32;
        // SAFETY: in place on n valid device floats.
        self.run("broadcast", |c, s| unsafe {
            nccl::broadcast(p, p, n, F32, root, c, s)
        })
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut one = Tensor::zeros([1], (Kind::Float, self.device));
        self.all_reduce_sum(&mut one)
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        let flag = self.abort.clone();
        Some(Arc::new(move || flag.store(true, Ordering::Relaxed)))
    }

    fn device(&self) -> Device {
        self.device
    }
}
