//! Conversions between the wire (`accrue.v1`) and the domain types. The only
//! place either side's shape leaks into the other.

use accrue_proto::{pack_f32, v1 as wire};
use prost::Message as _;

use crate::core::relay::RelayRole;
use crate::core::{
    AbortReason, EventKind, HeldState, Job, JobState, MetricSums, PlanKind, Quarantined, Role,
    SeqLogp, StepMetrics, ToWorker, WatchItem, Worker, WorkerErrorKind, WorkerId, WorkerState,
};
use crate::job::objective::{DpoLoss, LossNormalization, OffPolicy, Reference};
use crate::job::spec::{CollectiveChoice, Dtype, JobSpec, Sharding};
use crate::stream::cursor::Cursor;
use crate::stream::doc::DocId;
use crate::stream::plan::Normalizers;

/// The resolved job workers train (`Configure.job`), from a validated spec:
/// every default is the spec's own (serde defaults and
/// [`crate::job::objective::ObjectiveSection::dpo`]/`pg`), so the worker has
/// none of its own.
pub fn job_definition(spec: &JobSpec) -> wire::JobDefinition {
    use wire::model_definition::Init;
    use wire::objective_definition::Kind;
    let model = &spec.model;
    let init = if model.is_random() {
        let config = model.config.as_ref().map(|p| p.display().to_string());
        Init::RandomConfig(config.unwrap_or_default())
    } else {
        Init::CheckpointDir(model.init.clone())
    };
    let reference = |r: Reference| match r {
        Reference::Cached => wire::Reference::Cached,
        Reference::Live => wire::Reference::Live,
    } as i32;
    let kind = if let Some(d) = spec.objective.dpo() {
        Kind::Dpo(wire::DpoObjective {
            beta: d.beta,
            loss: match d.loss {
                DpoLoss::Sigmoid => wire::DpoLoss::Sigmoid,
                DpoLoss::Ipo => wire::DpoLoss::Ipo,
                DpoLoss::DpoNorm => wire::DpoLoss::DpoNorm,
            } as i32,
            label_smoothing: d.label_smoothing,
            reference: reference(d.reference),
        })
    } else if let Some(p) = spec.objective.pg() {
        Kind::Pg(wire::PgObjective {
            clip_ratio: p.clip_ratio,
            kl_coef: p.kl_coef,
            reference: reference(p.reference),
            loss_normalization: match p.loss_normalization {
                LossNormalization::Token => wire::LossNormalization::Token,
                LossNormalization::Sequence => wire::LossNormalization::Sequence,
                LossNormalization::Constant => wire::LossNormalization::Constant,
            } as i32,
            normalization_constant: p.normalization_constant,
            off_policy: match p.off_policy {
                OffPolicy::Clip => wire::OffPolicy::Clip,
                OffPolicy::Tis => wire::OffPolicy::Tis,
            } as i32,
            tis_cap: p.tis_cap,
        })
    } else {
        Kind::Sft(wire::SftObjective {})
    };
    let o = &spec.optimizer;
    let dtype = |d: Dtype| match d {
        Dtype::Float32 => wire::Dtype::Float32,
        Dtype::Bfloat16 => wire::Dtype::Bfloat16,
    } as i32;
    wire::JobDefinition {
        name: spec.job.name.clone(),
        seed: spec.job.seed,
        model: Some(wire::ModelDefinition {
            init: Some(init),
            dtype: dtype(model.dtype),
        }),
        objective: Some(wire::ObjectiveDefinition { kind: Some(kind) }),
        optimizer: Some(wire::OptimizerDefinition {
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
            grad_clip: o.grad_clip,
            no_decay: o.no_decay.clone(),
        }),
        sharding: match spec.parallel.sharding {
            Sharding::Ddp => wire::Sharding::Ddp,
            Sharding::Zero2 => wire::Sharding::Zero2,
            Sharding::Fsdp => wire::Sharding::Fsdp,
        } as i32,
        runtime: Some(wire::RuntimeDefinition {
            loss_chunk_tokens: spec.runtime.loss_chunk_tokens,
            activation_checkpointing: spec.runtime.activation_checkpointing,
        }),
        precision: Some(wire::PrecisionDefinition {
            compute: dtype(spec.compute_dtype()),
            reduce: dtype(spec.precision.reduce),
        }),
        collective: match spec.parallel.collective {
            CollectiveChoice::Auto => wire::CollectiveChoice::Auto,
            CollectiveChoice::Ring => wire::CollectiveChoice::Ring,
        } as i32,
    }
}

pub fn job_state(s: JobState) -> wire::JobState {
    match s {
        JobState::Pending => wire::JobState::Pending,
        JobState::Running => wire::JobState::Running,
        JobState::Paused => wire::JobState::Paused,
        JobState::Completed => wire::JobState::Completed,
        JobState::Failed => wire::JobState::Failed,
        JobState::Cancelled => wire::JobState::Cancelled,
    }
}

pub fn cursor(c: &Cursor) -> wire::DataCursor {
    wire::DataCursor {
        epoch: c.epoch,
        position: c.position,
        overflow: c.overflow.clone(),
        sources: c
            .sources
            .iter()
            .map(|p| wire::SourcePosition {
                epoch: p.epoch,
                position: p.position,
            })
            .collect(),
        mixed: c.mixed.clone(),
        mix_rev: c.mix_rev,
    }
}

/// An evaluation's metrics, on the wire.
pub fn eval_metrics(m: &crate::core::EvalMetrics) -> wire::EvalMetrics {
    wire::EvalMetrics {
        step: m.step,
        loss: m.loss,
        loss_tokens: m.loss_tokens,
        tokens: m.tokens,
        documents: m.docs,
        extra: m.extra.clone().into_iter().collect(),
        sources: m
            .sources
            .iter()
            .map(|(k, v)| (k.clone(), source_metrics(v)))
            .collect(),
        unix_ms: m.unix_ms,
    }
}

/// One source's part of a step, on the wire.
pub fn source_metrics(m: &crate::core::SourceMetrics) -> wire::SourceMetrics {
    wire::SourceMetrics {
        loss: m.loss,
        loss_tokens: m.loss_tokens,
        tokens: m.tokens,
        documents: m.docs,
        extra: m.extra.clone().into_iter().collect(),
    }
}

pub fn job_summary(job: &Job) -> wire::JobSummary {
    let r = &job.rec;
    wire::JobSummary {
        job_id: r.id.clone(),
        name: r.name.clone(),
        state: job_state(r.state) as i32,
        step: r.step,
        total_steps: r.total_steps,
        cursor: Some(cursor(&r.cursor)),
        generation: r.generation,
        world_size: job.gen().map_or(0, |g| g.world_size()),
        reason: r.reason.clone(),
        last_loss: r.last_loss.unwrap_or(f64::NAN),
        submitted_unix_ms: r.submitted_unix_ms,
        documents: r.documents,
        quarantined: r.quarantine.len() as u64,
    }
}

/// A quarantined document on the wire, with the data file it came from.
pub fn quarantined(job: &Job, q: &Quarantined) -> wire::QuarantinedDocument {
    let source = match job.spec.data.train.get(q.doc.file as usize) {
        Some(path) => format!("{}:{}", path.display(), q.doc.line),
        None => format!("rollout {}", q.doc),
    };
    wire::QuarantinedDocument {
        doc_id: q.doc.to_string(),
        source,
        step: q.step,
        detail: q.detail.clone(),
        unix_ms: q.unix_ms,
    }
}

pub fn step_metrics(m: &StepMetrics) -> wire::StepMetrics {
    wire::StepMetrics {
        step: m.step,
        loss: m.loss,
        tokens: m.tokens,
        loss_tokens: m.loss_tokens,
        documents: m.docs,
        microbatches: m.microbatches,
        lr: m.lr,
        grad_norm: m.grad_norm,
        tokens_per_s: m.tokens_per_s,
        tokens_per_s_per_worker: m.tokens_per_s_per_worker,
        padding_fraction: m.padding_fraction,
        step_time_s: m.step_time_s,
        world_size: m.world_size,
        generation: m.generation,
        cursor: Some(cursor(&m.cursor)),
        extra: m.extra.clone().into_iter().collect(),
        model_flops: m.model_flops,
        mfu: m.mfu,
        sources: m
            .sources
            .iter()
            .map(|(k, v)| (k.clone(), source_metrics(v)))
            .collect(),
        gpu_memory_peak_allocated_bytes: m.gpu_memory_peak_allocated_bytes,
        gpu_memory_peak_reserved_bytes: m.gpu_memory_peak_reserved_bytes,
    }
}

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

pub fn watch_item(item: &WatchItem) -> wire::WatchJobResponse {
    use wire::watch_job_response::Item;
    let item = match item {
        WatchItem::Step(m) => Item::Step(step_metrics(m)),
        WatchItem::Eval(m) => Item::Eval(eval_metrics(m)),
        WatchItem::Event {
            kind,
            message,
            state,
            unix_ms,
            reason,
            aborted_step,
        } => Item::Event(wire::JobEvent {
            unix_ms: *unix_ms,
            kind: event_kind(*kind) as i32,
            message: message.clone(),
            state: job_state(*state) as i32,
            aborted_step: *aborted_step,
            abort_reason: reason.map_or(wire::AbortReason::Unspecified, abort_reason) as i32,
        }),
    };
    wire::WatchJobResponse { item: Some(item) }
}

pub fn event_kind(k: EventKind) -> wire::EventKind {
    match k {
        EventKind::State => wire::EventKind::State,
        EventKind::Generation => wire::EventKind::Generation,
        EventKind::Checkpoint => wire::EventKind::Checkpoint,
        EventKind::Config => wire::EventKind::Config,
        EventKind::Replay => wire::EventKind::Replay,
        EventKind::Reference => wire::EventKind::Reference,
        EventKind::Policy => wire::EventKind::Policy,
        EventKind::Quarantine => wire::EventKind::Quarantine,
    }
}

pub fn abort_reason(r: AbortReason) -> wire::AbortReason {
    match r {
        AbortReason::WorkerLost => wire::AbortReason::WorkerLost,
        AbortReason::CollectiveTimeout => wire::AbortReason::CollectiveTimeout,
        AbortReason::RestoreFailed => wire::AbortReason::RestoreFailed,
        AbortReason::StateSyncFailed => wire::AbortReason::StateSyncFailed,
        AbortReason::WorkerError => wire::AbortReason::WorkerError,
        AbortReason::Cancelled => wire::AbortReason::Cancelled,
        AbortReason::MembershipChange => wire::AbortReason::MembershipChange,
        AbortReason::JobFailed => wire::AbortReason::JobFailed,
        AbortReason::OutputFailed => wire::AbortReason::OutputFailed,
        AbortReason::StepDeadline => wire::AbortReason::StepDeadline,
        AbortReason::TooManyAttempts => wire::AbortReason::TooManyAttempts,
        AbortReason::NonFinite => wire::AbortReason::NonFinite,
    }
}

pub fn metric_sums(s: wire::MetricSums) -> MetricSums {
    MetricSums {
        loss_sum: s.loss_sum,
        loss_tokens: s.loss_tokens,
        tokens: s.tokens,
        documents: s.documents,
        padding_tokens: s.padding_tokens,
        microbatches: s.microbatches,
        compute_s: s.compute_s,
        collective_s: s.collective_s,
        optimizer_s: s.optimizer_s,
        idle_s: s.idle_s,
        grad_norm: s.grad_norm,
        extra: s.extra.into_iter().collect(),
        model_flops: s.model_flops,
        sources: s
            .sources
            .into_iter()
            .map(|(k, v)| {
                let sums = crate::core::SourceSums {
                    loss_sum: v.loss_sum,
                    loss_tokens: v.loss_tokens,
                    tokens: v.tokens,
                    documents: v.documents,
                    extra: v.extra.into_iter().collect(),
                };
                (k, sums)
            })
            .collect(),
        gpu_memory_peak_allocated_bytes: s.gpu_memory_peak_allocated_bytes,
        gpu_memory_peak_reserved_bytes: s.gpu_memory_peak_reserved_bytes,
    }
}

/// A reported sequence log-prob; `doc_id` must be a `file:line` id.
pub fn seq_logp(i: usize, l: wire::SequenceLogp) -> Result<SeqLogp, tonic::Status> {
    let doc = l.doc_id.parse::<DocId>().map_err(|e| {
        tonic::Status::invalid_argument(format!("step_result.logps[{i}].doc_id: {e}"))
    })?;
    if l.role > 1 {
        return Err(tonic::Status::invalid_argument(format!(
            "step_result.logps[{i}].role: expected 0 or 1, got {}",
            l.role
        )));
    }
    let tokens = accrue_proto::unpack_f32(&l.token_logps).map_err(|e| {
        tonic::Status::invalid_argument(format!("step_result.logps[{i}].token_logps: {e}"))
    })?;
    Ok(SeqLogp {
        doc,
        role: l.role,
        logp: l.logp,
        tokens,
    })
}

pub fn error_kind(kind: i32, peer_rank: Option<u32>) -> WorkerErrorKind {
    match wire::ErrorKind::try_from(kind).unwrap_or(wire::ErrorKind::Unspecified) {
        wire::ErrorKind::NonFinite => WorkerErrorKind::NonFinite,
        wire::ErrorKind::CollectiveTimeout => WorkerErrorKind::CollectiveTimeout { peer_rank },
        wire::ErrorKind::InvalidPlan => WorkerErrorKind::InvalidPlan,
        wire::ErrorKind::RestoreFailed => WorkerErrorKind::RestoreFailed,
        wire::ErrorKind::StateSync => WorkerErrorKind::StateSync,
        wire::ErrorKind::OutOfMemory => WorkerErrorKind::OutOfMemory,
        wire::ErrorKind::Data => WorkerErrorKind::Data,
        wire::ErrorKind::CheckpointWrite => WorkerErrorKind::CheckpointWrite,
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

fn normalizers(n: &Normalizers) -> wire::Normalizers {
    wire::Normalizers {
        loss_tokens: n.loss_tokens,
        pairs: n.pairs,
        documents: n.documents,
        sequences: n.sequences,
        tokens: n.tokens,
    }
}

/// The peer rank `rank` dials in the generation's ring (itself when alone).
fn ring_next(peers: &[(WorkerId, String)], rank: u32) -> Option<wire::Peer> {
    let next = (rank as usize + 1) % peers.len().max(1);
    peers.get(next).map(|(id, addr)| wire::Peer {
        rank: next as u32,
        worker_id: id.clone(),
        collective_addr: addr.clone(),
        prior: None,
    })
}

/// A microbatch's row as the wire carries it: token ids little-endian, 4
/// bytes a token (`pack_u32` of its rows), and its labels as a loss mask
/// when every sequence's are its ids or ignored, else packed (`pack_i32`);
/// written straight from its documents' sequences.
pub struct PackedRows {
    pub token_ids: Vec<u8>,
    pub labels: Vec<u8>,
    pub loss_mask: Vec<u8>,
}

pub fn packed_rows(mb: &crate::core::step::MicrobatchPayload) -> PackedRows {
    let tokens = mb.tokens() as usize;
    let mut token_ids = Vec::with_capacity(tokens * 4);
    let mut mask = accrue_proto::LossMask::with_capacity(tokens);
    // Documents first (their addresses need no load), then their rows
    // (their addresses are in the documents), then the copying.
    mb.prefetch_docs();
    mb.sequences()
        .for_each(crate::stream::doc::Sequence::prefetch);
    if mb
        .sequences()
        .all(|s| s.write_masked(&mut token_ids, &mut mask))
    {
        return PackedRows {
            token_ids,
            labels: Vec::new(),
            loss_mask: mask.into_bytes(),
        };
    }
    // A sequence with other labels: the whole row again, labels packed.
    token_ids.clear();
    let mut labels = Vec::with_capacity(tokens * 4);
    for seq in mb.sequences() {
        seq.write_le(&mut token_ids, &mut labels);
    }
    PackedRows {
        token_ids,
        labels,
        loss_mask: Vec::new(),
    }
}

pub fn to_worker(msg: &ToWorker) -> wire::CoordinatorMessage {
    use wire::coordinator_message::Msg;
    let msg = match msg {
        ToWorker::Configure {
            job,
            generation,
            rank,
            peers,
            priors,
            prior_runs,
            spec,
            step,
            restore_from,
            role,
            weights,
            relay,
        } => Msg::Configure(wire::Configure {
            job_id: job.clone(),
            generation: *generation,
            rank: *rank,
            world_size: peers.len() as u32,
            // O(1) in the world size: the neighbour, this rank's prior and
            // the runs, never the whole membership.
            peers: Vec::new(),
            // A generator joins only the weight ring.
            next: match role {
                Role::Trainer => ring_next(peers, *rank),
                Role::Generator => None,
            },
            role: match role {
                Role::Trainer => wire::Role::Trainer,
                Role::Generator => wire::Role::Generator,
            } as i32,
            weights: weights.as_ref().map(|w| wire::WeightRing {
                rank: w.rank,
                world_size: w.world,
                next: Some(wire::Peer {
                    rank: (w.rank + 1) % w.world.max(1),
                    worker_id: w.next.0.clone(),
                    collective_addr: w.next.1.clone(),
                    prior: None,
                }),
            }),
            prior: priors
                .get(*rank as usize)
                .and_then(Option::as_ref)
                .map(held_state),
            priors: prior_runs
                .iter()
                .map(|r| wire::PriorRun {
                    rank: r.rank,
                    count: r.count,
                    prior_rank: r.prior_rank,
                    prior_world_size: r.prior_world,
                })
                .collect(),
            job: Some(job_definition(spec)),
            step: *step,
            restore_from: restore_from
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            // Trainers answer train steps with one gathered message from
            // rank 0 (`Event::StepResults`); generators run no steps.
            gather_results: matches!(role, Role::Trainer),
            relay: relay.as_ref().map(|r| match r {
                RelayRole::Hub { token, followers } => wire::RelayRoute {
                    token: token.to_vec(),
                    hub_addr: String::new(),
                    followers: followers.clone(),
                    hub_rank: *rank,
                },
                RelayRole::Follower {
                    token,
                    hub,
                    hub_addr,
                } => wire::RelayRoute {
                    token: token.to_vec(),
                    hub_addr: hub_addr.clone(),
                    followers: Vec::new(),
                    hub_rank: *hub,
                },
            }),
        }),
        ToWorker::Plan {
            job,
            generation,
            rank,
            planned,
        } => Msg::StepPlan(wire::StepPlan {
            job_id: job.clone(),
            generation: *generation,
            step: planned.step,
            rank: *rank,
            lr: planned.lr,
            normalizers: Some(normalizers(&planned.normalizers)),
            microbatches: planned.ranks[*rank as usize]
                .iter()
                .map(|mb| {
                    // The token rows are materialised here, in the
                    // session's task, outside the state lock.
                    let rows = packed_rows(mb);
                    wire::Microbatch {
                        token_ids: rows.token_ids,
                        labels: rows.labels,
                        loss_mask: rows.loss_mask,
                        cu_seq_lens: mb.cu_seq_lens.clone(),
                        sequences: mb
                            .seqs
                            .iter()
                            .map(|s| wire::PackedSequence {
                                doc_id: String::new(),
                                doc_file: s.doc.file,
                                doc_line: s.doc.line,
                                role: s.role,
                                advantage: s.advantage,
                                ref_logp: s.ref_logp,
                            })
                            .collect(),
                        // pack_f32 of an empty slice is empty.
                        old_logprobs: pack_f32(&mb.old_logprobs()),
                        ref_logprobs: pack_f32(&mb.ref_logprobs()),
                        source: mb.source,
                    }
                })
                .collect(),
            cursor_after: Some(cursor(&planned.cursor_after)),
            kind: match planned.kind {
                PlanKind::Train => wire::PlanKind::Train,
                PlanKind::Reference => wire::PlanKind::Reference,
                PlanKind::Probe => wire::PlanKind::Probe,
                PlanKind::Eval => wire::PlanKind::Eval,
            } as i32,
            replay: planned.replay,
            max_tokens: planned.settings.max_tokens,
        }),
        ToWorker::Abort {
            job,
            generation,
            step,
            why,
        } => Msg::Abort(wire::Abort {
            job_id: job.clone(),
            generation: *generation,
            step: *step,
            detail: why.detail.clone(),
            reason: abort_reason(why.reason) as i32,
        }),
        ToWorker::Checkpoint {
            job,
            step,
            dir,
            cursor: c,
        } => Msg::CheckpointRequest(wire::CheckpointRequest {
            job_id: job.clone(),
            step: *step,
            dir: dir.display().to_string(),
            cursor: Some(cursor(c)),
        }),
        ToWorker::PublishPolicy { job, step, dir } => Msg::PublishPolicy(wire::PublishPolicy {
            job_id: job.clone(),
            step: *step,
            dir: dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            target: match dir {
                Some(_) => wire::PolicyTarget::Disk,
                None => wire::PolicyTarget::Generators,
            } as i32,
        }),
        ToWorker::SyncWeights {
            job,
            generation,
            version,
        } => Msg::SyncWeights(wire::SyncWeights {
            job_id: job.clone(),
            generation: *generation,
            version: *version,
        }),
        ToWorker::Release { job, reason } => Msg::Release(wire::Release {
            job_id: job.clone(),
            reason: reason.clone(),
        }),
        ToWorker::Generate {
            job,
            generation,
            rank,
            plan,
        } => Msg::GeneratePlan(super::generate::generate_plan(
            job,
            *generation,
            *rank,
            plan,
        )),
        // Each follower's message encoded here, in the hub's session task:
        // the hub forwards the bytes as they are.
        ToWorker::Relay {
            job,
            generation,
            messages,
        } => Msg::Relay(wire::Relay {
            job_id: job.clone(),
            generation: *generation,
            messages: messages
                .iter()
                .map(|(rank, m)| wire::Relayed {
                    rank: *rank,
                    message: to_worker(m).encode_to_vec(),
                })
                .collect(),
        }),
    };
    wire::CoordinatorMessage { msg: Some(msg) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire_held(rank: u32, world_size: u32) -> wire::HeldState {
        wire::HeldState {
            job_id: "j".into(),
            step: 7,
            world_size,
            rank,
            generation: 3,
        }
    }

    #[test]
    fn held_states_round_trip_and_bad_ones_name_the_field() {
        let h = held_from_wire(wire_held(1, 2)).unwrap();
        assert_eq!(held_state(&h), wire_held(1, 2));
        let err = held_from_wire(wire_held(2, 2)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("held.rank"), "{}", err.message());
        let mut nameless = wire_held(0, 1);
        nameless.job_id.clear();
        assert!(held_from_wire(nameless)
            .unwrap_err()
            .message()
            .contains("held.job_id"));
    }

    /// Issue 19: a generation's Configures are O(W) in total (each O(1)),
    /// even re-formed with every member holding the state; listing every
    /// peer in each made them O(W²).
    #[test]
    fn a_generations_configures_grow_linearly_with_its_size() {
        use std::sync::Arc;
        let spec: Arc<JobSpec> = Arc::new(
            toml::from_str(
                "[job]\nname = \"t\"\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
                 config = \"/c.json\"\n[data]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
            )
            .unwrap(),
        );
        let relaying = |w: usize| crate::core::relay::Relaying {
            token: vec![7; 16].into(),
            group: (w as f64).sqrt().ceil() as u32,
        };
        let total = |w: usize| -> usize {
            let peers: Arc<[(WorkerId, String)]> = (0..w)
                .map(|i| {
                    (
                        uuid::Uuid::new_v4().to_string(),
                        format!("10.0.{}.{}:29500", i / 256, i % 256),
                    )
                })
                .collect();
            let priors: Vec<Option<HeldState>> = (0..w)
                .map(|r| {
                    Some(HeldState {
                        job: "j".into(),
                        step: 9,
                        world_size: w as u32,
                        rank: r as u32,
                        generation: 1,
                    })
                })
                .collect();
            let prior_runs: Arc<[_]> = crate::core::recovery::prior_runs(&priors).into();
            let priors: Arc<[Option<HeldState>]> = priors.into();
            (0..w)
                .map(|r| {
                    to_worker(&ToWorker::Configure {
                        job: "j".into(),
                        generation: 2,
                        rank: r as u32,
                        peers: peers.clone(),
                        priors: priors.clone(),
                        prior_runs: prior_runs.clone(),
                        spec: spec.clone(),
                        step: 9,
                        restore_from: None,
                        role: Role::Trainer,
                        weights: None,
                        // Relayed: a hub's Configure lists its √W
                        // followers, still O(W) in all.
                        relay: relaying(w).role(r as u32, w as u32, |h| format!("10.0.0.{h}:7072")),
                    })
                    .encoded_len()
                })
                .sum()
        };
        let (small, large) = (total(16), total(256));
        let ratio = large as f64 / small as f64;
        assert!(
            (15.0..17.0).contains(&ratio),
            "16 → 256 members: {small} → {large} bytes ({ratio:.1}×, linear is 16×)"
        );
    }

    #[test]
    fn configure_carries_each_peers_prior() {
        let h = held_from_wire(wire_held(0, 1)).unwrap();
        let priors = vec![Some(h), None];
        let spec: JobSpec = toml::from_str(
            "[job]\nname = \"t\"\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
             config = \"/c.json\"\n[data]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
        )
        .unwrap();
        let msg = to_worker(&ToWorker::Configure {
            job: "j".into(),
            generation: 4,
            rank: 1,
            peers: vec![("a".into(), "x:1".into()), ("b".into(), "x:2".into())].into(),
            priors: priors.clone().into(),
            prior_runs: crate::core::recovery::prior_runs(&priors).into(),
            spec: std::sync::Arc::new(spec),
            step: 7,
            restore_from: None,
            role: Role::Trainer,
            weights: None,
            relay: None,
        });
        let Some(wire::coordinator_message::Msg::Configure(c)) = msg.msg else {
            panic!("expected a configure");
        };
        // Rank 1 of 2: its neighbour is rank 0, the holder; it holds nothing.
        assert!(c.peers.is_empty());
        assert_eq!(
            c.next
                .as_ref()
                .map(|p| (p.rank, p.collective_addr.as_str())),
            Some((0, "x:1"))
        );
        assert_eq!(c.prior, None);
        let run = wire::PriorRun {
            rank: 0,
            count: 1,
            prior_rank: 0,
            prior_world_size: 1,
        };
        assert_eq!(c.priors, vec![run]);
        assert!(c.restore_from.is_empty());
        let job = c.job.expect("the resolved job travels with it");
        assert_eq!(job.sharding, wire::Sharding::Ddp as i32);
        assert_eq!(job.runtime.unwrap().loss_chunk_tokens, 1024);
    }
}
