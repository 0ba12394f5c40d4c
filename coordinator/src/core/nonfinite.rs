//! Reading back numbers that may be NaN or infinite. JSON has no literal
//! for them: serde_json writes them as `null`, which plain `f64` fields
//! then refuse, so one NaN in a step's metrics would make the job's record
//! unreadable (issue 14). These readers take a number, `null` (read as
//! NaN), or the strings "NaN", "inf" and "-inf".

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum Num {
    Finite(f64),
    Named(String),
    Null(()),
}

impl Num {
    fn value<E: serde::de::Error>(self) -> Result<f64, E> {
        match self {
            Num::Finite(v) => Ok(v),
            Num::Null(()) => Ok(f64::NAN),
            Num::Named(s) => match s.to_ascii_lowercase().as_str() {
                "nan" => Ok(f64::NAN),
                "inf" | "+inf" | "infinity" => Ok(f64::INFINITY),
                "-inf" | "-infinity" => Ok(f64::NEG_INFINITY),
                _ => Err(E::custom(format!("expected a number, got \"{s}\""))),
            },
        }
    }
}

/// A possibly non-finite `f64`.
pub fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Num::deserialize(d)?.value()
}

/// A map of possibly non-finite values.
pub fn map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    BTreeMap::<String, Num>::deserialize(d)?
        .into_iter()
        .map(|(k, v)| Ok((k, v.value()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "super::f64")]
        x: f64,
        #[serde(deserialize_with = "super::map")]
        m: std::collections::BTreeMap<String, f64>,
    }

    #[test]
    fn numbers_null_and_named_values_are_read() {
        let t: T = serde_json::from_str(
            r#"{"x": null, "m": {"a": 1.5, "b": null, "c": "inf", "d": "-inf"}}"#,
        )
        .unwrap();
        assert!(t.x.is_nan());
        assert_eq!(t.m["a"], 1.5);
        assert!(t.m["b"].is_nan());
        assert_eq!(t.m["c"], f64::INFINITY);
        assert_eq!(t.m["d"], f64::NEG_INFINITY);
        let e = serde_json::from_str::<T>(r#"{"x": "many", "m": {}}"#)
            .err()
            .unwrap();
        assert!(e.to_string().contains("many"), "{e}");
    }
}
