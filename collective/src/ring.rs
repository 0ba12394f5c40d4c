//! [`TcpRing`]: runs the [`crate::plan`] schedules over the two connections
//! of a rank. Each operation spawns a scoped sender thread that writes the
//! send pieces to the next rank while the calling thread reads (and adds in)
//! the pieces from the previous rank; the pieces' `after` counts, exchanged
//! through a mutex and condvar, keep the two threads off each other's bytes.
//!
//! Failure is loud and bounded: every piece's header is checked against what
//! this rank expects (generation, sequence number, operation, step, bytes),
//! every socket read and write runs under the operation's deadline, and the
//! first error shuts both sockets down (waking the other thread) and marks
//! the ring broken: a new generation must form a new ring.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::config::RingConfig;
use crate::connect::{connect, Links, Seals};
use crate::error::{CollectiveError, CollectiveResult};
use crate::link::{Sealing, TAG_LEN};
use crate::plan::{self, Apply, Piece, Ring, Schedule};
use crate::wire::{Header, Op, HEADER_LEN, MAGIC};

/// Default piece size: large enough that per-piece costs (header, syscalls,
/// condvar) vanish, small enough that forwarding starts early.
pub const DEFAULT_CHUNK_BYTES: usize = 256 << 10;

/// One rank's end of a ring of TCP connections (see the crate docs).
pub struct TcpRing {
    rank: usize,
    world: usize,
    generation: u64,
    timeout: Duration,
    seq: u64,
    chunk_bytes: usize,
    links: Option<Links>,
    /// What this rank sends to the next, and receives from the previous,
    /// is sealed with these when the link key seals (`crate::link`).
    seal_out: Option<Sealing>,
    seal_in: Option<Sealing>,
    broken: Option<CollectiveError>,
    scratch: Vec<f32>,
    /// Set by a [`RingAbort`] from another thread.
    aborted: Arc<AtomicBool>,
}

/// Interrupts a [`TcpRing`] from another thread ([`TcpRing::abort_handle`]):
/// an operation blocked on a frozen peer returns [`CollectiveError::Aborted`] at
/// once instead of at its deadline, and the ring is broken from then on.
#[derive(Debug, Clone)]
pub struct RingAbort {
    flag: Arc<AtomicBool>,
    /// Clones of the ring's sockets: shutting them down wakes a blocked
    /// read or write.
    streams: Arc<Vec<TcpStream>>,
}

impl RingAbort {
    /// Marks the ring aborted and shuts its sockets down (idempotent).
    pub fn abort(&self) {
        self.flag.store(true, Ordering::SeqCst);
        for s in self.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Whether [`abort`](Self::abort) was called.
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }
}

impl std::fmt::Debug for TcpRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRing")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("generation", &self.generation)
            .field("seq", &self.seq)
            .field("broken", &self.broken.is_some())
            .finish()
    }
}

impl TcpRing {
    /// Forms the ring: dials the next rank and accepts the previous one on
    /// `listener` (bound once per process, reused by every generation), both
    /// within `cfg.timeout`.
    pub fn connect(listener: &TcpListener, cfg: RingConfig) -> CollectiveResult<TcpRing> {
        cfg.validate()?;
        let (links, seals) = if cfg.world > 1 {
            let (links, seals) = connect(listener, &cfg, Instant::now() + cfg.timeout)?;
            (Some(links), seals)
        } else {
            let none = Seals {
                out: None,
                inward: None,
            };
            (None, none)
        };
        tracing::debug!(
            rank = cfg.rank,
            world = cfg.world,
            generation = cfg.generation,
            "ring formed"
        );
        Ok(TcpRing {
            rank: cfg.rank,
            world: cfg.world,
            generation: cfg.generation,
            timeout: cfg.timeout,
            seq: 0,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            links,
            seal_out: seals.out,
            seal_in: seals.inward,
            broken: None,
            scratch: Vec::new(),
            aborted: Arc::new(AtomicBool::new(false)),
        })
    }

    /// A handle that aborts this ring from another thread (see
    /// [`RingAbort`]). Fails only if the sockets cannot be cloned.
    pub fn abort_handle(&self) -> std::io::Result<RingAbort> {
        let streams = match &self.links {
            Some(l) => vec![l.to_next.try_clone()?, l.from_prev.try_clone()?],
            None => Vec::new(),
        };
        Ok(RingAbort {
            flag: self.aborted.clone(),
            streams: Arc::new(streams),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Operations started so far (the sequence number of the last one).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Sets the most bytes per message piece (every rank must use the same
    /// value; at least 4, at most 1 GiB).
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = bytes.clamp(4, 1 << 30);
    }

    /// Every rank ends with the element-wise sum over ranks.
    pub fn all_reduce_sum(&mut self, buf: &mut [f32]) -> CollectiveResult<()> {
        let s = plan::all_reduce(self.geometry(), buf.len());
        self.run(Op::AllReduce, f32_bytes(buf), &s)
    }

    /// Afterwards this rank's `shard_range` of `buf` holds the sum over
    /// ranks; the rest of `buf` holds partial sums.
    pub fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> CollectiveResult<()> {
        let s = plan::reduce_scatter(self.geometry(), buf.len());
        self.run(Op::ReduceScatter, f32_bytes(buf), &s)
    }

    /// Each rank contributes its `shard_range` of `buf`; afterwards every
    /// rank holds all shards.
    pub fn all_gather(&mut self, buf: &mut [f32]) -> CollectiveResult<()> {
        let s = plan::all_gather(self.geometry(), buf.len(), 4);
        self.run(Op::AllGather, f32_bytes(buf), &s)
    }

    /// Every rank ends with `root`'s `buf` (same length on every rank).
    pub fn broadcast(&mut self, buf: &mut [f32], root: usize) -> CollectiveResult<()> {
        self.check_root("broadcast", root)?;
        let s = plan::broadcast(self.geometry(), buf.len() * 4, root);
        self.run(Op::Broadcast, f32_bytes(buf), &s)
    }

    /// Every rank ends with `root`'s bytes; other ranks' `buf` may have any
    /// length (it is resized), e.g. to hand out an NCCL unique id.
    pub fn broadcast_bytes(&mut self, buf: &mut Vec<u8>, root: usize) -> CollectiveResult<()> {
        self.check_root("broadcast_bytes", root)?;
        let mut len = (buf.len() as u64).to_le_bytes();
        let s = plan::broadcast(self.geometry(), len.len(), root);
        self.run(Op::BroadcastLen, &mut len, &s)?;
        let len = u64::from_le_bytes(len);
        let len = usize::try_from(len).map_err(|_| CollectiveError::Invalid {
            op: "broadcast_bytes",
            detail: format!("rank {root} broadcasts {len} bytes"),
        })?;
        buf.resize(len, 0);
        let s = plan::broadcast(self.geometry(), len, root);
        self.seq -= 1; // one operation, two schedules
        self.run(Op::BroadcastBytes, buf, &s)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> CollectiveResult<()> {
        let s = plan::all_gather(self.geometry(), 0, 1);
        self.run(Op::Barrier, &mut [], &s)
    }

    fn geometry(&self) -> Ring {
        Ring {
            world: self.world,
            rank: self.rank,
            chunk_bytes: self.chunk_bytes,
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> CollectiveResult<()> {
        if root < self.world {
            return Ok(());
        }
        Err(CollectiveError::Invalid {
            op,
            detail: format!("root {root} outside world {}", self.world),
        })
    }

    /// Runs one schedule on `buf`, under one deadline.
    fn run(&mut self, op: Op, buf: &mut [u8], sched: &Schedule) -> CollectiveResult<()> {
        self.seq += 1;
        if self.broken.is_none() && self.aborted.load(Ordering::SeqCst) {
            self.broken = Some(CollectiveError::Aborted {
                op: op.name(),
                seq: self.seq,
            });
        }
        if let Some(first) = &self.broken {
            return Err(CollectiveError::Broken {
                op: op.name(),
                seq: self.seq,
                first: Box::new(first.clone()),
            });
        }
        let Some(links) = &self.links else {
            return Ok(()); // world size 1
        };
        // A sealed piece comes with its tag, read into the scratch too.
        let tag = if self.seal_in.is_some() { TAG_LEN } else { 0 };
        let max_recv = sched
            .recvs
            .iter()
            .map(|p| p.bytes.len() + tag)
            .max()
            .unwrap_or(0);
        if self.scratch.len() * 4 < max_recv {
            self.scratch.resize(max_recv.div_ceil(4), 0.0);
        }
        let ctx = Ctx {
            op,
            seq: self.seq,
            generation: self.generation,
            total: sched.total,
            next: (self.rank + 1) % self.world,
            prev: (self.rank + self.world - 1) % self.world,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
            links,
            buf: RawBuf {
                ptr: buf.as_mut_ptr(),
                len: buf.len(),
            },
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            aborted: &self.aborted,
        };
        let scratch = &mut self.scratch;
        let (seal_out, seal_in) = (self.seal_out.as_mut(), self.seal_in.as_mut());
        std::thread::scope(|s| {
            let ctx = &ctx;
            let sender = s.spawn(move || ctx.finish(ctx.send_all(&sched.sends, seal_out)));
            ctx.finish(ctx.recv_all(&sched.recvs, scratch, seal_in));
            sender.join().expect("ring sender panicked");
        });
        let result = ctx
            .progress
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .first;
        match result {
            None => Ok(()),
            Some(e) => {
                tracing::warn!(rank = self.rank, generation = self.generation, error = %e, "ring broken");
                self.broken = Some(e.clone());
                Err(e)
            }
        }
    }
}

impl Drop for TcpRing {
    fn drop(&mut self) {
        if let Some(l) = &self.links {
            let _ = l.to_next.shutdown(Shutdown::Both);
            let _ = l.from_prev.shutdown(Shutdown::Both);
        }
    }
}

fn f32_bytes(buf: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no invalid bit patterns and u8 has alignment 1; the
    // crate only builds for little-endian targets, so these are the wire bytes.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), buf.len() * 4) }
}

/// The operation's buffer, shared by the sender and receiving threads. The
/// schedule's `after` counts guarantee that a range is never written by one
/// thread while the other reads or writes it.
#[derive(Clone, Copy)]
struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: see the type's docs; the pointer outlives the scoped threads.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// # Safety
    /// No other thread may write `r` while the slice lives.
    unsafe fn get(&self, r: std::ops::Range<usize>) -> &[u8] {
        assert!(r.start <= r.end && r.end <= self.len);
        std::slice::from_raw_parts(self.ptr.add(r.start), r.len())
    }

    /// # Safety
    /// No other thread may touch `r` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        assert!(r.start <= r.end && r.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len())
    }
}

#[derive(Default)]
struct Progress {
    sent: usize,
    recvd: usize,
    first: Option<CollectiveError>,
}

/// One operation in flight.
struct Ctx<'a> {
    op: Op,
    seq: u64,
    generation: u64,
    total: usize,
    next: usize,
    prev: usize,
    deadline: Instant,
    timeout: Duration,
    links: &'a Links,
    buf: RawBuf,
    progress: Mutex<Progress>,
    changed: Condvar,
    aborted: &'a AtomicBool,
}

/// How often a thread waiting on the other one re-checks the abort flag.
const ABORT_POLL: Duration = Duration::from_millis(20);

impl Ctx<'_> {
    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    fn aborted_error(&self) -> CollectiveError {
        CollectiveError::Aborted {
            op: self.op.name(),
            seq: self.seq,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the first error, and wakes the other thread (sockets shut
    /// down, condvar notified) so it stops too.
    fn finish(&self, r: CollectiveResult<()>) {
        if let Err(e) = r {
            let mut p = self.lock();
            if p.first.is_none() {
                p.first = Some(e);
                let _ = self.links.to_next.shutdown(Shutdown::Both);
                let _ = self.links.from_prev.shutdown(Shutdown::Both);
            }
            self.changed.notify_all();
        }
    }

    fn header(&self, p: &Piece) -> Header {
        Header {
            magic: MAGIC,
            op: self.op as u32,
            generation: self.generation,
            seq: self.seq,
            step: p.step,
            nbytes: p.bytes.len() as u32,
            offset: p.bytes.start as u64,
            total: self.total as u64,
        }
    }

    fn timeout(&self, peer: usize) -> CollectiveError {
        CollectiveError::Timeout {
            op: self.op.name(),
            seq: self.seq,
            peer,
            secs: self.timeout.as_secs_f64(),
        }
    }

    fn io_error(&self, peer: usize, e: io::Error) -> CollectiveError {
        if self.is_aborted() {
            // The error is the abort's socket shutdown, not the peer's fault.
            return self.aborted_error();
        }
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self.timeout(peer),
            io::ErrorKind::UnexpectedEof => self.lost(peer, "connection closed".into()),
            _ => self.lost(peer, e.to_string()),
        }
    }

    fn lost(&self, peer: usize, detail: String) -> CollectiveError {
        CollectiveError::PeerLost {
            op: self.op.name(),
            seq: self.seq,
            peer,
            detail,
        }
    }

    /// Waits until `ready` holds; `Err(None)` if the other thread failed.
    fn wait(
        &self,
        ready: impl Fn(&Progress) -> bool,
        blame: usize,
    ) -> Result<(), Option<CollectiveError>> {
        let mut p = self.lock();
        loop {
            if p.first.is_some() {
                return Err(None);
            }
            if ready(&p) {
                return Ok(());
            }
            if self.is_aborted() {
                return Err(Some(self.aborted_error()));
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Some(self.timeout(blame)));
            }
            p = self
                .changed
                .wait_timeout(p, left.min(ABORT_POLL))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn left(&self, peer: usize) -> CollectiveResult<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            return Err(self.timeout(peer));
        }
        Ok(left)
    }

    fn send_all(&self, pieces: &[Piece], mut seal: Option<&mut Sealing>) -> CollectiveResult<()> {
        let s = &self.links.to_next;
        for (i, p) in pieces.iter().enumerate() {
            match self.wait(|g| g.recvd >= p.after, self.prev) {
                Ok(()) => {}
                Err(None) => return Ok(()),
                Err(Some(e)) => return Err(e),
            }
            s.set_write_timeout(Some(self.left(self.next)?))
                .map_err(|e| self.io_error(self.next, e))?;
            // SAFETY: the receiver writes these bytes only after this piece
            // is counted as sent (its `after`), and wrote them before it
            // counted the pieces this one waits for.
            let payload = unsafe { self.buf.get(p.bytes.clone()) };
            let header = self.header(p).encode();
            let payload = match seal.as_deref_mut() {
                Some(seal) => seal.seal(&header, payload),
                None => payload,
            };
            write_both(s, &header, payload).map_err(|e| self.io_error(self.next, e))?;
            self.lock().sent = i + 1;
            self.changed.notify_all();
        }
        Ok(())
    }

    fn recv_all(
        &self,
        pieces: &[Piece],
        scratch: &mut [f32],
        mut seal: Option<&mut Sealing>,
    ) -> CollectiveResult<()> {
        let s = &self.links.from_prev;
        for (i, p) in pieces.iter().enumerate() {
            match self.wait(|g| g.sent >= p.after, self.next) {
                Ok(()) => {}
                Err(None) => return Ok(()),
                Err(Some(e)) => return Err(e),
            }
            s.set_read_timeout(Some(self.left(self.prev)?))
                .map_err(|e| self.io_error(self.prev, e))?;
            let mut h = [0u8; HEADER_LEN];
            (&*s)
                .read_exact(&mut h)
                .map_err(|e| self.io_error(self.prev, e))?;
            let (got, want) = (Header::decode(&h), self.header(p));
            if got != want {
                return Err(CollectiveError::Mismatch {
                    op: self.op.name(),
                    peer: self.prev,
                    expected: want.to_string(),
                    got: got.to_string(),
                });
            }
            // SAFETY: the sender reads these bytes only in pieces that wait
            // for this one, and finished the pieces this one waits for.
            let dst = unsafe { self.buf.get_mut(p.bytes.clone()) };
            if let Some(seal) = seal.as_deref_mut() {
                self.recv_sealed(s, &h, p, dst, scratch, seal)?;
                self.lock().recvd = i + 1;
                self.changed.notify_all();
                continue;
            }
            match p.apply {
                Apply::Copy => (&*s).read_exact(dst),
                Apply::SumF32 => {
                    let n = dst.len() / 4;
                    let tmp = &mut scratch[..n];
                    (&*s)
                        .read_exact(f32_bytes(tmp))
                        .map(|()| add_into(dst, tmp))
                }
            }
            .map_err(|e| self.io_error(self.prev, e))?;
            self.lock().recvd = i + 1;
            self.changed.notify_all();
        }
        Ok(())
    }
}

impl Ctx<'_> {
    /// Reads piece `p` sealed (payload and tag) into the scratch, opens it
    /// with its `header` as associated data, and applies it to `dst`.
    fn recv_sealed(
        &self,
        s: &TcpStream,
        header: &[u8],
        p: &Piece,
        dst: &mut [u8],
        scratch: &mut [f32],
        seal: &mut Sealing,
    ) -> CollectiveResult<()> {
        let n = p.bytes.len();
        let bytes = f32_bytes(scratch);
        let sealed = &mut bytes[..n + TAG_LEN];
        (&*s)
            .read_exact(sealed)
            .map_err(|e| self.io_error(self.prev, e))?;
        let Some(plain) = seal.open(header, sealed) else {
            return Err(CollectiveError::Mismatch {
                op: self.op.name(),
                peer: self.prev,
                expected: "a piece sealed with this generation's link key".into(),
                got: "one that does not open (changed on the way, or not from the ring)".into(),
            });
        };
        match p.apply {
            Apply::Copy => dst.copy_from_slice(plain),
            Apply::SumF32 => {
                // SAFETY: the payload is opened in place at the start of
                // the f32 scratch, so it is 4-aligned, and `n` is a multiple of 4.
                let src =
                    unsafe { std::slice::from_raw_parts(plain.as_ptr().cast::<f32>(), n / 4) };
                add_into(dst, src);
            }
        }
        Ok(())
    }
}

/// `dst` (little-endian f32 bytes, 4-aligned) += `src`.
fn add_into(dst: &mut [u8], src: &[f32]) {
    debug_assert_eq!(dst.as_ptr().align_offset(4), 0);
    // SAFETY: `dst` comes from an f32 buffer at a multiple of 4 bytes.
    let dst =
        unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), dst.len() / 4) };
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// Writes `a` then `b` with as few syscalls as the kernel allows.
fn write_both(s: &TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = match (&*s).write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}
