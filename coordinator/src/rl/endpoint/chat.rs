//! The OpenAI chat-completions wire (`POST /v1/chat/completions`) as the
//! endpoint takes and answers it: a request's fields checked one by one
//! (a field that would change what is sampled and is not honoured is
//! refused by name, never ignored), messages normalised for the chat
//! template and for comparing an episode's calls, and the response with
//! its log-probs and token ids.

use serde_json::{json, Map, Value as Json};

use crate::job::rl::SamplingSection;
use crate::rl::tools::{self, Call};

/// A refused call or report: the HTTP status, the message, and the
/// request field it names (OpenAI's `error.param`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: format!("{param}: {}", message.into()),
            param: Some(param.to_string()),
        }
    }

    pub fn status(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// The body OpenAI clients read (`error.message`, `error.type`).
    pub fn body(&self) -> Json {
        let kind = match self.status {
            400 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            409 => "conflict_error",
            429 => "rate_limit_error",
            _ => "server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}})
    }
}

/// A chat-completion request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    /// As sent (normalised by [`render_message`] / [`same_message`]).
    pub messages: Vec<Json>,
    pub tools: Option<Json>,
    /// The job's sampling with the request's overrides.
    pub sampling: SamplingSection,
    /// `max_tokens` / `max_completion_tokens` when given.
    pub max_tokens: Option<u32>,
    pub seed: Option<u64>,
    pub logprobs: bool,
    /// vLLM's `return_token_ids`: the prompt's and completion's ids.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: log-prob tokens as
    /// `token_id:N`.
    pub tokens_as_ids: bool,
    /// The `user` field: names the episode when no header does.
    pub user: Option<String>,
}

/// Fields accepted whatever their value: they change nothing sampled.
const INERT: [&str; 5] = [
    "metadata",
    "store",
    "service_tier",
    "stream_options",
    "parallel_tool_calls",
];

impl ChatRequest {
    /// Checks `body` against the job's sampling `defaults`.
    pub fn parse(body: &Json, defaults: &SamplingSection) -> Result<ChatRequest, ApiError> {
        let o = body
            .as_object()
            .ok_or_else(|| ApiError::bad("body", "must be a JSON object"))?;
        let mut r = ChatRequest {
            model: String::new(),
            messages: Vec::new(),
            tools: None,
            sampling: SamplingSection {
                stop: Vec::new(),
                ..defaults.clone()
            },
            max_tokens: None,
            seed: None,
            logprobs: false,
            return_token_ids: false,
            tokens_as_ids: false,
            user: None,
        };
        for (k, v) in o {
            r.field(k, v)?;
        }
        if r.messages.is_empty() {
            return Err(ApiError::bad("messages", "required: a non-empty list"));
        }
        Ok(r)
    }

    fn field(&mut self, k: &str, v: &Json) -> Result<(), ApiError> {
        let null = v.is_null();
        let num = |min: f64, max: f64| -> Result<Option<f64>, ApiError> {
            if null {
                return Ok(None);
            }
            match v.as_f64() {
                Some(x) if (min..=max).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::bad(
                    k,
                    format!("must be a number in [{min}, {max}]"),
                )),
            }
        };
        let uint = || -> Result<Option<u64>, ApiError> {
            if null {
                return Ok(None);
            }
            v.as_u64()
                .map(Some)
                .ok_or_else(|| ApiError::bad(k, "must be a non-negative integer"))
        };
        let flag = || -> Result<bool, ApiError> {
            if null {
                return Ok(false);
            }
            v.as_bool()
                .ok_or_else(|| ApiError::bad(k, "must be true or false"))
        };
        match k {
            "model" => self.model = v.as_str().unwrap_or_default().to_string(),
            "messages" => self.messages = messages(v)?,
            "tools" if !null => {
                if !v.as_array().is_some_and(|a| a.iter().all(Json::is_object)) {
                    return Err(ApiError::bad(k, "must be a list of tool definitions"));
                }
                self.tools = Some(v.clone());
            }
            "tool_choice" if !null && v.as_str() != Some("auto") => {
                return Err(ApiError::bad(
                    k,
                    "only \"auto\" is served (the policy's own choice: forcing or forbidding a call would need constrained decoding)",
                ));
            }
            "temperature" => {
                if let Some(t) = num(0.0, 2.0)? {
                    self.sampling.temperature = t as f32;
                }
            }
            "top_p" => {
                if let Some(p) = num(0.0, 1.0)? {
                    if p == 0.0 {
                        return Err(ApiError::bad(k, "must be above 0"));
                    }
                    self.sampling.top_p = p as f32;
                }
            }
            // vLLM's extra: -1 (or 0) is off.
            "top_k" if !null => match v.as_i64() {
                Some(-1 | 0) => self.sampling.top_k = 0,
                Some(n) if n > 0 => self.sampling.top_k = n.min(i64::from(u32::MAX)) as u32,
                _ => {
                    return Err(ApiError::bad(
                        k,
                        "must be a positive integer, or -1 for off",
                    ))
                }
            },
            "max_tokens" | "max_completion_tokens" => {
                if let Some(n) = uint()? {
                    if n == 0 {
                        return Err(ApiError::bad(k, "must be at least 1"));
                    }
                    self.max_tokens = Some(n.min(u64::from(u32::MAX)) as u32);
                }
            }
            "seed" => self.seed = uint()?,
            "logprobs" => self.logprobs = flag()?,
            "top_logprobs" if uint()?.unwrap_or(0) > 0 => {
                return Err(ApiError::bad(
                    k,
                    "alternatives are not returned: only the sampled token's log-prob (leave top_logprobs at 0)",
                ));
            }
            "n" if uint()?.unwrap_or(1) != 1 => {
                return Err(ApiError::bad(
                    k,
                    "must be 1: each call is one turn of one episode (make one call per episode of a group)",
                ));
            }
            "stream" if flag()? => {
                return Err(ApiError::bad(k, "streamed responses are not served"));
            }
            "stop" if !null && v.as_array().is_none_or(|a| !a.is_empty()) => {
                return Err(ApiError::bad(
                    k,
                    "stop strings are not applied here (a completion ends at the tokenizer's end-of-sequence token): cut the text in the harness",
                ));
            }
            "frequency_penalty" | "presence_penalty" | "repetition_penalty"
                if !null
                    && v.as_f64() != Some(if k == "repetition_penalty" { 1.0 } else { 0.0 }) =>
            {
                return Err(ApiError::bad(
                    k,
                    "penalties are not applied: the policy samples from its own distribution",
                ));
            }
            "logit_bias" if !null && v.as_object().is_none_or(|m| !m.is_empty()) => {
                return Err(ApiError::bad(
                    k,
                    "not applied: the policy samples from its own distribution",
                ));
            }
            "response_format" if !null && v.get("type").and_then(Json::as_str) != Some("text") => {
                return Err(ApiError::bad(
                    k,
                    "only {\"type\": \"text\"} is served (no constrained decoding)",
                ));
            }
            "user" => self.user = v.as_str().filter(|s| !s.is_empty()).map(str::to_string),
            "return_token_ids" => self.return_token_ids = flag()?,
            "return_tokens_as_token_ids" => self.tokens_as_ids = flag()?,
            "skip_special_tokens" if !null && !flag()? => {
                return Err(ApiError::bad(k, "only true is served: the text leaves special tokens out (the token ids carry them)"));
            }
            // Checked above when they matter; the rest change nothing.
            "tools"
            | "tool_choice"
            | "top_logprobs"
            | "n"
            | "stream"
            | "stop"
            | "frequency_penalty"
            | "presence_penalty"
            | "repetition_penalty"
            | "logit_bias"
            | "response_format"
            | "skip_special_tokens"
            | "top_k" => {}
            k if INERT.contains(&k) => {}
            _ if null => {}
            _ => return Err(ApiError::bad(k, "is not supported by this endpoint")),
        }
        Ok(())
    }
}

/// `messages`: objects with a string `role`; `content` a string, a list of
/// text parts, or null beside `tool_calls`.
fn messages(v: &Json) -> Result<Vec<Json>, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| ApiError::bad("messages", "must be a list"))?;
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let o = m
            .as_object()
            .ok_or_else(|| ApiError::bad(&at, "must be an object"))?;
        if !o.get("role").is_some_and(Json::is_string) {
            return Err(ApiError::bad(&at, "needs a string \"role\""));
        }
        content_text(o).map_err(|e| ApiError::bad(&at, e))?;
        if let Some(calls) = o.get("tool_calls").filter(|c| !c.is_null()) {
            call_list(calls).map_err(|e| ApiError::bad(&format!("{at}.tool_calls"), e))?;
        }
    }
    Ok(list.clone())
}

/// A message's content as text: a string, text parts joined, or empty.
fn content_text(o: &Map<String, Json>) -> Result<String, String> {
    match o.get("content") {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Json::as_str), p.get("text")) {
                (Some("text"), Some(Json::String(t))) => Ok(t.as_str()),
                _ => Err("content parts must be {\"type\": \"text\", \"text\": …} (no images or audio)".to_string()),
            })
            .collect(),
        Some(_) => Err("\"content\" must be a string, a list of text parts or null".into()),
    }
}

/// An assistant message's tool calls as (name, arguments object).
fn call_list(calls: &Json) -> Result<Vec<(String, Json)>, String> {
    let list = calls.as_array().ok_or("must be a list")?;
    list.iter()
        .enumerate()
        .map(|(i, c)| {
            let f = c.get("function").unwrap_or(c);
            let name = f
                .get("name")
                .and_then(Json::as_str)
                .ok_or(format!("[{i}] needs function.name"))?;
            let args = match f.get("arguments") {
                None | Some(Json::Null) => json!({}),
                Some(Json::String(s)) => serde_json::from_str(s)
                    .map_err(|e| format!("[{i}].function.arguments is not JSON ({e})"))?,
                Some(a) => a.clone(),
            };
            Ok((name.to_string(), args))
        })
        .collect()
}

/// A message as chat templates read it (transformers' convention):
/// content a string, a tool call's arguments an object.
pub fn render_message(m: &Json) -> Json {
    let o = m.as_object().expect("checked by parse");
    let mut out = o.clone();
    out.insert(
        "content".into(),
        Json::String(content_text(o).unwrap_or_default()),
    );
    if let Some(calls) = o.get("tool_calls").filter(|c| !c.is_null()) {
        let calls = call_list(calls).unwrap_or_default();
        out.insert(
            "tool_calls".into(),
            calls
                .into_iter()
                .map(|(name, arguments)| json!({"type": "function", "function": {"name": name, "arguments": arguments}}))
                .collect(),
        );
    }
    Json::Object(out)
}

/// Whether two messages say the same: role, content text, tool calls
/// (name and arguments), and a tool message's call id. Clients echo a
/// reply with extra null fields (`refusal`, `audio`, …), which do not count.
pub fn same_message(a: &Json, b: &Json) -> bool {
    let key = |m: &Json| {
        let o = m.as_object()?;
        let calls = o
            .get("tool_calls")
            .filter(|c| !c.is_null())
            .map(call_list)
            .transpose()
            .ok()?
            .unwrap_or_default();
        Some((
            o.get("role").cloned(),
            content_text(o).ok()?,
            calls,
            o.get("tool_call_id").cloned().filter(|v| !v.is_null()),
        ))
    };
    matches!((key(a), key(b)), (Some(x), Some(y)) if x == y)
}

/// The assistant message of a completion's text: its Hermes/Qwen tool
/// calls lifted out (`tool_calls`, ids `call_<prefix>_<k>`), the rest as
/// content (null when only calls remain).
pub fn assistant_message(text: &str, call_prefix: &str) -> (Json, usize) {
    let calls: Vec<(String, Json)> = tools::parse_calls(text)
        .into_iter()
        .filter_map(|c| match c {
            Call::Tool { name, arguments } => Some((name, arguments)),
            Call::Malformed(_) => None,
        })
        .collect();
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), 0);
    }
    // The content is what is left outside the call blocks.
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(tools::CALL_OPEN) {
        content.push_str(&rest[..at]);
        match rest[at..].find(tools::CALL_CLOSE) {
            Some(end) => rest = &rest[at + end + tools::CALL_CLOSE.len()..],
            None => {
                rest = "";
                break;
            }
        }
    }
    content.push_str(rest);
    let content = content.trim();
    let n = calls.len();
    let tool_calls: Vec<Json> = calls
        .into_iter()
        .enumerate()
        .map(|(k, (name, arguments))| {
            json!({"id": format!("call_{call_prefix}_{k}"), "type": "function",
                   "function": {"name": name, "arguments": arguments.to_string()}})
        })
        .collect();
    let content = if content.is_empty() {
        Json::Null
    } else {
        Json::String(content.to_string())
    };
    (
        json!({"role": "assistant", "content": content, "tool_calls": tool_calls}),
        n,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Json) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(&body, &SamplingSection::default())
    }

    #[test]
    fn requests_take_overrides_and_refuse_what_they_cannot_honour_by_name() {
        let r = parse(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5, "max_completion_tokens": 9, "seed": 3, "logprobs": true,
            "n": 1, "stream": false, "store": false, "tool_choice": "auto", "top_k": -1}),
        )
        .unwrap();
        assert_eq!(r.sampling.temperature, 0.5);
        assert_eq!((r.max_tokens, r.seed, r.logprobs), (Some(9), Some(3), true));
        assert_eq!(r.sampling.top_k, 0);
        for (field, value) in [
            ("n", json!(2)),
            ("stream", json!(true)),
            ("stop", json!(["\n"])),
            ("top_logprobs", json!(5)),
            ("temperature", json!(3.0)),
            ("tool_choice", json!("required")),
            ("presence_penalty", json!(0.5)),
            ("functions", json!([])),
        ] {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body[field] = value;
            let e = parse(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{e}");
            assert_eq!(e.status, 400);
        }
        let e = parse(json!({"messages": [{"role": "user", "content": 3}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0]"));
        let e = parse(json!({"messages": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    /// A reply echoed by a client (arguments as a JSON string, extra null
    /// fields, text parts) is the same message; another content or call
    /// is not.
    #[test]
    fn echoed_replies_compare_equal_and_render_with_object_arguments() {
        let (ours, n) = assistant_message(
            "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call>",
            "e1_1",
        );
        assert_eq!(n, 1);
        assert_eq!(ours["content"], "Let me compute.");
        assert_eq!(ours["tool_calls"][0]["id"], "call_e1_1_0");
        assert_eq!(
            ours["tool_calls"][0]["function"]["arguments"],
            "{\"expression\":\"12*34\"}"
        );
        let echoed = json!({"role": "assistant", "content": [{"type": "text", "text": "Let me compute."}],
            "refusal": null, "audio": null,
            "tool_calls": [{"id": "call_e1_1_0", "type": "function",
                "function": {"name": "calculator", "arguments": "{\"expression\": \"12*34\"}"}}]});
        assert!(same_message(&ours, &echoed));
        let mut other = echoed.clone();
        other["tool_calls"][0]["function"]["arguments"] = json!("{\"expression\": \"12*35\"}");
        assert!(!same_message(&ours, &other));
        let rendered = render_message(&echoed);
        assert_eq!(rendered["content"], "Let me compute.");
        assert_eq!(
            rendered["tool_calls"][0]["function"]["arguments"]["expression"],
            "12*34"
        );
        let (plain, n) = assistant_message("408", "e1_2");
        assert_eq!((plain["content"].as_str(), n), (Some("408"), 0));
        assert!(plain.get("tool_calls").is_none());
    }
}
