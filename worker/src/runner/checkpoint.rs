//! `CheckpointRequest` on the runner thread: snapshot in step order with
//! the plans around it (it may run collectives), then hand the write to the
//! background [`Writer`](super::writer::Writer).

use std::path::PathBuf;

use tracing::info;

use super::thread::Thread;
use super::writer::Answer;
use crate::error::classify;
use crate::wire;
use accrue_checkpoint::{Cursor, Manifest, SourcePos};

impl Thread {
    pub(super) fn checkpoint(&mut self, c: &wire::CheckpointRequest) {
        let Some(h) = self.replica(&c.job_id, c.step, "checkpoint") else {
            return;
        };
        let manifest = Manifest {
            job: c.job_id.clone(),
            name: h.name.clone(),
            step: c.step,
            cursor: c.cursor.as_ref().map_or_else(Default::default, |k| Cursor {
                epoch: k.epoch,
                position: k.position,
                overflow: k.overflow.clone(),
                sources: k
                    .sources
                    .iter()
                    .map(|p| SourcePos {
                        epoch: p.epoch,
                        position: p.position,
                    })
                    .collect(),
                mixed: k.mixed.clone(),
                mix_rev: k.mix_rev,
            }),
            world_size: h.world_size.max(1),
            generation: h.generation,
        };
        let (rank, generation) = (h.rank, h.generation);
        let write = match h.exec.checkpoint_snapshot() {
            Ok(w) => w,
            Err(e) => {
                let msg = format!("checkpoint of step {} (snapshot): {e:#}", c.step);
                let (kind, peer) = classify(&e);
                let job = c.job_id.clone();
                return self.error(&job, generation, c.step, kind, msg, peer);
            }
        };
        info!(step = c.step, rank, dir = %c.dir, "checkpoint snapshot taken; writing in the background");
        let answer = Answer {
            out: self.out.clone(),
            job: c.job_id.clone(),
            generation,
        };
        self.writer
            .start(write, PathBuf::from(&c.dir), rank, manifest, answer);
    }
}
