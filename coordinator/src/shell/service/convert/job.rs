//! Jobs: the resolved job workers train, a job's state, summary, cursor and quarantined documents.

use accrue_proto::v1 as wire;

use crate::core::{Job, JobState, Quarantined};
use crate::job::model::Dtype;
use crate::job::objective::{DpoLoss, LossNormalization, OffPolicy, Reference};
use crate::job::parallel::{CollectiveChoice, Sharding};
use crate::job::spec::JobSpec;
use crate::stream::cursor::Cursor;

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
        context: spec.parallel.context,
        collective: match spec.parallel.collective {
            CollectiveChoice::Auto => wire::CollectiveChoice::Auto,
            CollectiveChoice::Ring => wire::CollectiveChoice::Ring,
        } as i32,
        lora: spec.lora.as_ref().map(|l| wire::LoraDefinition {
            rank: l.rank,
            alpha: l.alpha,
            dropout: l.dropout,
            target_modules: l.target_modules.names(),
            use_rslora: l.use_rslora,
            init: l
                .init
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        }),
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
