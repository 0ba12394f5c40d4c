//! Verifiers: the rewards of the RL loop (issue 17). A verifier scores a
//! batch of (prompt, completion, reference) triples; each score is a reward
//! and its named components (step metrics `reward/<component>`), plus
//! whether the completion was right where the verifier can tell (accuracy).
//!
//! Built in: `exact` (the completion equals the reference, trimmed: the
//! synthetic arithmetic task), `gsm8k` (the last number of the completion
//! equals the number after `####` in the reference, normalised as
//! open-instruct / lm-eval do), `regex` (a format reward: 1 when the
//! completion matches a pattern). Any kind may add a format component
//! (`format_pattern`, weighted by `format_weight`). `command` runs a user
//! program (see [`command`]).
//!
//! Pure apart from `command`, which the shell runs off the state lock.

mod builtin;
pub mod command;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use builtin::{gsm8k_reference, last_number, normalize_number};

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
    /// `command`: seconds a batch may take (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
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
        if let Some(t) = self.timeout_s {
            if !(t.is_finite() && t > 0.0) {
                bad(
                    "rl.verifier.timeout_s",
                    format!("must be positive, got {t}"),
                );
            }
        }
        if let Some(w) = self.format_weight {
            if !w.is_finite() {
                bad("rl.verifier.format_weight", "must be finite".into());
            }
        }
    }
}

/// One thing to score.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub reference: &'a str,
}

/// A completion's score.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Score {
    pub reward: f64,
    /// Named parts of the reward (what went into it).
    pub components: BTreeMap<String, f64>,
    /// Whether the answer was right, where the verifier can tell.
    pub correct: Option<bool>,
}

/// Why a batch could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("rl.verifier: {0}")]
    Config(String),
    #[error("verifier command {program:?}: {message}")]
    Command { program: String, message: String },
}

/// A verifier ready to score (patterns compiled).
#[derive(Debug, Clone)]
pub struct Verifier {
    kind: VerifierKind,
    pattern: Option<regex::Regex>,
    format: Option<(regex::Regex, f64)>,
    command: Vec<String>,
    timeout_s: f64,
    /// Where a relative `command` program is found (the spec's directory).
    pub base_dir: Option<PathBuf>,
}

impl Verifier {
    pub fn new(s: &VerifierSection) -> Result<Verifier, VerifyError> {
        let re = |p: &str| regex::Regex::new(p).map_err(|e| VerifyError::Config(e.to_string()));
        Ok(Verifier {
            kind: s.kind,
            pattern: s.pattern.as_deref().map(re).transpose()?,
            format: match &s.format_pattern {
                Some(p) => Some((re(p)?, s.format_weight.unwrap_or(0.1))),
                None => None,
            },
            command: s.command.clone(),
            timeout_s: s.timeout_s.unwrap_or(60.0),
            base_dir: None,
        })
    }

    /// Scores a batch, one score per sample in order.
    pub fn score(&self, batch: &[Sample<'_>]) -> Result<Vec<Score>, VerifyError> {
        let mut scores = match self.kind {
            VerifierKind::Command => command::run(
                &self.command,
                self.base_dir.as_deref(),
                std::time::Duration::from_secs_f64(self.timeout_s),
                batch,
            )?,
            _ => batch.iter().map(|s| self.builtin(s)).collect(),
        };
        if let Some((re, w)) = &self.format {
            for (sc, s) in scores.iter_mut().zip(batch) {
                let f = f64::from(u8::from(re.is_match(s.completion)));
                sc.components.insert("format".into(), f);
                sc.reward += w * f;
            }
        }
        Ok(scores)
    }

    fn builtin(&self, s: &Sample<'_>) -> Score {
        let ok = match self.kind {
            VerifierKind::Exact => builtin::exact(s.completion, s.reference),
            VerifierKind::Gsm8k => builtin::gsm8k(s.completion, s.reference),
            VerifierKind::Regex => self
                .pattern
                .as_ref()
                .is_some_and(|p| p.is_match(s.completion)),
            VerifierKind::Command => unreachable!("scored by the command"),
        };
        let r = f64::from(u8::from(ok));
        Score {
            reward: r,
            components: BTreeMap::from([("correct".to_string(), r)]),
            correct: Some(ok),
        }
    }
}

/// Cuts `text` at the first of `stops` (the stop string excluded).
pub fn truncate_at_stop<'a>(text: &'a str, stops: &[String]) -> &'a str {
    let cut = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min();
    cut.map_or(text, |i| &text[..i])
}

#[cfg(test)]
mod tests;
