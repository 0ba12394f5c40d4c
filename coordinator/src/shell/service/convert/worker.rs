//! Workers: what an operator sees of one, the errors they report, the state they hold.

use accrue_proto::v1 as wire;

use crate::core::{HeldState, Peer, Worker, WorkerErrorKind, WorkerState};

/// `generator`: the worker's rank among its generation's generators, if it
/// is one (`Coordinator::generator_rank`).
pub fn worker_info(w: &Worker, generator: Option<u32>, now_ms: i64) -> wire::WorkerInfo {
    let state = match w.state {
        WorkerState::Registered => wire::WorkerState::Registered,
        WorkerState::Idle => wire::WorkerState::Idle,
        WorkerState::Configuring => wire::WorkerState::Configuring,
        WorkerState::Active => wire::WorkerState::Active,
        WorkerState::Draining => wire::WorkerState::Draining,
        WorkerState::Lost => wire::WorkerState::Lost,
    };
    wire::WorkerInfo {
        worker_id: w.id.clone(),
        hostname: w.reg.hostname.clone(),
        device: w.reg.device.clone(),
        state: state as i32,
        job_id: w.job.clone().unwrap_or_default(),
        rank: w.rank.or(generator),
        last_seen_ms_ago: (now_ms - w.last_seen_ms()).max(0) as u64,
        memory_bytes: w.reg.memory_bytes,
        gpu_name: w.reg.gpu_name.clone(),
        gpu_memory_bytes: w.reg.gpu_memory_bytes,
        generator: generator.is_some(),
    }
}

pub fn error_kind(kind: i32, peer_rank: Option<u32>, weight_ring: bool) -> WorkerErrorKind {
    let peer = peer_rank.map(|r| match weight_ring {
        true => Peer::WeightRing(r),
        false => Peer::Rank(r),
    });
    match wire::ErrorKind::try_from(kind).unwrap_or(wire::ErrorKind::Unspecified) {
        wire::ErrorKind::NonFinite => WorkerErrorKind::NonFinite,
        wire::ErrorKind::CollectiveTimeout => WorkerErrorKind::CollectiveTimeout { peer },
        wire::ErrorKind::InvalidPlan => WorkerErrorKind::InvalidPlan,
        wire::ErrorKind::RestoreFailed => WorkerErrorKind::RestoreFailed,
        wire::ErrorKind::StateSync => WorkerErrorKind::StateSync,
        wire::ErrorKind::OutOfMemory => WorkerErrorKind::OutOfMemory,
        wire::ErrorKind::Data => WorkerErrorKind::Data,
        wire::ErrorKind::CheckpointWrite => WorkerErrorKind::CheckpointWrite,
        wire::ErrorKind::RelayLink => WorkerErrorKind::RelayLink { peer_rank },
        wire::ErrorKind::Internal | wire::ErrorKind::Unspecified => WorkerErrorKind::Internal,
    }
}

/// A held state on the wire.
pub fn held_state(h: &HeldState) -> wire::HeldState {
    wire::HeldState {
        job_id: h.job.clone(),
        step: h.step,
        world_size: h.world_size,
        rank: h.rank,
        generation: h.generation,
    }
}

/// A worker's reported held state (`register.held`): it must name a job
/// and a rank inside its world.
pub fn held_from_wire(h: wire::HeldState) -> Result<HeldState, tonic::Status> {
    if h.job_id.is_empty() {
        return Err(tonic::Status::invalid_argument(
            "held.job_id: must not be empty",
        ));
    }
    if h.rank >= h.world_size {
        return Err(tonic::Status::invalid_argument(format!(
            "held.rank: {} is not below held.world_size = {}",
            h.rank, h.world_size
        )));
    }
    Ok(HeldState {
        job: h.job_id,
        step: h.step,
        world_size: h.world_size,
        rank: h.rank,
        generation: h.generation,
    })
}
