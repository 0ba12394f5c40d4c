//! `[rl.engine]`: the RL loop's generation on an external inference server
//! (issue 17 item 6) instead of the job's workers: a vLLM or SGLang server
//! speaking the OpenAI-compatible `/v1/completions` API, told to reload
//! each published policy from disk. The spec section and its checks; the
//! request/response conversion is `crate::rl::engine::wire`, the HTTP calls
//! `crate::shell::service::engine`.

use serde::{Deserialize, Serialize};

use crate::job::env_names;
use crate::job::limits::MAX_ENGINE_RETRIES;
use crate::job::section::{bound, check_seconds};

/// Which HTTP API the engine serves completions on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineApi {
    /// `POST /v1/completions` with the prompt as token ids (vLLM, SGLang).
    #[default]
    Completions,
}

/// How the engine is told to load a published policy directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineReload {
    /// SGLang: `POST /update_weights_from_disk {"model_path": dir}`.
    Sglang,
    /// vLLM (`VLLM_SERVER_DEV_MODE=1`): `POST /collective_rpc` calling the
    /// workers' `reload_weights(weights_path = dir)`, then
    /// `POST /reset_prefix_cache`.
    Vllm,
    /// Never: the engine keeps the weights it was started with (every
    /// rollout is of policy version 0; for tests and frozen samplers).
    None,
}

/// `[rl.engine]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// Base URL, `http://host:port` (the paths are appended).
    pub url: String,
    /// The served model name (`--served-model-name`).
    pub model: String,
    #[serde(default)]
    pub api: EngineApi,
    pub reload: EngineReload,
    /// Seconds one HTTP request may take (a whole group's completions; at
    /// most a day).
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// HTTP requests in flight at once (one per prompt of a round).
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
    /// Attempts after the first for a request that found the engine
    /// unreachable or got a 5xx/429 (exponential backoff from 0.2 s; at
    /// most `crate::job::limits::MAX_ENGINE_RETRIES`, 10).
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Environment variable holding the bearer token (`--api-key`); the
    /// token itself never appears in the spec or the logs. Never one of
    /// Accrue's own (`ACCRUE_*`: see `crate::job::env_names`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
}

fn default_timeout_s() -> f64 {
    600.0
}

fn default_max_concurrency() -> u32 {
    64
}

fn default_retries() -> u32 {
    4
}

impl EngineSection {
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        match self.url.strip_prefix("http://") {
            Some(rest) if !rest.trim_matches('/').is_empty() => {}
            _ if self.url.starts_with("https://") => bad(
                "rl.engine.url",
                format!("https is not supported (plain http to an engine on the cluster network, or a local TLS proxy), got {:?}", self.url),
            ),
            _ => bad(
                "rl.engine.url",
                format!("must be an http base URL like \"http://host:8000\", got {:?}", self.url),
            ),
        }
        if self.model.trim().is_empty() {
            bad(
                "rl.engine.model",
                "must name the served model (the engine's --served-model-name)".into(),
            );
        }
        check_seconds(bad, "rl.engine.timeout_s", self.timeout_s);
        if self.max_concurrency == 0 {
            bad("rl.engine.max_concurrency", "must be at least 1".into());
        }
        bound(
            bad,
            "rl.engine.retries",
            u64::from(self.retries),
            u64::from(MAX_ENGINE_RETRIES),
            "retries",
        );
        match self.api_key_env.as_deref() {
            Some(v) if v.trim().is_empty() => bad(
                "rl.engine.api_key_env",
                "must name an environment variable".into(),
            ),
            Some(v) => {
                if let Some(message) = env_names::refused(v) {
                    bad("rl.engine.api_key_env", message);
                }
            }
            None => {}
        }
    }

    /// The base URL without a trailing slash.
    pub fn base(&self) -> &str {
        self.url.trim_end_matches('/')
    }
}

/// Checks tying `[rl.engine]` to the policy's publication and the
/// staleness bound: the engine moves to a new policy only when one is
/// published, and a round is planned only while its rollouts could still
/// be admitted, so a bound the publications cannot meet would stall the
/// job for good.
pub fn validate_with_rl(
    engine: &EngineSection,
    publish_every: Option<u64>,
    max_staleness: Option<u64>,
    bad: &mut impl FnMut(&str, String),
) {
    match (engine.reload, publish_every, max_staleness) {
        (EngineReload::None, _, Some(_)) => bad(
            "rl.max_staleness",
            "rl.engine.reload = \"none\" never moves the engine off its first policy, so its rollouts would all go stale: leave rl.max_staleness unset or choose a reload".into(),
        ),
        (EngineReload::None, _, None) => {}
        (_, None, _) => bad(
            "rl.publish_every",
            "required with rl.engine: the engine reloads each published policy".into(),
        ),
        (_, Some(every), Some(max)) if every > max + 1 => bad(
            "rl.publish_every",
            format!(
                "must be at most rl.max_staleness + 1 = {} with rl.engine (got {every}): between publications the engine's policy ages by up to rl.publish_every - 1 steps, and rounds older than rl.max_staleness cannot be admitted, so the job would wait forever",
                max + 1
            ),
        ),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(toml_text: &str) -> EngineSection {
        toml::from_str(toml_text).unwrap()
    }

    fn problems(e: &EngineSection, every: Option<u64>, max: Option<u64>) -> Vec<String> {
        let mut out = Vec::new();
        let mut bad = |f: &str, m: String| out.push(format!("{f}: {m}"));
        e.validate(&mut bad);
        validate_with_rl(e, every, max, &mut bad);
        out
    }

    #[test]
    fn a_minimal_section_takes_the_defaults() {
        let e = section("url = \"http://gpu-0:8000/\"\nmodel = \"policy\"\nreload = \"sglang\"\n");
        assert_eq!(e.api, EngineApi::Completions);
        assert_eq!((e.max_concurrency, e.retries), (64, 4));
        assert_eq!(e.base(), "http://gpu-0:8000");
        assert!(problems(&e, Some(1), Some(1)).is_empty());
    }

    #[test]
    fn every_bad_field_is_named() {
        let e = EngineSection {
            url: "https://x".into(),
            model: " ".into(),
            api: EngineApi::Completions,
            reload: EngineReload::Vllm,
            timeout_s: 0.0,
            max_concurrency: 0,
            retries: 0,
            api_key_env: Some(String::new()),
        };
        let out = problems(&e, None, None);
        let fields: Vec<&str> = out.iter().map(|p| p.split(':').next().unwrap()).collect();
        assert_eq!(
            fields,
            [
                "rl.engine.url",
                "rl.engine.model",
                "rl.engine.timeout_s",
                "rl.engine.max_concurrency",
                "rl.engine.api_key_env",
                "rl.publish_every"
            ],
            "{out:?}"
        );
        assert!(out[0].contains("https is not supported"), "{out:?}");
    }

    #[test]
    fn huge_timeouts_endless_retries_and_accrue_secrets_are_refused() {
        let base = "url = \"http://e:1\"\nmodel = \"m\"\nreload = \"none\"\n";
        for (extra, field) in [
            ("timeout_s = 1e300", "rl.engine.timeout_s"),
            ("timeout_s = inf", "rl.engine.timeout_s"),
            ("timeout_s = 86401", "rl.engine.timeout_s"),
            ("retries = 1000000", "rl.engine.retries"),
            ("retries = 11", "rl.engine.retries"),
            (
                "api_key_env = \"ACCRUE_ADMIN_TOKEN\"",
                "rl.engine.api_key_env",
            ),
            (
                "api_key_env = \"ACCRUE_WORKER_TOKEN\"",
                "rl.engine.api_key_env",
            ),
            ("api_key_env = \"NOT-A-NAME\"", "rl.engine.api_key_env"),
        ] {
            let out = problems(&section(&format!("{base}{extra}\n")), None, None);
            assert_eq!(out.len(), 1, "{extra}: {out:?}");
            assert!(
                out[0].starts_with(&format!("{field}: ")),
                "{extra}: {out:?}"
            );
        }
        let ok = format!("{base}timeout_s = 86400\nretries = 10\napi_key_env = \"ENGINE_KEY\"\n");
        assert!(problems(&section(&ok), None, None).is_empty());
    }

    #[test]
    fn publication_must_keep_up_with_the_staleness_bound() {
        let e = section("url = \"http://e:1\"\nmodel = \"m\"\nreload = \"vllm\"\n");
        assert!(problems(&e, Some(3), Some(2)).is_empty());
        let out = problems(&e, Some(4), Some(2));
        assert_eq!(out.len(), 1);
        assert!(
            out[0].starts_with("rl.publish_every: must be at most rl.max_staleness + 1 = 3"),
            "{out:?}"
        );
        let frozen = section("url = \"http://e:1\"\nmodel = \"m\"\nreload = \"none\"\n");
        assert!(problems(&frozen, None, None).is_empty());
        assert!(problems(&frozen, None, Some(1))[0].starts_with("rl.max_staleness"));
    }
}
