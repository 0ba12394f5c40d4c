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

    /// The problems of `init`'s `adapter_config.json` against this
    /// section: another rank, alpha or scaling, or another kind of adapter
    /// than the plain LoRA the job trains (the workers check the same when
    /// they load it).
    pub fn check_init(&self, bad: &mut impl FnMut(&str, String)) {
        let Some(dir) = &self.init else {
            return;
        };
        let path = dir.join("adapter_config.json");
        let json: serde_json::Value = match crate::job::input::read(
            &path,
            crate::job::input::MAX_CONFIG_BYTES,
            "adapter config",
        )
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display())))
        {
            Ok(j) => j,
            Err(e) => return bad("lora.init", e),
        };
        let field = |k: &str| json.get(k).filter(|v| !v.is_null());
        let mut differs = |what: &str, theirs: String, ours: String| {
            bad(
                "lora.init",
                format!("{}: {what} = {theirs}, the job's is {ours}", path.display()),
            )
        };
        if let Some(t) = field("peft_type")
            .and_then(|v| v.as_str())
            .filter(|t| *t != "LORA")
        {
            differs("peft_type", format!("{t:?}"), "\"LORA\"".into());
        }
        let r = field("r").and_then(|v| v.as_u64());
        if r != Some(u64::from(self.rank)) {
            differs("r", format!("{r:?}"), format!("lora.rank = {}", self.rank));
        }
        let alpha = field("lora_alpha").and_then(|v| v.as_f64());
        if alpha != Some(self.alpha) {
            differs(
                "lora_alpha",
                format!("{alpha:?}"),
                format!("lora.alpha = {}", self.alpha),
            );
        }
        let rs = field("use_rslora")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if rs != self.use_rslora {
            differs(
                "use_rslora",
                rs.to_string(),
                format!("lora.use_rslora = {}", self.use_rslora),
            );
        }
        for flag in ["use_dora", "lora_bias"] {
            if field(flag).and_then(|v| v.as_bool()) == Some(true) {
                differs(flag, "true".into(), "plain LoRA".into());
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

    #[test]
    fn an_init_folder_of_another_rank_or_alpha_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("adapter_config.json"),
            r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 16, "use_rslora": false}"#,
        )
        .unwrap();
        let mut s: LoraSection = toml::from_str("rank = 4\nalpha = 16").unwrap();
        s.init = Some(dir.path().to_path_buf());
        let mut p = Vec::new();
        s.check_init(&mut |f: &str, m: String| p.push(format!("{f}: {m}")));
        assert!(p.is_empty(), "{p:?}");
        s.rank = 8;
        s.alpha = 8.0;
        s.check_init(&mut |f: &str, m: String| p.push(format!("{f}: {m}")));
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].contains("adapter_config.json: r = Some(4), the job's is lora.rank = 8"),
            "{p:?}"
        );
        assert!(p[1].contains("lora_alpha"), "{p:?}");
    }
}
