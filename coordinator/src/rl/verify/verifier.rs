//! A verifier ready to score: the section's patterns compiled, the
//! built-in checks or the `command` program behind one `score` call.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::sample::{Sample, Score, VerifyError};
use super::{builtin, command};
use crate::job::verifier::{VerifierKind, VerifierSection};

/// A verifier ready to score (patterns compiled).
#[derive(Debug, Clone)]
pub struct Verifier {
    kind: VerifierKind,
    pattern: Option<regex::Regex>,
    format: Option<(regex::Regex, f64)>,
    command: Vec<String>,
    env: Vec<String>,
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
            env: s.env.clone(),
            timeout_s: s.timeout_s.unwrap_or(60.0),
            base_dir: None,
        })
    }

    /// Scores a batch, one score per sample in order.
    pub fn score(&self, batch: &[Sample<'_>]) -> Result<Vec<Score>, VerifyError> {
        let mut scores = match self.kind {
            VerifierKind::Command => {
                // Checked at submit; a stored spec from before the bound
                // must not panic the scoring thread.
                let timeout = std::time::Duration::try_from_secs_f64(self.timeout_s)
                    .map_err(|e| VerifyError::Config(format!("timeout_s: {e}")))?;
                let inv = command::Invocation {
                    argv: &self.command,
                    env: &self.env,
                    base_dir: self.base_dir.as_deref(),
                    timeout,
                };
                command::run(&inv, batch).map_err(|error| VerifyError::Command {
                    program: self.command.first().cloned().unwrap_or_default(),
                    error,
                })?
            }
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
