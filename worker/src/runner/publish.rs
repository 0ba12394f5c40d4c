//! Weights out (`rl.publish_every`, issue 5): the current policy written as
//! a Hugging Face model directory (`config.json`, `model*.safetensors`, the
//! index when sharded) that an external generator (vLLM, transformers)
//! reloads. Every rank snapshots and writes its part through the checkpoint
//! writer (so ddp, zero2 and fsdp all work), drops its optimizer file (a
//! policy carries no optimizer state) and lists its files in its marker
//! `rank-R.json`; after a barrier (every rank's part is durable) rank 0
//! adds `policy.json` `{step, job}` last, so its presence means the
//! directory is complete, and points `../policy.json` at it for generators
//! that poll one place.

use std::path::Path;

use serde::Serialize;
use tracing::info;

use super::thread::Thread;
use crate::error::classify;
use crate::train::checkpoint::optimizer_file;
use crate::train::Trainer;
use crate::wire;
use crate::wire::worker_message::Msg;

/// `policy.json`: which step of which job the directory holds.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct PolicyMarker {
    pub job: String,
    pub step: u64,
    /// The policy directory (in the parent's `policy.json`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path: String,
}

/// Writes this rank's part of the policy in `dir`; rank 0 adds the
/// markers once every rank's files are written.
pub fn write_policy(
    exec: &mut dyn Trainer,
    rank: u32,
    world: u32,
    dir: &Path,
    marker: &PolicyMarker,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let write = exec.checkpoint_snapshot()?;
    let mut files = write(dir)?;
    let opt = if world <= 1 {
        "optimizer.safetensors".to_string()
    } else {
        optimizer_file(rank as usize, world as usize)
    };
    // A LoRA job's rank 0 writes the whole (small) adapter state as
    // `optimizer.safetensors` whatever the world size.
    let dropped = [opt.as_str(), "optimizer.safetensors", "trainer.json"];
    for f in dropped {
        if f == opt || rank == 0 {
            remove_if_present(&dir.join(f))?;
        }
    }
    files.retain(|f| !dropped.contains(&f.as_str()));
    accrue_checkpoint::write_marker(dir, rank, world, &files)?;
    // Every rank's part is durable before rank 0 marks the policy complete.
    exec.barrier()?;
    if rank != 0 {
        return Ok(());
    }
    accrue_checkpoint::write_durable(
        &dir.join("policy.json"),
        &serde_json::to_vec_pretty(marker)?,
    )?;
    if let Some(parent) = dir.parent() {
        let latest = PolicyMarker {
            path: dir.display().to_string(),
            ..marker.clone()
        };
        accrue_checkpoint::write_durable(
            &parent.join("policy.json"),
            &serde_json::to_vec_pretty(&latest)?,
        )?;
    }
    Ok(())
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl Thread {
    /// `PublishPolicy`: write, then `PolicyPublished` (or an error naming
    /// the directory).
    pub(super) fn publish(&mut self, p: &wire::PublishPolicy) {
        let Some(h) = self.replica(&p.job_id, p.step, "policy") else {
            return;
        };
        let dir = Path::new(&p.dir);
        let marker = PolicyMarker {
            job: p.job_id.clone(),
            step: p.step,
            path: String::new(),
        };
        let (rank, generation) = (h.rank, h.generation);
        if let Err(e) = write_policy(h.exec.as_mut(), h.rank, h.world_size, dir, &marker) {
            let msg = format!("policy of step {} to {}: {e:#}", p.step, dir.display());
            let (job, generation) = (h.job.clone(), h.generation);
            let (kind, peer) = classify(&e);
            return self.error(&job, generation, p.step, kind, msg, peer);
        }
        info!(step = p.step, rank, dir = %dir.display(), "policy published");
        self.send(Msg::PolicyPublished(wire::PolicyPublished {
            job_id: p.job_id.clone(),
            step: p.step,
            rank,
            path: p.dir.clone(),
            generation,
        }));
    }
}
