//! What the spec's section files share: [`SpecProblem`], one thing wrong
//! with a spec named by its field path, the two checks many sections make
//! through their `bad(field, message)` callback (a named input file, a
//! size bound), and `is_default`, which keeps a section or field left at
//! its default out of the stored TOML.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::job::{input, limits};

/// One thing wrong with a spec, with the dotted path of the field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecProblem {
    pub field: String,
    pub message: String,
}

impl SpecProblem {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for SpecProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// A named input file: not empty, and a regular file (not a directory, a
/// FIFO or a device; see [`crate::job::input`]).
pub(crate) fn check_file(bad: &mut impl FnMut(&str, String), field: &str, path: &Path) {
    if path.as_os_str().is_empty() {
        bad(field, "must not be empty".into());
    } else if let Err(e) = input::check(path) {
        bad(field, e.to_string());
    }
}

/// `value` must not exceed `max` (see [`crate::job::limits`]).
pub(crate) fn bound(
    bad: &mut impl FnMut(&str, String),
    field: &str,
    value: u64,
    max: u64,
    what: &str,
) {
    if let Some(message) = limits::over(value, max, what) {
        bad(field, message);
    }
}

/// A timeout: a finite number of seconds, more than 0 and at most
/// [`limits::MAX_TIMEOUT_S`].
pub(crate) fn check_seconds(bad: &mut impl FnMut(&str, String), field: &str, value: f64) {
    if !(value.is_finite() && value > 0.0) {
        bad(
            field,
            format!("must be a number of seconds > 0, got {value}"),
        );
    } else if value > limits::MAX_TIMEOUT_S {
        bad(
            field,
            format!(
                "{value} is more than the limit of {} seconds (one day)",
                limits::MAX_TIMEOUT_S
            ),
        );
    }
}

/// For `skip_serializing_if`: a value at its default is left out.
pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}
