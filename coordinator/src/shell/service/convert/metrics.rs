//! Metrics and what watchers are told: step and eval metrics, watch items, events, abort reasons; the ranks' sums and log-probs read off the wire.

use accrue_proto::v1 as wire;

use super::job::{cursor, job_state};
use crate::core::{AbortReason, EventKind, MetricSums, SeqLogp, StepMetrics, WatchItem};
use crate::stream::doc::DocId;

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
        pairs: s.pairs,
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
                    pairs: v.pairs,
                    extra: v.extra.into_iter().collect(),
                    ..Default::default()
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
