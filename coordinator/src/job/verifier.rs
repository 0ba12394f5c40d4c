//! `[rl.verifier]`: which verifier scores the RL loop's completions, and
//! its checks (the verifiers themselves are `crate::rl::verify`).

use serde::{Deserialize, Serialize};

use crate::job::env_names;
use crate::job::section::check_seconds;

/// What kind of verifier scores a job's completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum VerifierKind {
    #[default]
    Exact,
    Gsm8k,
    Regex,
    Command,
}

/// `[rl.verifier]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct VerifierSection {
    #[serde(default)]
    pub kind: VerifierKind,
    /// `regex`: the pattern a right completion matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Any kind: a format component, 1 when the completion matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_pattern: Option<String>,
    /// Weight of the format component in the reward (default 0.1 when
    /// `format_pattern` is set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_weight: Option<f64>,
    /// `command`: the program and its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// `command`: seconds a batch may take (default 60, at most a day).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// `command`: the coordinator's environment variables the program
    /// sees besides the fixed few (`crate::rl::verify::command::BASE_ENV`);
    /// never Accrue's own (`ACCRUE_*`). Unset ones are left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

impl VerifierSection {
    /// Reports every problem as (field, message).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        let compile = |field: &str, p: &Option<String>, bad: &mut dyn FnMut(&str, String)| {
            if let Some(p) = p {
                if let Err(e) = regex::Regex::new(p) {
                    bad(field, format!("not a valid regular expression: {e}"));
                }
            }
        };
        compile("rl.verifier.pattern", &self.pattern, bad);
        compile("rl.verifier.format_pattern", &self.format_pattern, bad);
        match self.kind {
            VerifierKind::Regex if self.pattern.is_none() => bad(
                "rl.verifier.pattern",
                "required for kind = \"regex\"".into(),
            ),
            VerifierKind::Command if self.command.is_empty() => bad(
                "rl.verifier.command",
                "required for kind = \"command\": the program and its arguments".into(),
            ),
            _ => {}
        }
        if self.kind != VerifierKind::Command && !self.command.is_empty() {
            bad(
                "rl.verifier.command",
                "only applies to kind = \"command\"".into(),
            );
        }
        if self.kind != VerifierKind::Command && !self.env.is_empty() {
            bad(
                "rl.verifier.env",
                "only applies to kind = \"command\"".into(),
            );
        }
        for (i, name) in self.env.iter().enumerate() {
            if let Some(message) = env_names::refused(name) {
                bad(&format!("rl.verifier.env[{i}]"), message);
            }
        }
        if let Some(t) = self.timeout_s {
            check_seconds(bad, "rl.verifier.timeout_s", t);
        }
        if let Some(w) = self.format_weight {
            if !w.is_finite() {
                bad("rl.verifier.format_weight", "must be finite".into());
            }
        }
    }
}
