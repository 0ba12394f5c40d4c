//! The worker's adapter between `accrue.v1` messages and its domain types.
//! A missing message or an UNSPECIFIED enum is the sender's bug: it is
//! refused here, naming the field, rather than given a default (the
//! coordinator owns every default).

use std::path::PathBuf;

use tch::{Device, Kind};

use crate::batch::{MicrobatchMeta, PackedBatch, SeqMeta, StepNorms};
use crate::config::{CollectiveChoice, JobConfig, ModelSource, Precision, Sharding};
use crate::error::StepError;
use crate::generate;
use crate::objective::dpo::{DpoLoss, DpoParams};
use crate::objective::pg::{OffPolicy, PgParams};
use crate::objective::{Normalization, Objective};
use crate::train::optim::AdamWConfig;
use crate::wire;

/// A field of a coordinator message the worker cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    /// Dotted path in the message, e.g. `job.objective.dpo.loss`.
    pub field: String,
    pub problem: String,
}

fn missing(field: &str) -> FieldError {
    FieldError {
        field: field.into(),
        problem: "missing (the coordinator sets every field)".into(),
    }
}

fn invalid(field: &str, problem: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// A proto3 enum value the worker knows, `UNSPECIFIED` refused.
fn known<E: TryFrom<i32>>(value: i32, field: &str) -> Result<E, FieldError> {
    match E::try_from(value) {
        Ok(e) if value != 0 => Ok(e),
        _ => Err(invalid(
            field,
            format!("unspecified or unknown value {value}"),
        )),
    }
}

fn reference_is_live(value: i32, field: &str) -> Result<bool, FieldError> {
    Ok(match known::<wire::Reference>(value, field)? {
        wire::Reference::Live => true,
        wire::Reference::Cached | wire::Reference::Unspecified => false,
    })
}

/// A plan's microbatch: the packed row (checked) and what the plan says
/// about its sequences.
pub fn microbatch(mb: &wire::Microbatch) -> Result<(PackedBatch, MicrobatchMeta), StepError> {
    let bad = |field: &str, e: accrue_proto::PackedLenError| {
        StepError::InvalidPlan(format!("microbatch {field}: {e}"))
    };
    let ids = accrue_proto::unpack_u32(&mb.token_ids).map_err(|e| bad("token_ids", e))?;
    let labels = accrue_proto::microbatch_labels(&ids, &mb.labels, &mb.loss_mask)
        .map_err(|e| StepError::InvalidPlan(format!("microbatch {e}")))?;
    let batch = PackedBatch {
        input_ids: ids.into_iter().map(i64::from).collect(),
        labels: labels.into_iter().map(i64::from).collect(),
        cu_seq_lens: mb.cu_seq_lens.iter().map(|&c| i64::from(c)).collect(),
        routing: accrue_proto::unpack_u16(&mb.routing)
            .map_err(|e| bad("routing", e))?
            .into_iter()
            .map(|e| match e {
                accrue_proto::NO_EXPERT => -1,
                e => i64::from(e),
            })
            .collect(),
    };
    batch.validate()?;
    let meta = MicrobatchMeta {
        seqs: mb
            .sequences
            .iter()
            .map(|s| SeqMeta {
                doc_id: accrue_proto::doc_label(s),
                role: s.role,
                advantage: s.advantage,
                ref_logp: s.ref_logp,
            })
            .collect(),
        // unpack_f32 of empty bytes is empty.
        old_logprobs: accrue_proto::unpack_f32(&mb.old_logprobs)
            .map_err(|e| bad("old_logprobs", e))?,
        ref_logprobs: accrue_proto::unpack_f32(&mb.ref_logprobs)
            .map_err(|e| bad("ref_logprobs", e))?,
    };
    Ok((batch, meta))
}

/// A plan's step normalisers; a plan without them is refused (zeros would
/// train with a wrong scale, or not at all).
pub fn norms(n: Option<&wire::Normalizers>) -> Result<StepNorms, StepError> {
    let n = n.ok_or_else(|| StepError::InvalidPlan("the plan carries no normalizers".into()))?;
    Ok(StepNorms {
        loss_tokens: n.loss_tokens,
        pairs: n.pairs,
        sequences: n.sequences,
    })
}

/// The job's `parallel.collective`.
pub fn collective_choice(job: &wire::JobDefinition) -> Result<CollectiveChoice, FieldError> {
    Ok(
        match known::<wire::CollectiveChoice>(job.collective, "job.collective")? {
            wire::CollectiveChoice::Ring => CollectiveChoice::Ring,
            wire::CollectiveChoice::Auto | wire::CollectiveChoice::Unspecified => {
                CollectiveChoice::Auto
            }
        },
    )
}

/// The job of a `Configure`.
pub fn job_config(job: &wire::JobDefinition) -> Result<JobConfig, FieldError> {
    use wire::model_definition::Init;
    use wire::objective_definition::Kind as ObjKind;
    let model = job.model.as_ref().ok_or_else(|| missing("job.model"))?;
    let source = match model
        .init
        .as_ref()
        .ok_or_else(|| missing("job.model.init"))?
    {
        Init::RandomConfig(path) if path.is_empty() => {
            return Err(invalid("job.model.random_config", "empty path"))
        }
        Init::RandomConfig(path) => ModelSource::Random {
            config: PathBuf::from(path),
        },
        Init::CheckpointDir(dir) if dir.is_empty() => {
            return Err(invalid("job.model.checkpoint_dir", "empty path"))
        }
        Init::CheckpointDir(dir) => ModelSource::Checkpoint(PathBuf::from(dir)),
    };
    let kind = |value: i32, field: &str| -> Result<Kind, FieldError> {
        Ok(match known::<wire::Dtype>(value, field)? {
            wire::Dtype::Bfloat16 => Kind::BFloat16,
            wire::Dtype::Float32 | wire::Dtype::Unspecified => Kind::Float,
        })
    };
    let dtype = kind(model.dtype, "job.model.dtype")?;
    let p = job
        .precision
        .as_ref()
        .ok_or_else(|| missing("job.precision"))?;
    let precision = Precision {
        compute: kind(p.compute, "job.precision.compute")?,
        reduce: kind(p.reduce, "job.precision.reduce")?,
    };
    let objective = job
        .objective
        .as_ref()
        .and_then(|o| o.kind.as_ref())
        .ok_or_else(|| missing("job.objective"))?;
    let objective = match objective {
        ObjKind::Sft(_) => Objective::Sft,
        ObjKind::Dpo(d) => Objective::Dpo {
            params: DpoParams {
                beta: d.beta,
                loss: match known::<wire::DpoLoss>(d.loss, "job.objective.dpo.loss")? {
                    wire::DpoLoss::Ipo => DpoLoss::Ipo,
                    wire::DpoLoss::DpoNorm => DpoLoss::DpoNorm,
                    wire::DpoLoss::Sigmoid | wire::DpoLoss::Unspecified => DpoLoss::Sigmoid,
                },
                label_smoothing: d.label_smoothing,
            },
            live: reference_is_live(d.reference, "job.objective.dpo.reference")?,
        },
        ObjKind::Pg(p) => {
            let field = "job.objective.pg.loss_normalization";
            let norm = match known::<wire::LossNormalization>(p.loss_normalization, field)? {
                wire::LossNormalization::Sequence => Normalization::Sequence,
                wire::LossNormalization::Constant => {
                    let c = p
                        .normalization_constant
                        .ok_or_else(|| missing("job.objective.pg.normalization_constant"))?;
                    Normalization::Constant(c)
                }
                wire::LossNormalization::Token | wire::LossNormalization::Unspecified => {
                    Normalization::Token
                }
            };
            let live = reference_is_live(p.reference, "job.objective.pg.reference")?;
            Objective::Pg {
                params: PgParams {
                    clip_ratio: p.clip_ratio,
                    kl_coef: p.kl_coef,
                    off_policy: match p.off_policy() {
                        wire::OffPolicy::Tis => {
                            if !(p.tis_cap.is_finite() && p.tis_cap >= 1.0) {
                                return Err(invalid(
                                    "job.objective.pg.tis_cap",
                                    format!("must be ≥ 1, got {}", p.tis_cap),
                                ));
                            }
                            OffPolicy::Tis { cap: p.tis_cap }
                        }
                        wire::OffPolicy::Clip | wire::OffPolicy::Unspecified => OffPolicy::Clip,
                    },
                },
                norm,
                live: live && p.kl_coef > 0.0,
            }
        }
    };
    let o = job
        .optimizer
        .as_ref()
        .ok_or_else(|| missing("job.optimizer"))?;
    let sharding = match known::<wire::Sharding>(job.sharding, "job.sharding")? {
        wire::Sharding::Zero2 => Sharding::Zero2,
        wire::Sharding::Fsdp => Sharding::Fsdp,
        wire::Sharding::Ddp | wire::Sharding::Unspecified => Sharding::Ddp,
    };
    let runtime = job.runtime.as_ref().ok_or_else(|| missing("job.runtime"))?;
    if runtime.loss_chunk_tokens == 0 {
        return Err(invalid(
            "job.runtime.loss_chunk_tokens",
            "must be at least 1",
        ));
    }
    let collective = collective_choice(job)?;
    let lora = job.lora.as_ref().map(lora_config).transpose()?;
    if job.context == 0 {
        return Err(invalid("job.context", "must be at least 1"));
    }
    Ok(JobConfig {
        name: job.name.clone(),
        seed: job.seed,
        model: source,
        dtype,
        precision,
        objective,
        optimizer: AdamWConfig {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        },
        no_decay: o.no_decay.clone(),
        grad_clip: o.grad_clip,
        sharding,
        collective,
        context: job.context as usize,
        loss_chunk_tokens: runtime.loss_chunk_tokens as usize,
        activation_checkpointing: runtime.activation_checkpointing,
        device: Device::Cpu,
        lora,
    })
}

/// `job.lora`, checked as the coordinator checks `[lora]`.
fn lora_config(l: &wire::LoraDefinition) -> Result<crate::config::LoraConfig, FieldError> {
    if l.rank == 0 {
        return Err(invalid("job.lora.rank", "must be at least 1"));
    }
    if !(l.alpha.is_finite() && l.alpha > 0.0) {
        return Err(invalid(
            "job.lora.alpha",
            format!("must be positive, got {}", l.alpha),
        ));
    }
    if !(l.dropout.is_finite() && (0.0..1.0).contains(&l.dropout)) {
        return Err(invalid(
            "job.lora.dropout",
            format!("must be in [0, 1), got {}", l.dropout),
        ));
    }
    let targets = match l.target_modules.as_slice() {
        [one] if one == "all-linear" => accrue_arch::lora::Targets::AllLinear,
        names => accrue_arch::lora::Targets::Named(names.to_vec()),
    };
    Ok(crate::config::LoraConfig {
        rank: l.rank as usize,
        alpha: l.alpha,
        dropout: l.dropout,
        targets,
        use_rslora: l.use_rslora,
        init: (!l.init.is_empty()).then(|| PathBuf::from(&l.init)),
    })
}

/// A complete definition for tests with fake executors.
/// A generate plan's sampling settings and requests (prompt ids as the
/// model's `i64`). A missing `sampling` is refused; `top_p` 0 (unset) is
/// off like 1, `max_batch` 0 is [`generate::DEFAULT_MAX_BATCH`].
pub fn generate_plan(
    p: &wire::GeneratePlan,
) -> Result<(generate::SamplingParams, Vec<generate::Request>), FieldError> {
    let s = p.sampling.as_ref().ok_or_else(|| missing("sampling"))?;
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return Err(invalid(
            "sampling.temperature",
            format!("must be ≥ 0, got {}", s.temperature),
        ));
    }
    if !(s.top_p.is_finite() && (0.0..=1.0).contains(&s.top_p)) {
        return Err(invalid(
            "sampling.top_p",
            format!("must be in [0, 1], got {}", s.top_p),
        ));
    }
    let ids = |bytes: &[u8], field: &str| -> Result<Vec<i64>, FieldError> {
        accrue_proto::unpack_u32(bytes)
            .map(|v| v.into_iter().map(i64::from).collect())
            .map_err(|e| invalid(field, e.to_string()))
    };
    let stop_sequences = s
        .stop_sequences
        .iter()
        .enumerate()
        .map(|(i, b)| ids(b, &format!("sampling.stop_sequences[{i}]")))
        .collect::<Result<_, _>>()?;
    let params = generate::SamplingParams {
        temperature: s.temperature,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        top_k: s.top_k,
        max_new_tokens: s.max_new_tokens as usize,
        stop_ids: s.stop_ids.iter().map(|&t| i64::from(t)).collect(),
        stop_sequences,
        max_batch: match s.max_batch {
            0 => generate::DEFAULT_MAX_BATCH,
            n => n as usize,
        },
        share_prompts: true,
        record_routing: s.record_routing,
        kv_page_tokens: 0,
    };
    let requests = p
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            Ok(generate::Request {
                prompt: ids(&r.prompt_ids, &format!("requests[{i}].prompt_ids"))?,
                seed: r.seed,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok((params, requests))
}

/// A completion on the wire.
pub fn completion(r: &wire::GenerateRequest, c: &generate::Completion) -> wire::Completion {
    let ids: Vec<u32> = c.tokens.iter().map(|&t| t as u32).collect();
    wire::Completion {
        prompt_id: r.prompt_id.clone(),
        sample: r.sample,
        token_ids: accrue_proto::pack_u32(&ids),
        logprobs: accrue_proto::pack_f32(&c.logprobs),
        finish: match c.finish {
            generate::Finish::Stop => wire::FinishReason::Stop,
            generate::Finish::Length => wire::FinishReason::Length,
        } as i32,
        // Expert ids fit u16: accrue-arch refuses more experts.
        routing: accrue_proto::pack_u16(&c.routing.iter().map(|&e| e as u16).collect::<Vec<_>>()),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use crate::wire;

    /// An SFT job of a random model, zero2.
    pub fn definition() -> wire::JobDefinition {
        wire::JobDefinition {
            name: "t".into(),
            seed: 3,
            model: Some(wire::ModelDefinition {
                init: Some(wire::model_definition::Init::RandomConfig("/c.json".into())),
                dtype: wire::Dtype::Float32 as i32,
            }),
            objective: Some(wire::ObjectiveDefinition {
                kind: Some(wire::objective_definition::Kind::Sft(wire::SftObjective {})),
            }),
            optimizer: Some(wire::OptimizerDefinition {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                no_decay: vec!["bias".into(), "norm".into()],
            }),
            sharding: wire::Sharding::Zero2 as i32,
            runtime: Some(wire::RuntimeDefinition {
                loss_chunk_tokens: 512,
                activation_checkpointing: false,
            }),
            precision: Some(wire::PrecisionDefinition {
                compute: wire::Dtype::Float32 as i32,
                reduce: wire::Dtype::Float32 as i32,
            }),
            collective: wire::CollectiveChoice::Auto as i32,
            lora: None,
            context: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::definition as sft;
    use super::*;

    #[test]
    fn a_complete_definition_converts_field_for_field() {
        let c = job_config(&sft()).unwrap();
        assert_eq!(
            c.model,
            ModelSource::Random {
                config: "/c.json".into()
            }
        );
        assert_eq!((c.dtype, c.sharding), (Kind::Float, Sharding::Zero2));
        assert_eq!((c.optimizer.beta2, c.grad_clip), (0.95, 1.0));
        assert_eq!(c.loss_chunk_tokens, 512);
        assert_eq!(c.objective, Objective::Sft);
    }

    #[test]
    fn missing_or_unspecified_fields_are_refused_by_name() {
        let field = |d: wire::JobDefinition| job_config(&d).unwrap_err().field;
        let mut d = sft();
        d.sharding = 0;
        assert_eq!(field(d), "job.sharding");
        let mut d = sft();
        d.model.as_mut().unwrap().dtype = 7;
        assert_eq!(field(d), "job.model.dtype");
        let mut d = sft();
        d.optimizer = None;
        assert_eq!(field(d), "job.optimizer");
        let mut d = sft();
        d.objective = Some(wire::ObjectiveDefinition {
            kind: Some(wire::objective_definition::Kind::Dpo(wire::DpoObjective {
                beta: 0.1,
                loss: 0,
                label_smoothing: 0.0,
                reference: wire::Reference::Cached as i32,
            })),
        });
        assert_eq!(field(d), "job.objective.dpo.loss");
        let mut d = sft();
        d.runtime = Some(wire::RuntimeDefinition {
            loss_chunk_tokens: 0,
            activation_checkpointing: false,
        });
        assert_eq!(field(d), "job.runtime.loss_chunk_tokens");
        let mut d = sft();
        d.precision = None;
        assert_eq!(field(d), "job.precision");
        let mut d = sft();
        d.context = 0;
        assert_eq!(field(d), "job.context");
        let mut d = sft();
        d.collective = 0;
        assert_eq!(field(d), "job.collective");
    }

    #[test]
    fn generate_plans_resolve_their_defaults_and_name_bad_fields() {
        let plan = |s: Option<wire::SamplingParams>| wire::GeneratePlan {
            sampling: s,
            requests: vec![wire::GenerateRequest {
                prompt_id: "p:1".into(),
                sample: 0,
                prompt_ids: accrue_proto::pack_u32(&[5, 7]),
                seed: 9,
            }],
            ..Default::default()
        };
        let sampling = wire::SamplingParams {
            temperature: 0.7,
            max_new_tokens: 4,
            stop_ids: vec![2],
            stop_sequences: vec![accrue_proto::pack_u32(&[3, 4])],
            ..Default::default()
        };
        let (p, r) = generate_plan(&plan(Some(sampling.clone()))).unwrap();
        assert_eq!(p.top_p, 1.0, "unset top_p is off");
        assert_eq!(p.max_batch, generate::DEFAULT_MAX_BATCH);
        assert_eq!((p.stop_ids, p.stop_sequences), (vec![2], vec![vec![3, 4]]));
        assert_eq!(
            r,
            vec![generate::Request {
                prompt: vec![5, 7],
                seed: 9
            }]
        );
        assert_eq!(generate_plan(&plan(None)).unwrap_err().field, "sampling");
        let bad = |s: wire::SamplingParams| generate_plan(&plan(Some(s))).unwrap_err().field;
        let t = wire::SamplingParams {
            temperature: -1.0,
            ..sampling.clone()
        };
        assert_eq!(bad(t), "sampling.temperature");
        let t = wire::SamplingParams {
            top_p: 1.5,
            ..sampling.clone()
        };
        assert_eq!(bad(t), "sampling.top_p");
        let t = wire::SamplingParams {
            stop_sequences: vec![vec![1, 2, 3]],
            ..sampling
        };
        assert_eq!(bad(t), "sampling.stop_sequences[0]");
    }
}
