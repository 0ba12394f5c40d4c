//! Manifests against the Kubernetes API schemas: each object is
//! deserialized into its `k8s-openapi` type and serialized back; serde
//! ignores fields a type does not know, so whatever the round trip drops
//! is a field the schema does not have (a typo, a wrong indentation level).

use k8s_openapi::api::{apps, batch, core, policy, rbac, scheduling};

use super::crd;
use serde::de::DeserializeOwned;
use serde::Deserialize as _;
use serde::Serialize;
use serde_json::Value;

/// The documents of a multi-document YAML stream, as JSON values.
pub fn parse_yaml_stream(text: &str) -> Result<Vec<Value>, String> {
    serde_yaml_ng::Deserializer::from_str(text)
        .enumerate()
        .map(|(i, d)| Value::deserialize(d).map_err(|e| format!("document {i}: {e}")))
        .filter(|d| !matches!(d, Ok(Value::Null)))
        .collect()
}

fn roundtrip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<Value, String> {
    let typed: T = serde_json::from_value(doc.clone())
        .map_err(|e| format!("does not match its schema: {e}"))?;
    serde_json::to_value(&typed).map_err(|e| e.to_string())
}

/// The fields of `doc` its schema does not know, as `(path, message)`;
/// `Err` when the kind has no schema here or the object does not parse.
pub fn roundtrip_dropped(doc: &Value) -> Result<Vec<(String, String)>, String> {
    let api = doc["apiVersion"].as_str().unwrap_or("");
    let kind = doc["kind"].as_str().unwrap_or("");
    let back = match (api, kind) {
        ("apps/v1", "Deployment") => roundtrip::<apps::v1::Deployment>(doc),
        ("apps/v1", "StatefulSet") => roundtrip::<apps::v1::StatefulSet>(doc),
        ("apps/v1", "DaemonSet") => roundtrip::<apps::v1::DaemonSet>(doc),
        ("batch/v1", "Job") => roundtrip::<batch::v1::Job>(doc),
        ("v1", "Service") => roundtrip::<core::v1::Service>(doc),
        ("v1", "ConfigMap") => roundtrip::<core::v1::ConfigMap>(doc),
        ("v1", "Secret") => roundtrip::<core::v1::Secret>(doc),
        ("v1", "PersistentVolumeClaim") => roundtrip::<core::v1::PersistentVolumeClaim>(doc),
        ("v1", "ServiceAccount") => roundtrip::<core::v1::ServiceAccount>(doc),
        ("policy/v1", "PodDisruptionBudget") => roundtrip::<policy::v1::PodDisruptionBudget>(doc),
        ("scheduling.k8s.io/v1", "PriorityClass") => {
            roundtrip::<scheduling::v1::PriorityClass>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => roundtrip::<rbac::v1::Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => roundtrip::<rbac::v1::RoleBinding>(doc),
        ("monitoring.coreos.com/v1", "PodMonitor") => roundtrip::<crd::PodMonitor>(doc),
        ("monitoring.coreos.com/v1", "PrometheusRule") => roundtrip::<crd::PrometheusRule>(doc),
        _ => Err(format!(
            "no schema known for apiVersion {api:?} kind {kind:?}"
        )),
    }?;
    let mut out = Vec::new();
    dropped("", doc, &back, &mut out);
    Ok(out)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Walks `orig`, reporting what `back` lacks or holds differently.
fn dropped(path: &str, orig: &Value, back: &Value, out: &mut Vec<(String, String)>) {
    match (orig, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => dropped(&join(path, k), v, w, out),
                    None if v.is_null() => {}
                    None => out.push((
                        join(path, k),
                        "unknown field (not in the Kubernetes API schema)".into(),
                    )),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, v) in a.iter().enumerate() {
                match b.get(i) {
                    Some(w) => dropped(&format!("{path}[{i}]"), v, w, out),
                    None => out.push((format!("{path}[{i}]"), "dropped by the schema".into())),
                }
            }
        }
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) if a == b => {}
        (a, b) => out.push((path.to_string(), format!("{a} reads back as {b}"))),
    }
}
