//! The `[objective]` and `[rl]` sections of a job spec: which loss a job
//! trains and its knobs. Kind-specific fields are options so that a field
//! given for the wrong kind is an error rather than silently ignored; the
//! resolved, defaulted values come from [`ObjectiveSection::dpo`] and
//! [`ObjectiveSection::pg`].

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ObjectiveKind {
    #[default]
    Sft,
    Dpo,
    Pg,
}

/// The DPO loss family (TRL's `loss_type` names where they exist).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DpoLoss {
    /// −log σ(β·margin), with optional label smoothing (standard DPO).
    #[default]
    Sigmoid,
    /// (margin − 1/(2β))² (Azar et al.).
    Ipo,
    /// Sigmoid DPO over log-probs averaged per loss token (open-instruct's
    /// length-normalised `dpo_norm`).
    DpoNorm,
}

/// Where reference log-probs come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Reference {
    /// One forward-only pass over the dataset before training, cached by
    /// document id in the coordinator's store.
    #[default]
    Cached,
    /// A frozen copy of the initial model on every worker.
    Live,
}

/// How a policy-gradient token's loss treats rollouts drawn by another
/// policy than the one trained (`objective.off_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OffPolicy {
    /// PPO's clipped ratio against the rollout's log-probs.
    #[default]
    Clip,
    /// Token-level truncated importance sampling (verl's
    /// `tis_imp_ratio_cap`, AIPO): the REINFORCE gradient weighted by
    /// `min(π/μ, tis_cap)`, the weight held constant.
    Tis,
}

/// What a policy-gradient microbatch's loss is divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LossNormalization {
    /// The step's global loss-token count T from the plan.
    #[default]
    Token,
    /// The step's number of sequences, each sequence's tokens averaged.
    Sequence,
    /// A fixed constant (Dr. GRPO), `normalization_constant`.
    Constant,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveSection {
    #[serde(default)]
    pub kind: ObjectiveKind,
    // ---- dpo ----
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<DpoLoss>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_smoothing: Option<f64>,
    /// DPO, and PG with `kl_coef > 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<Reference>,
    // ---- pg ----
    /// Divide group-centred rewards by the group's std (GRPO); false keeps
    /// them centred only (Dr. GRPO).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_by_std: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advantage_eps: Option<f64>,
    /// PPO ratio clip ε, used where rollouts carry old log-probs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_coef: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_normalization: Option<LossNormalization>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalization_constant: Option<f64>,
    /// `"clip"` (default) or `"tis"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub off_policy: Option<OffPolicy>,
    /// The truncation `C` of `off_policy = "tis"` (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tis_cap: Option<f64>,
}

/// Resolved DPO settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoParams {
    pub beta: f64,
    pub loss: DpoLoss,
    pub label_smoothing: f64,
    pub reference: Reference,
}

/// Resolved policy-gradient settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PgParams {
    pub scale_by_std: bool,
    pub advantage_eps: f64,
    pub clip_ratio: f64,
    pub kl_coef: f64,
    pub reference: Reference,
    pub loss_normalization: LossNormalization,
    pub normalization_constant: Option<f64>,
    pub off_policy: OffPolicy,
    /// Used with [`OffPolicy::Tis`].
    pub tis_cap: f64,
}

impl ObjectiveSection {
    /// The DPO settings with defaults, for `kind = "dpo"`.
    pub fn dpo(&self) -> Option<DpoParams> {
        (self.kind == ObjectiveKind::Dpo).then(|| DpoParams {
            beta: self.beta.unwrap_or(0.1),
            loss: self.loss.unwrap_or_default(),
            label_smoothing: self.label_smoothing.unwrap_or(0.0),
            reference: self.reference.unwrap_or_default(),
        })
    }

    /// The policy-gradient settings with defaults, for `kind = "pg"`.
    pub fn pg(&self) -> Option<PgParams> {
        (self.kind == ObjectiveKind::Pg).then(|| PgParams {
            scale_by_std: self.scale_by_std.unwrap_or(true),
            advantage_eps: self.advantage_eps.unwrap_or(1e-6),
            clip_ratio: self.clip_ratio.unwrap_or(0.2),
            kl_coef: self.kl_coef.unwrap_or(0.0),
            reference: self.reference.unwrap_or_default(),
            loss_normalization: self.loss_normalization.unwrap_or_default(),
            normalization_constant: self.normalization_constant,
            off_policy: self.off_policy.unwrap_or_default(),
            tis_cap: self.tis_cap.unwrap_or(2.0),
        })
    }

    /// Semantic checks; `bad(field, message)` receives every problem.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        let dpo_only = [
            ("beta", self.beta.is_some()),
            ("loss", self.loss.is_some()),
            ("label_smoothing", self.label_smoothing.is_some()),
        ];
        let pg_only = [
            ("scale_by_std", self.scale_by_std.is_some()),
            ("advantage_eps", self.advantage_eps.is_some()),
            ("clip_ratio", self.clip_ratio.is_some()),
            ("kl_coef", self.kl_coef.is_some()),
            ("loss_normalization", self.loss_normalization.is_some()),
            (
                "normalization_constant",
                self.normalization_constant.is_some(),
            ),
            ("off_policy", self.off_policy.is_some()),
            ("tis_cap", self.tis_cap.is_some()),
        ];
        let kind = self.kind.to_string();
        let mut wrong_kind = |fields: &[(&str, bool)], for_kind: &str| {
            for (f, given) in fields {
                if *given {
                    bad(
                        &format!("objective.{f}"),
                        format!("only applies to kind = \"{for_kind}\", this job is \"{kind}\""),
                    );
                }
            }
        };
        if self.kind != ObjectiveKind::Dpo {
            wrong_kind(&dpo_only, "dpo");
        }
        if self.kind != ObjectiveKind::Pg {
            wrong_kind(&pg_only, "pg");
        }
        if self.kind == ObjectiveKind::Sft && self.reference.is_some() {
            bad(
                "objective.reference",
                "only applies to kind = \"dpo\" or \"pg\"".into(),
            );
        }
        if let Some(d) = self.dpo() {
            if !(d.beta.is_finite() && d.beta > 0.0) {
                bad(
                    "objective.beta",
                    format!("must be a positive number, got {}", d.beta),
                );
            }
            if !(0.0..0.5).contains(&d.label_smoothing) {
                bad(
                    "objective.label_smoothing",
                    format!("must be in [0, 0.5), got {}", d.label_smoothing),
                );
            } else if d.label_smoothing > 0.0 && d.loss == DpoLoss::Ipo {
                bad(
                    "objective.label_smoothing",
                    "ipo has no label smoothing; leave it at 0".into(),
                );
            }
        }
        if let Some(p) = self.pg() {
            if !(p.advantage_eps.is_finite() && p.advantage_eps > 0.0) {
                bad(
                    "objective.advantage_eps",
                    format!("must be a positive number, got {}", p.advantage_eps),
                );
            }
            if !(p.clip_ratio.is_finite() && p.clip_ratio > 0.0) {
                bad(
                    "objective.clip_ratio",
                    format!("must be a positive number, got {}", p.clip_ratio),
                );
            }
            if !(p.kl_coef.is_finite() && p.kl_coef >= 0.0) {
                bad(
                    "objective.kl_coef",
                    format!("must be ≥ 0, got {}", p.kl_coef),
                );
            }
            if !(p.tis_cap.is_finite() && p.tis_cap >= 1.0) {
                bad(
                    "objective.tis_cap",
                    format!("must be a number ≥ 1, got {}", p.tis_cap),
                );
            } else if self.tis_cap.is_some() && p.off_policy != OffPolicy::Tis {
                bad(
                    "objective.tis_cap",
                    "only applies to off_policy = \"tis\"".into(),
                );
            }
            match (p.loss_normalization, p.normalization_constant) {
                (LossNormalization::Constant, None) => bad(
                    "objective.normalization_constant",
                    "required when loss_normalization = \"constant\"".into(),
                ),
                (LossNormalization::Constant, Some(c)) if !(c.is_finite() && c > 0.0) => bad(
                    "objective.normalization_constant",
                    format!("must be a positive number, got {c}"),
                ),
                (LossNormalization::Token | LossNormalization::Sequence, Some(_)) => bad(
                    "objective.normalization_constant",
                    "only applies to loss_normalization = \"constant\"".into(),
                ),
                _ => {}
            }
        }
    }
}

/// The `[rl]` section: rollout admission and policy publication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RlSection {
    /// Reject rollouts generated by a policy more than this many steps old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
    /// Write the policy to `OUTPUT_DIR/policy/step-N/` every n committed steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_every: Option<u64>,
    /// Rollouts the streaming RPC buffers before it makes senders wait
    /// (`data.source = "stream"`; default [`RlSection::queue_capacity_or_default`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_capacity: Option<u64>,
    /// Rollouts per group of a streamed job: a group is complete (and can
    /// be trained) when it holds this many. Required for `data.source =
    /// "stream"`; file rollouts group by their `group` field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u32>,
    /// The RL loop (`data.source = "generate"`): how completions are sampled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingSection>,
    /// The RL loop: how completions are scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier: Option<super::verifier::VerifierSection>,
    /// The RL loop: prompts per generation round (default: the groups one
    /// step takes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts_per_round: Option<u64>,
    /// The RL loop: held-out prompt files, answered greedily before the
    /// first step, after the last and every `eval_every` steps, scored by
    /// the verifier (accuracy before/after; never trained on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eval_prompts: Vec<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<u64>,
    /// The RL loop: generate on an external inference server instead of
    /// the workers (`[rl.engine]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<crate::job::engine::EngineSection>,
    /// The RL loop, disaggregated: this many of the job's workers only
    /// generate while the others train (at most all but one of them), and
    /// trainer rank 0 broadcasts every published policy to them over the
    /// collective. Unset: colocated (the same workers generate, then train).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generators: Option<u32>,
}

/// `[rl.sampling]`: how the RL loop's workers sample completions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingSection {
    /// 0 = greedy.
    #[serde(default = "one")]
    pub temperature: f32,
    /// 1 = off.
    #[serde(default = "one")]
    pub top_p: f32,
    /// 0 = off.
    #[serde(default)]
    pub top_k: u32,
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: u32,
    /// Generation stops after one of these strings; the verifier reads the
    /// completion cut before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Sequences a worker decodes at once (0: the worker's default).
    #[serde(default)]
    pub max_batch: u32,
}

fn one() -> f32 {
    1.0
}

fn default_max_new_tokens() -> u32 {
    256
}

impl Default for SamplingSection {
    fn default() -> Self {
        SamplingSection {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: default_max_new_tokens(),
            stop: Vec::new(),
            max_batch: 0,
        }
    }
}

impl SamplingSection {
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bad(
                "rl.sampling.temperature",
                format!("must be ≥ 0 (0 is greedy), got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bad(
                "rl.sampling.top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            );
        }
        if self.max_new_tokens == 0 {
            bad("rl.sampling.max_new_tokens", "must be at least 1".into());
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            bad(
                &format!("rl.sampling.stop[{i}]"),
                "must not be empty".into(),
            );
        }
    }
}

/// Rollouts in the whole groups a streamed step takes: `docs_per_step`
/// rounded up to whole groups of `group_size`.
pub fn step_rollouts(docs_per_step: u64, group_size: u32) -> u64 {
    let g = u64::from(group_size.max(1));
    docs_per_step.div_ceil(g) * g
}

impl RlSection {
    pub fn validate(&self, kind: ObjectiveKind, bad: &mut impl FnMut(&str, String)) {
        let any = self.max_staleness.is_some()
            || self.publish_every.is_some()
            || self.queue_capacity.is_some()
            || self.group_size.is_some()
            || self.sampling.is_some()
            || self.verifier.is_some()
            || self.prompts_per_round.is_some()
            || !self.eval_prompts.is_empty()
            || self.eval_every.is_some()
            || self.engine.is_some()
            || self.generators.is_some();
        if any && kind != ObjectiveKind::Pg {
            bad("rl", "only applies to objective.kind = \"pg\"".into());
        }
        if self.publish_every == Some(0) {
            bad("rl.publish_every", "must be at least 1".into());
        }
        if self.queue_capacity == Some(0) {
            bad("rl.queue_capacity", "must be at least 1".into());
        }
        if self.eval_every == Some(0) {
            bad("rl.eval_every", "must be at least 1".into());
        }
        if self.prompts_per_round == Some(0) {
            bad("rl.prompts_per_round", "must be at least 1".into());
        }
        if let Some(s) = &self.sampling {
            s.validate(bad);
        }
        if let Some(v) = &self.verifier {
            v.validate(bad);
        }
        if let Some(e) = &self.engine {
            e.validate(bad);
            crate::job::engine::validate_with_rl(e, self.publish_every, self.max_staleness, bad);
        }
        match (self.generators, &self.engine) {
            (Some(0), _) => bad(
                "rl.generators",
                "must be at least 1 (leave it unset for colocated generation)".into(),
            ),
            (Some(_), Some(_)) => bad(
                "rl.generators",
                "generation goes either to an external engine ([rl.engine]) or to the job's own workers (rl.generators), not both".into(),
            ),
            (Some(_), None) => {
                let every = self.sync_every();
                if let Some(max) = self.max_staleness.filter(|&m| every > m + 1) {
                    bad(
                        "rl.publish_every",
                        format!(
                            "must be at most rl.max_staleness + 1 = {} with rl.generators (got {every}): the generators' policy ages by up to rl.publish_every - 1 steps between syncs, and rounds older than rl.max_staleness cannot be admitted, so the job would wait forever",
                            max + 1
                        ),
                    );
                }
            }
            (None, _) => {}
        }
    }

    /// Whether the RL loop generates apart from the trainers: on an
    /// external engine or on the job's own generator workers.
    pub fn generates_apart(&self) -> bool {
        self.engine.is_some() || self.generators.is_some()
    }

    /// Disaggregated generation: steps between weight syncs to the
    /// generators (`rl.publish_every`, default every step).
    pub fn sync_every(&self) -> u64 {
        self.publish_every.unwrap_or(1)
    }

    /// The queue bound of a streamed job: `queue_capacity`, else four
    /// steps' worth of whole groups.
    pub fn queue_capacity_or_default(&self, docs_per_step: u64) -> u64 {
        self.queue_capacity
            .unwrap_or_else(|| 4 * step_rollouts(docs_per_step, self.group_size.unwrap_or(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(o: &ObjectiveSection) -> Vec<String> {
        let mut out = Vec::new();
        o.validate(&mut |f: &str, m: String| out.push(format!("{f}: {m}")));
        out
    }

    #[test]
    fn defaults_resolve_per_kind() {
        let dpo = ObjectiveSection {
            kind: ObjectiveKind::Dpo,
            ..Default::default()
        };
        let d = dpo.dpo().unwrap();
        assert_eq!(
            (d.beta, d.loss, d.label_smoothing),
            (0.1, DpoLoss::Sigmoid, 0.0)
        );
        assert_eq!(d.reference, Reference::Cached);
        assert!(dpo.pg().is_none());
        assert!(problems(&dpo).is_empty());
        let pg = ObjectiveSection {
            kind: ObjectiveKind::Pg,
            ..Default::default()
        };
        let p = pg.pg().unwrap();
        assert!(p.scale_by_std);
        assert_eq!(p.loss_normalization, LossNormalization::Token);
        assert!(problems(&pg).is_empty());
    }

    #[test]
    fn fsdp_takes_only_the_cached_reference() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.json"), "{}").unwrap();
        let spec = |format: &str, objective: &str| {
            format!(
                "[job]\nname = \"f\"\noutput_dir = \"o\"\nsteps = 1\n[model]\ninit = \"random\"\n\
                 config = \"c.json\"\n[data]\nformat = \"{format}\"\ntrain = [\"c.json\"]\n\
                 [batch]\ndocs_per_step = 4\n[objective]\n{objective}\n\
                 [parallel]\nsharding = \"fsdp\"\n"
            )
        };
        let fields = |text: String| -> Vec<String> {
            match crate::job::spec::JobSpec::parse(&text, dir.path()) {
                Ok(_) => Vec::new(),
                Err(problems) => problems.into_iter().map(|p| p.field).collect(),
            }
        };
        let refused = ["objective.reference"];
        assert_eq!(
            fields(spec("dpo", "kind = \"dpo\"\nreference = \"live\"")),
            refused
        );
        assert!(fields(spec("dpo", "kind = \"dpo\"")).is_empty());
        let pg_live = "kind = \"pg\"\nkl_coef = 0.1\nreference = \"live\"";
        assert_eq!(fields(spec("rollouts", pg_live)), refused);
        assert!(fields(spec("rollouts", "kind = \"pg\"\nkl_coef = 0.1")).is_empty());
        // No KL: the reference setting is moot.
        assert!(fields(spec("rollouts", "kind = \"pg\"\nreference = \"live\"")).is_empty());
    }

    #[test]
    fn fields_of_another_kind_and_bad_values_are_named() {
        let o: ObjectiveSection =
            toml::from_str("kind = \"sft\"\nbeta = 0.1\nkl_coef = 0.5\nreference = \"live\"")
                .unwrap();
        let p = problems(&o).join("\n");
        for f in ["objective.beta", "objective.kl_coef", "objective.reference"] {
            assert!(p.contains(f), "{f} missing in {p}");
        }
        let o: ObjectiveSection =
            toml::from_str("kind = \"dpo\"\nbeta = -1.0\nloss = \"ipo\"\nlabel_smoothing = 0.1")
                .unwrap();
        let p = problems(&o).join("\n");
        assert!(p.contains("objective.beta: must be a positive"), "{p}");
        assert!(p.contains("objective.label_smoothing: ipo"), "{p}");
        let o: ObjectiveSection =
            toml::from_str("kind = \"pg\"\nloss_normalization = \"constant\"").unwrap();
        assert!(problems(&o)[0].starts_with("objective.normalization_constant: required"));
        assert!(toml::from_str::<ObjectiveSection>("kind = \"dpo\"\nloss = \"hinge\"").is_err());
    }

    #[test]
    fn off_policy_tis_resolves_and_its_cap_is_checked() {
        let parse = |t: &str| toml::from_str::<ObjectiveSection>(t).unwrap();
        let clip = parse("kind = \"pg\"").pg().unwrap();
        assert_eq!((clip.off_policy, clip.tis_cap), (OffPolicy::Clip, 2.0));
        let tis = parse("kind = \"pg\"\noff_policy = \"tis\"\ntis_cap = 3.0");
        assert!(problems(&tis).is_empty());
        assert_eq!(tis.pg().unwrap().off_policy, OffPolicy::Tis);
        assert_eq!(tis.pg().unwrap().tis_cap, 3.0);
        let p = problems(&parse("kind = \"pg\"\noff_policy = \"tis\"\ntis_cap = 0.5")).join("\n");
        assert!(p.contains("objective.tis_cap: must be a number ≥ 1"), "{p}");
        let p = problems(&parse("kind = \"pg\"\ntis_cap = 3.0")).join("\n");
        assert!(
            p.contains("objective.tis_cap: only applies to off_policy"),
            "{p}"
        );
        let p = problems(&parse("kind = \"sft\"\noff_policy = \"tis\"")).join("\n");
        assert!(
            p.contains("objective.off_policy: only applies to kind = \"pg\""),
            "{p}"
        );
        assert!(
            toml::from_str::<ObjectiveSection>("kind = \"pg\"\noff_policy = \"aipo\"").is_err()
        );
    }

    #[test]
    fn streamed_jobs_are_validated_with_field_paths() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.json"), "{}").unwrap();
        let spec = |data: &str, batch: &str, rl: &str, job: &str| {
            format!(
                "[job]\nname = \"s\"\noutput_dir = \"o\"\n{job}\n[model]\ninit = \"random\"\n\
                 config = \"c.json\"\n[data]\nformat = \"rollouts\"\nsource = \"stream\"\n{data}\n\
                 [batch]\n{batch}\n[objective]\nkind = \"pg\"\n[rl]\n{rl}\n"
            )
        };
        let ok = spec("", "docs_per_step = 5", "group_size = 2", "");
        let parsed = crate::job::spec::JobSpec::parse(&ok, dir.path()).unwrap();
        assert!(parsed.data.is_stream() && parsed.job.steps.is_none());
        assert_eq!(
            parsed.rl.queue_capacity_or_default(5),
            24,
            "4 steps of 3 groups of 2"
        );
        let fields = |text: String| -> Vec<String> {
            crate::job::spec::JobSpec::parse(&text, dir.path())
                .unwrap_err()
                .into_iter()
                .map(|p| p.field)
                .collect()
        };
        let f = fields(spec(
            "train = [\"c.json\"]",
            "tokens_per_step = 100",
            "group_size = 1",
            "epochs = 1",
        ));
        for want in [
            "data.train",
            "job.epochs",
            "batch.docs_per_step",
            "rl.group_size",
        ] {
            assert!(f.iter().any(|x| x == want), "{want} not in {f:?}");
        }
        let f = fields(spec("", "docs_per_step = 5", "queue_capacity = 5", ""));
        assert_eq!(f, ["rl.group_size"]);
        let f = fields(spec(
            "",
            "docs_per_step = 5",
            "group_size = 2\nqueue_capacity = 5",
            "",
        ));
        assert_eq!(f, ["rl.queue_capacity"], "5 < one step of 6");
        let files = ok
            .replace("source = \"stream\"", "train = [\"c.json\"]")
            .replace("[job]", "[job]\nsteps = 1");
        assert_eq!(fields(files), ["rl.group_size"], "only for streams");
        // A KL penalty: cached needs file rollouts, live works everywhere.
        let kl = ok.replace("kind = \"pg\"", "kind = \"pg\"\nkl_coef = 0.1");
        assert_eq!(fields(kl.clone()), ["objective.reference"]);
        let live = kl.replace("kl_coef = 0.1", "kl_coef = 0.1\nreference = \"live\"");
        crate::job::spec::JobSpec::parse(&live, dir.path()).unwrap();
        let from_files = kl
            .replace("source = \"stream\"", "train = [\"c.json\"]")
            .replace("[job]", "[job]\nsteps = 1")
            .replace("group_size = 2", "");
        crate::job::spec::JobSpec::parse(&from_files, dir.path()).unwrap();
    }

    #[test]
    fn rl_section_only_for_pg() {
        let rl = RlSection {
            max_staleness: Some(2),
            publish_every: Some(0),
            ..Default::default()
        };
        let mut out = Vec::new();
        rl.validate(ObjectiveKind::Sft, &mut |f: &str, m: String| {
            out.push(format!("{f}: {m}"))
        });
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out[0].starts_with("rl: only applies"));
        assert!(out[1].starts_with("rl.publish_every"));
    }
}
