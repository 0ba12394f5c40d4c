//! Every unit enum of the spec prints as the spec spells it: its serde
//! name (`sharding = "zero2"` prints `zero2`), never a `Debug` form
//! lowercased. The one place those names are turned into text.

use std::fmt;

use serde::Serialize;

/// The serde name of a unit variant (as a spec file writes it).
pub fn spec_name<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        other => unreachable!("a unit variant serializes as its name, got {other:?}"),
    }
}

macro_rules! display_as_spelled {
    ($($t:path),* $(,)?) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&spec_name(self))
            }
        }
    )*};
}

display_as_spelled!(
    crate::job::parallel::CollectiveChoice,
    crate::job::data::DataFormat,
    crate::job::data::DataSource,
    crate::job::model::Dtype,
    crate::job::data::OnBad,
    crate::job::faults::OnNonFinite,
    crate::job::optimizer::OptimizerKind,
    crate::job::optimizer::Schedule,
    crate::job::parallel::Sharding,
    crate::job::objective::DpoLoss,
    crate::job::objective::LossNormalization,
    crate::job::objective::ObjectiveKind,
    crate::job::objective::OffPolicy,
    crate::job::objective::Reference,
    crate::job::engine::EngineApi,
    crate::job::engine::EngineReload,
    crate::job::verifier::VerifierKind,
);

#[cfg(test)]
mod tests {
    use crate::job::data::DataFormat;
    use crate::job::objective::{ObjectiveKind, Reference};
    use crate::job::parallel::Sharding;

    #[test]
    fn enums_print_as_the_spec_spells_them() {
        assert_eq!(Sharding::Zero2.to_string(), "zero2");
        assert_eq!(ObjectiveKind::Pg.to_string(), "pg");
        assert_eq!(DataFormat::Rollouts.to_string(), "rollouts");
        // Not the Debug form lowercased: a variant of two words keeps the
        // spec's separator.
        for r in [Reference::Cached, Reference::Live] {
            let spelled = format!("reference = \"{r}\"");
            let back: toml::Value = toml::from_str(&spelled).unwrap();
            let parsed: Reference = back["reference"].clone().try_into().unwrap();
            assert_eq!(parsed, r);
        }
    }
}
