//! `[lora]`: low-rank adapters on named linear modules (PEFT's LoRA: its
//! names, defaults, initialisation and folder layout). The base model is
//! frozen; only the adapters train, are reduced, checkpointed and synced.
//! Which modules a name reaches is the model's question
//! (`accrue_arch::lora`), checked at admission.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::section::check_file;

/// The largest rank accepted (PEFT has no bound; a rank this large is
/// wider than any hidden size Accrue trains, so a typo).
pub const MAX_RANK: u32 = 65_536;

/// `target_modules`: PEFT's `"all-linear"`, or module names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Only `"all-linear"` is accepted as a string (checked in validate).
    One(String),
    Named(Vec<String>),
}

impl Default for TargetModules {
    fn default() -> Self {
        TargetModules::One(ALL_LINEAR.into())
    }
}

pub const ALL_LINEAR: &str = "all-linear";

impl TargetModules {
    /// As `accrue_arch::lora` reads them.
    pub fn targets(&self) -> accrue_arch::lora::Targets {
        match self {
            TargetModules::One(_) => accrue_arch::lora::Targets::AllLinear,
            TargetModules::Named(v) => accrue_arch::lora::Targets::Named(v.clone()),
        }
    }

    /// The names as sent to the workers (`["all-linear"]` for it).
    pub fn names(&self) -> Vec<String> {
        match self {
            TargetModules::One(s) => vec![s.clone()],
            TargetModules::Named(v) => v.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    /// `r`: the adapters' inner dimension.
    #[serde(default = "default_rank")]
    pub rank: u32,
    /// `lora_alpha`: the output is scaled by `alpha / rank` (`alpha / √rank`
    /// with `use_rslora`).
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// `lora_dropout` on the adapter's input in training forwards (masks
    /// keyed by document, so the update does not depend on the split).
    #[serde(default)]
    pub dropout: f64,
    #[serde(default)]
    pub target_modules: TargetModules,
    #[serde(default)]
    pub use_rslora: bool,
    /// A PEFT adapter folder (`adapter_config.json` +
    /// `adapter_model.safetensors`) to start from; else PEFT's default
    /// initialisation (A Kaiming-uniform, B zero), seeded by `job.seed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
}

fn default_rank() -> u32 {
    8
}

fn default_alpha() -> f64 {
    8.0
}

impl LoraSection {
    /// The checks of `[lora]` alone; the modules are checked against the
    /// model at admission.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.rank == 0 || self.rank > MAX_RANK {
            bad(
                "lora.rank",
                format!("must be between 1 and {MAX_RANK}, got {}", self.rank),
            );
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            bad(
                "lora.alpha",
                format!("must be a positive number, got {}", self.alpha),
            );
        }
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            bad(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            );
        }
        if let TargetModules::One(s) = &self.target_modules {
            if s != ALL_LINEAR {
                bad(
                    "lora.target_modules",
                    format!("must be a list of module names or \"{ALL_LINEAR}\", got {s:?}"),
                );
            }
        }
        if let Some(dir) = &self.init {
            if !dir.is_dir() {
                bad(
                    "lora.init",
                    format!("{}: not a directory (a PEFT adapter folder)", dir.display()),
                );
            } else {
                for f in ["adapter_config.json", "adapter_model.safetensors"] {
                    check_file(bad, "lora.init", &dir.join(f));
                }
            }
        }
    }

    pub fn resolve_paths(&mut self, base: &Path) {
        if let Some(p) = self.init.as_mut() {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = base.join(&*p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(s: &LoraSection) -> Vec<String> {
        let mut p = Vec::new();
        s.validate(&mut |f: &str, m: String| p.push(format!("{f}: {m}")));
        p
    }

    #[test]
    fn peft_defaults_and_bad_values_named() {
        let s: LoraSection = toml::from_str("").unwrap();
        assert_eq!((s.rank, s.alpha, s.dropout), (8, 8.0, 0.0));
        assert_eq!(s.target_modules, TargetModules::One("all-linear".into()));
        assert!(problems(&s).is_empty());
        let s: LoraSection = toml::from_str(
            "rank = 0\nalpha = -1\ndropout = 1.0\ntarget_modules = \"linear\"\ninit = \"/nonexistent\"",
        )
        .unwrap();
        let p = problems(&s);
        for f in [
            "lora.rank",
            "lora.alpha",
            "lora.dropout",
            "lora.target_modules",
            "lora.init",
        ] {
            assert!(p.iter().any(|m| m.starts_with(f)), "{f} not in {p:?}");
        }
        let s: LoraSection = toml::from_str("target_modules = [\"q_proj\", \"v_proj\"]").unwrap();
        assert_eq!(
            s.target_modules.targets(),
            accrue_arch::lora::Targets::Named(vec!["q_proj".into(), "v_proj".into()])
        );
        assert!(toml::from_str::<LoraSection>("modules_to_save = [\"lm_head\"]").is_err());
    }
}
