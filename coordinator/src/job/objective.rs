//! `[objective]`: which loss a job trains and its knobs. Kind-specific
//! fields are options so that a field given for the wrong kind is an error
//! rather than silently ignored; the resolved, defaulted values come from
//! [`ObjectiveSection::dpo`] and [`ObjectiveSection::pg`]. The
//! policy-gradient loop's own settings are `[rl]` ([`crate::job::rl`]).

use serde::{Deserialize, Serialize};

// `[rl]` had no file of its own before; its items stay reachable here for
// the paths written then (`crate::job::rl::SamplingSection`).

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
}
