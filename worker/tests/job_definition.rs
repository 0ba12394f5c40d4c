//! The typed job message (issue 13): the coordinator resolves every example
//! spec of deploy/examples into `Configure.job`, it survives the wire
//! (protobuf encode, decode), and the worker's conversion holds exactly the
//! spec's resolved values — defaults included, which live only in the
//! coordinator's spec.

use std::path::Path;

use accrue_coordinator::job::model::Dtype;
use accrue_coordinator::job::objective::{DpoLoss as SpecDpoLoss, LossNormalization, Reference};
use accrue_coordinator::job::parallel::Sharding as SpecSharding;
use accrue_coordinator::job::spec::JobSpec;
use accrue_coordinator::shell::service::convert::job_definition;
use accrue_worker::config::{ModelSource, Sharding};
use accrue_worker::convert::job_config;
use accrue_worker::objective::dpo::DpoLoss;
use accrue_worker::objective::{Normalization, Objective};
use accrue_worker::wire;
use prost::Message;

/// Every example spec, parsed as `accrue submit` would (paths resolved
/// against the repository root; the synthetic datasets the examples name
/// need not exist for this).
fn examples() -> Vec<(String, JobSpec)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root.join("deploy/examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut spec: JobSpec = toml::from_str(&text).unwrap();
        spec.resolve_paths(&root);
        let problems: Vec<_> = spec
            .validate()
            .into_iter()
            .filter(|p| {
                // Files `accrue data synth` writes before a demo runs, and
                // the checkpoint an earlier phase of a demo writes (the RL
                // demo starts from its SFT run).
                let data_field = [
                    "data.train",
                    "data.sources[",
                    "eval.sources[",
                    "rl.eval_prompts[",
                ]
                .iter()
                .any(|f| p.field.starts_with(f));
                let earlier_phase = p.field == "model.init" && p.message.contains("/runs/");
                let synthesized = data_field && p.message.contains("runs/data");
                !(synthesized || earlier_phase)
            })
            .collect();
        assert!(problems.is_empty(), "{}: {problems:?}", path.display());
        out.push((path.display().to_string(), spec));
    }
    assert!(out.len() >= 3, "sft, dpo and pg demos: {}", out.len());
    out
}

#[test]
fn every_example_spec_round_trips_through_the_typed_job_message() {
    for (name, spec) in examples() {
        let def = job_definition(&spec);
        let bytes = def.encode_to_vec();
        let back = wire::JobDefinition::decode(bytes.as_slice()).unwrap();
        assert_eq!(back, def, "{name}: the wire changed the message");
        let cfg = job_config(&back).unwrap_or_else(|e| panic!("{name}: {e}"));

        assert_eq!(cfg.name, spec.job.name, "{name}");
        assert_eq!(cfg.seed, spec.job.seed, "{name}");
        let model = if spec.model.is_random() {
            ModelSource::Random {
                config: spec.model.config.clone().unwrap(),
            }
        } else {
            ModelSource::Checkpoint(spec.model.init.clone().into())
        };
        assert_eq!(cfg.model, model, "{name}");
        let dtype = match spec.model.dtype {
            Dtype::Float32 => tch::Kind::Float,
            Dtype::Bfloat16 => tch::Kind::BFloat16,
        };
        assert_eq!(cfg.dtype, dtype, "{name}");
        let o = &spec.optimizer;
        assert_eq!(
            (cfg.optimizer.beta1, cfg.optimizer.beta2),
            (o.betas[0], o.betas[1]),
            "{name}"
        );
        assert_eq!(
            (cfg.optimizer.eps, cfg.optimizer.weight_decay, cfg.grad_clip),
            (o.eps, o.weight_decay, o.grad_clip),
            "{name}"
        );
        let sharding = match spec.parallel.sharding {
            SpecSharding::Ddp => Sharding::Ddp,
            SpecSharding::Zero2 => Sharding::Zero2,
            SpecSharding::Fsdp => Sharding::Fsdp,
        };
        assert_eq!(cfg.sharding, sharding, "{name}");
        assert_eq!(
            cfg.loss_chunk_tokens as u64, spec.runtime.loss_chunk_tokens,
            "{name}"
        );
        let objective = if let Some(d) = spec.objective.dpo() {
            let loss = match d.loss {
                SpecDpoLoss::Sigmoid => DpoLoss::Sigmoid,
                SpecDpoLoss::Ipo => DpoLoss::Ipo,
                SpecDpoLoss::DpoNorm => DpoLoss::DpoNorm,
            };
            Objective::Dpo {
                params: accrue_worker::objective::dpo::DpoParams {
                    beta: d.beta,
                    loss,
                    label_smoothing: d.label_smoothing,
                },
                live: d.reference == Reference::Live,
            }
        } else if let Some(p) = spec.objective.pg() {
            let norm = match p.loss_normalization {
                LossNormalization::Token => Normalization::Token,
                LossNormalization::Sequence => Normalization::Sequence,
                LossNormalization::Constant => {
                    Normalization::Constant(p.normalization_constant.unwrap())
                }
            };
            Objective::Pg {
                params: accrue_worker::objective::pg::PgParams {
                    clip_ratio: p.clip_ratio,
                    kl_coef: p.kl_coef,
                    off_policy: match p.off_policy {
                        accrue_coordinator::job::objective::OffPolicy::Clip => {
                            accrue_worker::objective::pg::OffPolicy::Clip
                        }
                        accrue_coordinator::job::objective::OffPolicy::Tis => {
                            accrue_worker::objective::pg::OffPolicy::Tis { cap: p.tis_cap }
                        }
                    },
                },
                norm,
                live: p.kl_coef > 0.0 && p.reference == Reference::Live,
            }
        } else {
            Objective::Sft
        };
        assert_eq!(cfg.objective, objective, "{name}");
    }
}

/// A field left out of a spec takes the coordinator's default, and that
/// is what the worker trains with (the worker has no default of its own).
#[test]
fn defaults_reach_the_worker_from_the_coordinator_only() {
    let (_, sft) = examples()
        .into_iter()
        .find(|(n, _)| n.ends_with("sft-demo.toml"))
        .unwrap();
    let mut spec = sft;
    spec.optimizer = Default::default();
    spec.runtime = Default::default();
    let cfg = job_config(&job_definition(&spec)).unwrap();
    let defaults = accrue_coordinator::job::optimizer::OptimizerSection::default();
    assert_eq!(
        (cfg.optimizer.beta1, cfg.optimizer.beta2),
        (defaults.betas[0], defaults.betas[1])
    );
    assert_eq!(
        (cfg.optimizer.eps, cfg.grad_clip),
        (defaults.eps, defaults.grad_clip)
    );
    assert_eq!(
        cfg.loss_chunk_tokens as u64,
        accrue_coordinator::job::runtime::RuntimeSection::default().loss_chunk_tokens
    );
}
