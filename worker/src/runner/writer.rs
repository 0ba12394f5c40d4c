//! Asynchronous, atomic checkpoints (issue 6). A `CheckpointRequest` is
//! split in two:
//! 1. on the runner thread, [`Checkpointing::checkpoint_snapshot`](crate::train::Checkpointing::checkpoint_snapshot) copies
//!    what this rank writes into CPU memory (it may run collectives: FSDP
//!    gathers whole tensors, zero2 its moments), in step order with the
//!    plans around it;
//! 2. on a background thread ([`Writer`]), the files are written, fsynced
//!    and listed with sizes and checksums in this rank's marker
//!    `rank-R.json`, written last; rank 0 then writes `manifest.json`.
//!    No collective runs there: the ring belongs to training, which goes
//!    on with the next plans meanwhile. `CheckpointDone` is sent when this
//!    rank's part is durable.
//!
//! A crash mid-write leaves a directory without its markers or manifest,
//! which `accrue_checkpoint::verify` rejects at restore, while
//! older checkpoints (other directories) stay valid. One background write
//! runs at a time: a new request, a `Configure` and the thread's end wait
//! for the previous one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use super::fault;
use crate::train::{CheckpointWrite, Trainer};
use crate::wire;
use crate::wire::worker_message::Msg;
use accrue_checkpoint::{write_durable, write_marker, Manifest, MANIFEST};

/// Writes a snapshotted part into `dir`: the files, then this rank's
/// marker, then (rank 0) the manifest.
fn write_part(
    write: CheckpointWrite,
    dir: &Path,
    rank: u32,
    manifest: &Manifest,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let files = write(dir)?;
    fault::point(fault::Point::InCheckpointWrite, manifest.step, rank);
    write_marker(dir, rank, manifest.world_size, &files)?;
    if rank == 0 {
        write_durable(&dir.join(MANIFEST), &serde_json::to_vec_pretty(manifest)?)?;
    }
    Ok(())
}

/// Snapshots and writes a checkpoint part at once, on this thread (every
/// rank calls it; see the module docs for the files).
pub fn write_checkpoint(
    exec: &mut dyn Trainer,
    rank: u32,
    dir: &Path,
    manifest: &Manifest,
) -> anyhow::Result<()> {
    let write = exec.checkpoint_snapshot()?;
    write_part(write, dir, rank, manifest)
}

/// One background write in flight at most.
pub(super) struct Writer {
    /// The runner's pending-work count: a write in flight counts, so a
    /// released worker waits for it before exiting.
    pending: Arc<AtomicUsize>,
    current: Option<JoinHandle<()>>,
}

/// What the background write answers with.
pub(super) struct Answer {
    pub(super) out: UnboundedSender<wire::WorkerMessage>,
    pub(super) job: String,
    pub(super) generation: u64,
}

impl Writer {
    pub(super) fn new(pending: Arc<AtomicUsize>) -> Writer {
        Writer {
            pending,
            current: None,
        }
    }

    /// Waits for the write in flight, if any.
    pub(super) fn wait(&mut self) {
        if let Some(h) = self.current.take() {
            let _ = h.join();
        }
    }

    pub(super) fn start(
        &mut self,
        write: CheckpointWrite,
        dir: PathBuf,
        rank: u32,
        manifest: Manifest,
        answer: Answer,
    ) {
        self.wait();
        self.pending.fetch_add(1, Ordering::SeqCst);
        let pending = self.pending.clone();
        // Kept to answer even when the writer thread cannot start: a
        // checkpoint request is never left without a reply.
        let fallback = (answer.out.clone(), answer.job.clone(), answer.generation);
        let step = manifest.step;
        let spawned = std::thread::Builder::new()
            .name("accrue-checkpoint".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let msg = match write_part(write, &dir, rank, &manifest) {
                    Ok(()) => {
                        crate::metrics::global()
                            .observe_checkpoint_write(started.elapsed().as_secs_f64());
                        info!(step, rank, dir = %dir.display(), "checkpoint part durable");
                        Msg::CheckpointDone(wire::CheckpointDone {
                            job_id: answer.job,
                            step,
                            rank,
                            path: dir.display().to_string(),
                        })
                    }
                    Err(e) => {
                        let message =
                            format!("checkpoint of step {step} to {}: {e:#}", dir.display());
                        warn!(step, rank, %message, "checkpoint write failed");
                        Msg::Error(wire::WorkerError {
                            job_id: answer.job,
                            generation: answer.generation,
                            step,
                            kind: wire::ErrorKind::CheckpointWrite as i32,
                            message,
                            peer_rank: None,
                            weight_ring: false,
                        })
                    }
                };
                let _ = answer.out.send(wire::WorkerMessage { msg: Some(msg) });
                pending.fetch_sub(1, Ordering::SeqCst);
            });
        match spawned {
            Ok(h) => self.current = Some(h),
            Err(e) => {
                self.pending.fetch_sub(1, Ordering::SeqCst);
                warn!(error = %e, "cannot start the checkpoint writer thread");
                let (out, job_id, generation) = fallback;
                let msg = Msg::Error(wire::WorkerError {
                    job_id,
                    generation,
                    step,
                    kind: wire::ErrorKind::CheckpointWrite as i32,
                    message: format!(
                        "checkpoint of step {step}: cannot start the writer thread: {e}"
                    ),
                    peer_rank: None,
                    weight_ring: false,
                });
                let _ = out.send(wire::WorkerMessage { msg: Some(msg) });
            }
        }
    }
}
