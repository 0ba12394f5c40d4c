//! The Prometheus Operator objects the monitoring component ships
//! (monitoring.coreos.com/v1 PodMonitor and PrometheusRule). k8s-openapi
//! has only the built-in kinds and the operator publishes no Rust types,
//! so these are the fields we use, transcribed from the operator's API
//! reference; the round trip reports anything else (a typo) as unknown.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMonitor {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: PodMonitorSpec,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMonitorSpec {
    pub selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<NamespaceSelector>,
    pub pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub any: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_names: Vec<String>,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodMetricsEndpoint {
    pub port: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
}

#[derive(Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PrometheusRule {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: PrometheusRuleSpec,
}

#[derive(Deserialize, Serialize)]
pub struct PrometheusRuleSpec {
    pub groups: Vec<RuleGroup>,
}

#[derive(Deserialize, Serialize)]
pub struct RuleGroup {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
    pub rules: Vec<Rule>,
}

#[derive(Deserialize, Serialize)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    pub expr: String,
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    pub for_: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}
