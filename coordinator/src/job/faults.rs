//! `[faults]`: how a job reacts to failures: a non-finite step (fail, or
//! bisect its documents to quarantine the bad ones), a step that takes too
//! long, a step that keeps being aborted.

use serde::{Deserialize, Serialize};

use crate::job::section::check_seconds;

/// What a non-finite step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// The job fails, naming the step.
    #[default]
    Fail,
    /// The step's documents are bisected with forward/backward probes to
    /// find the ones that make it non-finite; those are quarantined and the
    /// step re-planned without them.
    Bisect,
}

/// `[faults]`: how the job reacts to failures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsSection {
    #[serde(default)]
    pub on_nonfinite: OnNonFinite,
    /// Probe rounds a bisection may take before the job fails instead.
    #[serde(default = "default_max_bisect_rounds")]
    pub max_bisect_rounds: u32,
    /// Seconds a dispatched step may take before its silent members are
    /// treated as lost. Unset: derived from the job's observed step times
    /// (see `core`'s step deadline), never below 10 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_timeout_s: Option<f64>,
    /// Dispatches of one step (1 + aborts) before the job fails as unable
    /// to make progress.
    #[serde(default = "default_max_step_attempts")]
    pub max_step_attempts: u32,
}

fn default_max_bisect_rounds() -> u32 {
    24
}
fn default_max_step_attempts() -> u32 {
    10
}

impl Default for FaultsSection {
    fn default() -> Self {
        Self {
            on_nonfinite: OnNonFinite::Fail,
            max_bisect_rounds: default_max_bisect_rounds(),
            step_timeout_s: None,
            max_step_attempts: default_max_step_attempts(),
        }
    }
}

impl FaultsSection {
    /// The checks of `[faults]`: at least one round, one attempt and one
    /// second, at most a day.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.max_bisect_rounds == 0 {
            bad("faults.max_bisect_rounds", "must be at least 1".into());
        }
        if self.max_step_attempts == 0 {
            bad("faults.max_step_attempts", "must be at least 1".into());
        }
        if let Some(t) = self.step_timeout_s {
            if t.is_finite() && t < 1.0 {
                bad(
                    "faults.step_timeout_s",
                    format!("must be at least 1 second, got {t}"),
                );
            } else {
                check_seconds(bad, "faults.step_timeout_s", t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_timeout_is_at_least_a_second_and_at_most_a_day() {
        let problems = |t: f64| {
            let f = FaultsSection {
                step_timeout_s: Some(t),
                ..Default::default()
            };
            let mut out = Vec::new();
            f.validate(&mut |field: &str, m: String| out.push(format!("{field}: {m}")));
            out
        };
        for t in [0.5, 1e300, f64::INFINITY, f64::NAN, 86_401.0] {
            let out = problems(t);
            assert_eq!(out.len(), 1, "{t}: {out:?}");
            assert!(out[0].starts_with("faults.step_timeout_s: "), "{out:?}");
        }
        assert!(problems(1.0).is_empty() && problems(86_400.0).is_empty());
    }
}
