//! The external engine's wire (`rl.engine`): a round's prompts as
//! OpenAI-compatible `/v1/completions` requests, the answers back as
//! completions, and the reload requests. Pure: the HTTP calls are
//! `crate::shell::service::engine`'s.
//!
//! One request per prompt asks for its `group` samples (`n`), the prompt
//! as token ids, with the seed of its sample 0 (a re-planned round asks
//! the same). The sampled tokens come back as ids
//! (`return_tokens_as_token_ids`: `"token_id:N"` strings, or vLLM's
//! `token_ids` list when given) with their log-probs (`logprobs`). Those
//! must be the log-softmax of the raw logits, as the workers' sampler
//! reports them (`old_logprobs`): vLLM's default `--logprobs-mode
//! raw_logprobs`. Every choice is checked: a missing or malformed field
//! fails the job naming it, a completion is never silently dropped.

use std::path::Path;

use serde_json::{json, Value};

use crate::job::engine::{EngineReload, EngineSection};
use crate::rl::generation::{Finish, GenCompletion, GenRequest};
use crate::rl::rounds::EngineRound;
use crate::stream::doc::DocId;

/// What is wrong in an engine's answer: the field (a JSON path) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("response field {field}: {message}")]
pub struct Malformed {
    pub field: String,
    pub message: String,
}

fn malformed(field: impl Into<String>, message: impl Into<String>) -> Malformed {
    Malformed {
        field: field.into(),
        message: message.into(),
    }
}

/// Bytes any answer may have, whatever it answers: a reload's, or a
/// completion request's for few tokens.
pub const ANSWER_FLOOR_BYTES: usize = 64 << 20;
/// Bytes an answer may spend per token it was asked for: a token's id,
/// text, log-prob and top log-prob entry take ~100 bytes of JSON.
pub const ANSWER_BYTES_PER_TOKEN: usize = 1024;

/// The most bytes the answer to a completion request for `n` samples of
/// up to `max_tokens` each may have: [`ANSWER_BYTES_PER_TOKEN`] per token
/// asked for, and never less than [`ANSWER_FLOOR_BYTES`].
pub fn answer_limit(n: u32, max_tokens: u32) -> usize {
    (n as usize)
        .saturating_mul(max_tokens as usize)
        .saturating_mul(ANSWER_BYTES_PER_TOKEN)
        .max(ANSWER_FLOOR_BYTES)
}

/// The round's requests by prompt: the first request of each prompt's
/// run of `group` samples.
pub fn prompts_of(r: &EngineRound) -> impl Iterator<Item = &GenRequest> {
    let group = r.group.max(1) as usize;
    r.plan.requests.chunks(group).map(|c| &c[0])
}

/// The name a LoRA job's policy is served under: vLLM loads each step's
/// adapter folder in place under this name (`/v1/load_lora_adapter`,
/// `load_inplace`), and completions ask for it as their model.
pub const ADAPTER_NAME: &str = "accrue-policy";

/// The `/v1/completions` body for prompt `q` of round `r`.
pub fn completion_request(r: &EngineRound, q: &GenRequest) -> Value {
    let s = &r.plan.sampling;
    let model = if r.adapter {
        ADAPTER_NAME
    } else {
        r.engine.model.as_str()
    };
    json!({
        "model": model,
        "prompt": &q.prompt_ids[..],
        "n": r.group,
        // The engines take a signed 64-bit seed.
        "seed": q.seed & (i64::MAX as u64),
        "temperature": s.temperature,
        "top_p": s.top_p,
        // -1: off (0 means off to us, not to every engine).
        "top_k": if s.top_k == 0 { -1 } else { i64::from(s.top_k) },
        "max_tokens": s.max_new_tokens,
        "stop_token_ids": &r.plan.stop_ids[..],
        "stop": s.stop,
        // Cutting at stop strings is the scorer's job, on the decoded text.
        "include_stop_str_in_output": true,
        "skip_special_tokens": false,
        "logprobs": 1,
        "return_tokens_as_token_ids": true,
        "stream": false,
    })
}

/// The completions of prompt `prompt`: exactly `n` choices, indexes
/// 0..n (sample = index), each with its token ids (all below `vocab`),
/// one finite log-prob per token and a finish reason.
pub fn parse_completions(
    body: &[u8],
    prompt: DocId,
    n: u32,
    vocab: u32,
) -> Result<Vec<GenCompletion>, Malformed> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| malformed("(body)", format!("not JSON: {e}")))?;
    let choices = v
        .get("choices")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("choices", "missing or not an array"))?;
    if choices.len() != n as usize {
        return Err(malformed(
            "choices",
            format!("{} choices, {n} were asked (n)", choices.len()),
        ));
    }
    let mut out: Vec<Option<GenCompletion>> = vec![None; n as usize];
    for (i, c) in choices.iter().enumerate() {
        let at = |f: &str| format!("choices[{i}].{f}");
        let index = c
            .get("index")
            .and_then(Value::as_u64)
            .ok_or_else(|| malformed(at("index"), "missing or not an integer"))?;
        let slot = out
            .get_mut(index as usize)
            .filter(|s| s.is_none())
            .ok_or_else(|| {
                malformed(at("index"), format!("{index} is out of range or repeated"))
            })?;
        let lp = c
            .get("logprobs")
            .filter(|l| !l.is_null())
            .ok_or_else(|| malformed(at("logprobs"), "missing (ask the engine for logprobs)"))?;
        let logprobs = lp
            .get("token_logprobs")
            .and_then(Value::as_array)
            .ok_or_else(|| malformed(at("logprobs.token_logprobs"), "missing or not an array"))?
            .iter()
            .enumerate()
            .map(|(j, x)| match x.as_f64() {
                Some(x) if x.is_finite() && x <= 0.0 => Ok(x as f32),
                _ => Err(malformed(
                    at(&format!("logprobs.token_logprobs[{j}]")),
                    format!("{x} is not a finite log-probability"),
                )),
            })
            .collect::<Result<Vec<f32>, _>>()?;
        let token_ids = token_ids(c, lp, &at)?;
        if let Some((j, t)) = token_ids.iter().enumerate().find(|(_, &t)| t >= vocab) {
            return Err(malformed(
                at(&format!("token_ids[{j}]")),
                format!("token id {t} is not below the model's vocab size {vocab}"),
            ));
        }
        if token_ids.len() != logprobs.len() {
            return Err(malformed(
                at("logprobs.token_logprobs"),
                format!(
                    "{} log-probs for {} tokens",
                    logprobs.len(),
                    token_ids.len()
                ),
            ));
        }
        let finish = match c.get("finish_reason").and_then(Value::as_str) {
            Some("stop") => Finish::Stop,
            Some("length") => Finish::Length,
            other => {
                return Err(malformed(
                    at("finish_reason"),
                    format!("expected \"stop\" or \"length\", got {other:?}"),
                ))
            }
        };
        *slot = Some(GenCompletion {
            // An engine returns no routing (rl.routing_replay refuses it).
            routing: Vec::new(),
            trace: None,
            prompt,
            sample: index as u32,
            token_ids,
            logprobs,
            finish,
        });
    }
    Ok(out
        .into_iter()
        .map(|c| c.expect("n distinct indexes"))
        .collect())
}

/// A choice's sampled token ids: vLLM's `token_ids` when present, else
/// the `"token_id:N"` strings of `logprobs.tokens`.
fn token_ids(c: &Value, lp: &Value, at: &impl Fn(&str) -> String) -> Result<Vec<u32>, Malformed> {
    if let Some(ids) = c.get("token_ids").filter(|t| !t.is_null()) {
        let ids = ids
            .as_array()
            .ok_or_else(|| malformed(at("token_ids"), "not an array"))?;
        return ids
            .iter()
            .enumerate()
            .map(|(j, t)| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        malformed(
                            at(&format!("token_ids[{j}]")),
                            format!("{t} is not a token id"),
                        )
                    })
            })
            .collect();
    }
    let tokens = lp.get("tokens").and_then(Value::as_array).ok_or_else(|| {
        malformed(
            at("logprobs.tokens"),
            "missing (and no token_ids): ask with return_tokens_as_token_ids",
        )
    })?;
    tokens
        .iter()
        .enumerate()
        .map(|(j, t)| {
            t.as_str()
                .and_then(|s| s.strip_prefix("token_id:"))
                .and_then(|s| s.parse::<u32>().ok())
                .ok_or_else(|| {
                    malformed(
                        at(&format!("logprobs.tokens[{j}]")),
                        format!("{t} is not \"token_id:N\" (ask with return_tokens_as_token_ids)"),
                    )
                })
        })
        .collect()
}

/// The requests that make the engine load the policy in `dir`: (path,
/// body) in order; empty for `reload = "none"`. A LoRA job's `dir` is an
/// adapter folder: vLLM loads it in place under [`ADAPTER_NAME`] (its
/// runtime LoRA updating: `--enable-lora`,
/// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), the only engine admitted
/// with `[lora]`.
pub fn reload_requests(
    engine: &EngineSection,
    dir: &Path,
    adapter: bool,
) -> Vec<(&'static str, Value)> {
    let dir = dir.display().to_string();
    if adapter {
        return vec![
            (
                "/v1/load_lora_adapter",
                json!({"lora_name": ADAPTER_NAME, "lora_path": dir, "load_inplace": true}),
            ),
            ("/reset_prefix_cache", json!({})),
        ];
    }
    match engine.reload {
        EngineReload::Sglang => vec![(
            "/update_weights_from_disk",
            json!({"model_path": dir, "flush_cache": true}),
        )],
        EngineReload::Vllm => vec![
            (
                "/collective_rpc",
                json!({"method": "reload_weights", "kwargs": {"weights_path": dir}}),
            ),
            // Cached prefixes hold the old weights' keys and values.
            ("/reset_prefix_cache", json!({})),
        ],
        EngineReload::None => Vec::new(),
    }
}

/// Whether a reload's answer says it failed (SGLang answers
/// `{"success": false, "message": …}`, with 200 in some versions).
pub fn reload_refused(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    (v.get("success") == Some(&Value::Bool(false))).then(|| {
        v.get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message")
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::job::rl::SamplingSection;
    use crate::rl::rounds::RoundPlan;

    fn round() -> EngineRound {
        let q = |line, sample, seed| GenRequest {
            prompt: DocId { file: 0, line },
            sample,
            prompt_ids: vec![72, 105].into(),
            seed,
        };
        EngineRound {
            job: "j".into(),
            round: 3,
            group: 2,
            plan: RoundPlan {
                record_routing: Default::default(),
                round: 3,
                policy_version: 4,
                sampling: Arc::new(SamplingSection {
                    temperature: 0.7,
                    stop: vec!["\n".into()],
                    ..Default::default()
                }),
                stop_ids: vec![257].into(),
                stop_sequences: Vec::new().into(),
                requests: vec![q(1, 0, u64::MAX), q(1, 1, 7), q(2, 0, 5), q(2, 1, 9)],
            },
            engine: toml::from_str("url = \"http://e:1\"\nmodel = \"policy\"\nreload = \"vllm\"\n")
                .unwrap(),
            adapter: false,
        }
    }

    #[test]
    fn an_answer_may_grow_with_the_tokens_asked_for_above_a_floor() {
        assert_eq!(answer_limit(1, 16), ANSWER_FLOOR_BYTES);
        assert_eq!(answer_limit(0, 0), ANSWER_FLOOR_BYTES);
        assert_eq!(answer_limit(64, 8192), 64 * 8192 * ANSWER_BYTES_PER_TOKEN);
        assert_eq!(answer_limit(u32::MAX, u32::MAX), usize::MAX);
    }

    #[test]
    fn one_request_per_prompt_asks_for_its_group_as_token_ids() {
        let r = round();
        let firsts: Vec<&GenRequest> = prompts_of(&r).collect();
        assert_eq!(firsts.len(), 2);
        assert_eq!((firsts[0].prompt.line, firsts[1].prompt.line), (1, 2));
        let body = completion_request(&r, firsts[0]);
        assert_eq!(body["model"], "policy");
        assert_eq!(body["prompt"], json!([72, 105]));
        assert_eq!(body["n"], 2);
        assert_eq!(
            body["seed"],
            json!(i64::MAX),
            "the seed fits a signed 64-bit int"
        );
        assert_eq!(body["top_k"], -1);
        assert_eq!(body["max_tokens"], 256);
        assert_eq!(body["stop_token_ids"], json!([257]));
        assert_eq!(body["stop"], json!(["\n"]));
        assert_eq!(body["logprobs"], 1);
        assert_eq!(body["return_tokens_as_token_ids"], true);
        assert!((body["temperature"].as_f64().unwrap() - 0.7).abs() < 1e-6);
    }

    fn choice(index: u32, tokens: &[&str], lps: &[f64], finish: &str) -> Value {
        json!({"index": index, "text": "x", "finish_reason": finish,
               "logprobs": {"tokens": tokens, "token_logprobs": lps}})
    }

    const P: DocId = DocId { file: 0, line: 1 };

    #[test]
    fn choices_come_back_as_completions_in_sample_order() {
        let body = json!({"choices": [
            choice(1, &["token_id:49", "token_id:257"], &[-0.5, -0.25], "stop"),
            choice(0, &["token_id:48"], &[-1.0], "length"),
        ]});
        let cs = parse_completions(body.to_string().as_bytes(), P, 2, 320).unwrap();
        assert_eq!(cs.len(), 2);
        assert_eq!(
            (cs[0].sample, &cs[0].token_ids[..], cs[0].finish),
            (0, &[48][..], Finish::Length)
        );
        assert_eq!((cs[1].sample, &cs[1].token_ids[..]), (1, &[49, 257][..]));
        assert_eq!(cs[1].logprobs, [-0.5, -0.25]);
        // vLLM's token_ids list wins over the strings when given.
        let mut c = choice(0, &["?"], &[-1.0], "stop");
        c["token_ids"] = json!([50]);
        let cs =
            parse_completions(json!({"choices": [c]}).to_string().as_bytes(), P, 1, 320).unwrap();
        assert_eq!(cs[0].token_ids, [50]);
    }

    #[test]
    fn a_malformed_answer_names_the_field() {
        let field = |body: Value, n| {
            parse_completions(body.to_string().as_bytes(), P, n, 320)
                .unwrap_err()
                .field
        };
        let ok = choice(0, &["token_id:48"], &[-1.0], "stop");
        assert_eq!(field(json!({"choices": [ok.clone()]}), 2), "choices");
        assert_eq!(field(json!({"error": "x"}), 1), "choices");
        let mut no_lp = ok.clone();
        no_lp["logprobs"] = Value::Null;
        assert_eq!(field(json!({"choices": [no_lp]}), 1), "choices[0].logprobs");
        let text = choice(0, &["0"], &[-1.0], "stop");
        assert_eq!(
            field(json!({"choices": [text]}), 1),
            "choices[0].logprobs.tokens[0]"
        );
        let big = choice(0, &["token_id:400"], &[-1.0], "stop");
        assert_eq!(
            field(json!({"choices": [big]}), 1),
            "choices[0].token_ids[0]"
        );
        let short = choice(0, &["token_id:1", "token_id:2"], &[-1.0], "stop");
        assert_eq!(
            field(json!({"choices": [short]}), 1),
            "choices[0].logprobs.token_logprobs"
        );
        let nan = json!({"choices": [{"index": 0, "finish_reason": "stop",
            "logprobs": {"tokens": ["token_id:1"], "token_logprobs": [null]}}]});
        assert_eq!(field(nan, 1), "choices[0].logprobs.token_logprobs[0]");
        let twice = json!({"choices": [ok.clone(), ok.clone()]});
        assert_eq!(field(twice, 2), "choices[1].index");
        let abort = choice(0, &["token_id:1"], &[-1.0], "abort");
        assert_eq!(
            field(json!({"choices": [abort]}), 1),
            "choices[0].finish_reason"
        );
    }

    #[test]
    fn reloads_per_engine() {
        let mut e = round().engine;
        let dir = Path::new("/shared/out/policy/step-4");
        let v = reload_requests(&e, dir, false);
        assert_eq!(v[0].0, "/collective_rpc");
        assert_eq!(
            v[0].1["kwargs"]["weights_path"],
            "/shared/out/policy/step-4"
        );
        assert_eq!(v[1].0, "/reset_prefix_cache");
        // A LoRA job's adapter folder, loaded in place under one name.
        let v = reload_requests(&e, dir, true);
        assert_eq!(v[0].0, "/v1/load_lora_adapter");
        assert_eq!(v[0].1["lora_name"], ADAPTER_NAME);
        assert_eq!(v[0].1["lora_path"], "/shared/out/policy/step-4");
        assert_eq!(v[0].1["load_inplace"], true);
        assert_eq!(v[1].0, "/reset_prefix_cache");
        let mut r = round();
        r.adapter = true;
        let q = prompts_of(&r).next().unwrap().clone();
        assert_eq!(completion_request(&r, &q)["model"], ADAPTER_NAME);
        e.reload = EngineReload::Sglang;
        let v = reload_requests(&e, dir, false);
        assert_eq!((v.len(), v[0].0), (1, "/update_weights_from_disk"));
        assert_eq!(v[0].1["model_path"], "/shared/out/policy/step-4");
        assert_eq!(
            reload_refused(br#"{"success": false, "message": "bad path"}"#).as_deref(),
            Some("bad path")
        );
        assert_eq!(reload_refused(br#"{"success": true}"#), None);
    }
}
