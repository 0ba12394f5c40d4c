//! Shared row machinery: JSON field helpers, chat-message normalisation
//! (OpenAI `messages` and ShareGPT `conversations`) and the [`Encoder`] that
//! turns text or messages into labelled token sequences.
//!
//! Labelling rules (TRL / open-instruct conventions):
//! - prompt + completion strings: `ids(prompt, add_special_tokens)` then
//!   `ids(completion)` + EOS, tokenized separately (TRL's "standard" format,
//!   no chat template); the loss covers the completion and EOS.
//! - a chat (SFT): the whole conversation is rendered once and tokenized once
//!   with byte offsets. A template that marks its assistant text with
//!   `{% generation %}` blocks sets the loss tokens exactly as transformers'
//!   `return_assistant_tokens_mask` does ([`generation_mask`]). Otherwise
//!   assistant turn `i` spans from the end of
//!   `render(messages[..i], add_generation_prompt)` to where
//!   `render(messages[..=i])` stops agreeing with the full render (so a
//!   turn-closing `<|end|>` is inside, an end-of-conversation EOS only for the
//!   last turn). A token is a loss token if its byte range lies inside a span.
//! - prompt messages + answer messages (DPO, conversational prompt/completion):
//!   `render(prompt, add_generation_prompt)` is tokenized on its own and the
//!   rest of `render(prompt + answer)` on its own, as TRL does, so a pair's
//!   chosen and rejected share the prompt tokens exactly; the loss covers all
//!   of the answer part.

use serde_json::{Map, Value as Json};

use crate::stream::doc::{Sequence, IGNORE_INDEX};

use super::template::ChatTemplate;
use super::tokenize::Tokenizer;

pub type RowResult<T> = std::result::Result<T, String>;

/// Tokenizer + chat template + the ids the data stream appends.
pub struct Encoder {
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    pub eos_id: u32,
    /// The model's vocabulary size (its embedding rows): pre-tokenized ids
    /// must be below it. Not the tokenizer's: a model may hold more ids
    /// than its tokenizer makes (admission checks it holds at least those).
    pub model_vocab: u32,
}

/// Prompt ids (no loss) followed by answer ids (loss).
pub fn join(prompt: Vec<u32>, answer: Vec<u32>) -> Sequence {
    let mut labels = vec![IGNORE_INDEX; prompt.len()];
    labels.extend(answer.iter().map(|&t| t as i32));
    let mut input_ids = prompt;
    input_ids.extend(answer);
    Sequence::new(input_ids, labels)
}

/// Errors unless the sequence trains on at least one token.
pub fn require_loss(seq: Sequence, what: &str) -> RowResult<Sequence> {
    if seq.loss_tokens() == 0 {
        Err(format!(
            "{what} has no loss tokens ({} tokens, none of them in a completion or assistant turn)",
            seq.len()
        ))
    } else {
        Ok(seq)
    }
}

impl Encoder {
    /// Prompt-side ids of a plain string (the tokenizer's special tokens,
    /// e.g. BOS, included).
    pub fn prompt_ids(&self, prompt: &str) -> RowResult<Vec<u32>> {
        self.tok.ids(prompt, true)
    }

    /// Completion-side ids of a plain string, EOS appended.
    pub fn completion_ids(&self, completion: &str) -> RowResult<Vec<u32>> {
        let mut ids = self.tok.ids(completion, false)?;
        ids.push(self.eos_id);
        Ok(ids)
    }

    /// A whole conversation with the loss on its assistant turns.
    pub fn chat(&self, msgs: &[Json], tools: Option<&Json>) -> RowResult<Sequence> {
        let t = &self.template;
        let full = t.render_marked(msgs, tools, false)?;
        let enc = self.tok.encode(&full.text, false)?;
        let loss = match &full.generation {
            Some(blocks) => generation_mask(&enc.offsets, blocks),
            None => {
                let spans = self.assistant_spans(msgs, tools, &full.text)?;
                enc.offsets
                    .iter()
                    .map(|o| {
                        spans
                            .iter()
                            .any(|s| o.start >= s.start && o.end <= s.end && o.start < s.end)
                    })
                    .collect()
            }
        };
        let labels = enc
            .ids
            .iter()
            .zip(loss)
            .map(|(&id, l)| if l { id as i32 } else { IGNORE_INDEX })
            .collect();
        Ok(Sequence::new(enc.ids, labels))
    }

    /// Byte ranges of the assistant turns of a template that does not
    /// mark them: from the end of `render(messages[..i],
    /// add_generation_prompt)` to where `render(messages[..=i])` stops
    /// agreeing with the whole render.
    fn assistant_spans(
        &self,
        msgs: &[Json],
        tools: Option<&Json>,
        full: &str,
    ) -> RowResult<Vec<std::ops::Range<usize>>> {
        let t = &self.template;
        let mut spans = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let pre = t.render(&msgs[..i], tools, true)?;
            if !full.starts_with(&pre) {
                return Err(format!(
                    "chat template ({}): rendering messages[..{i}] with add_generation_prompt is not a prefix of the whole conversation, so assistant turn {i} cannot be located",
                    t.source
                ));
            }
            let upto = t.render(&msgs[..=i], tools, false)?;
            let end = common_prefix_len(&upto, full);
            spans.push(pre.len()..end.max(pre.len()));
        }
        Ok(spans)
    }

    /// Prompt ids and answer ids of a conversational prompt and answer.
    pub fn chat_prompt_answer(
        &self,
        prompt: &[Json],
        answer: &[Json],
        tools: Option<&Json>,
    ) -> RowResult<(Vec<u32>, Vec<u32>)> {
        let t = &self.template;
        let prompt_text = t.render(prompt, tools, true)?;
        let all: Vec<Json> = prompt.iter().chain(answer).cloned().collect();
        let full = t.render(&all, tools, false)?;
        let Some(answer_text) = full.strip_prefix(prompt_text.as_str()) else {
            return Err(format!(
                "chat template ({}): the rendered prompt (with add_generation_prompt) is not a prefix of prompt + answer",
                t.source
            ));
        };
        Ok((
            self.tok.ids(&prompt_text, false)?,
            self.tok.ids(answer_text, false)?,
        ))
    }

    /// Prompt and answer, each a string or messages: strings use the plain
    /// rule, anything with messages goes through the chat template (a string
    /// prompt becomes one user turn, a string answer one assistant turn).
    pub fn prompt_answer(
        &self,
        prompt: &Json,
        answer: &Json,
        tools: Option<&Json>,
        names: (&str, &str),
    ) -> RowResult<Sequence> {
        let (p, a) = self.prompt_answer_ids(prompt, answer, tools, names)?;
        Ok(join(p, a))
    }

    /// [`Self::prompt_answer`], as (prompt ids, answer ids).
    pub fn prompt_answer_ids(
        &self,
        prompt: &Json,
        answer: &Json,
        tools: Option<&Json>,
        names: (&str, &str),
    ) -> RowResult<(Vec<u32>, Vec<u32>)> {
        if let (Json::String(p), Json::String(a)) = (prompt, answer) {
            return Ok((self.prompt_ids(p)?, self.completion_ids(a)?));
        }
        let p = to_messages(prompt, "user", names.0)?;
        let mut a = to_messages(answer, "assistant", names.1)?;
        // TRL allows the answer list to repeat the prompt turns.
        if a.len() > p.len() && a[..p.len()] == p[..] {
            a.drain(..p.len());
        }
        self.chat_prompt_answer(&p, &a, tools)
    }

    /// Checks pre-tokenized ids against the model's vocabulary.
    pub fn check_ids(&self, ids: &[u32], field: &str) -> RowResult<()> {
        match ids.iter().position(|&t| t >= self.model_vocab) {
            Some(i) => Err(format!(
                "\"{field}\"[{i}] = {} is not below the model's vocab_size {}",
                ids[i], self.model_vocab
            )),
            None => Ok(()),
        }
    }
}

/// Which tokens a template's `{% generation %}` blocks mark, as
/// transformers' `return_assistant_tokens_mask` does: for each block, the
/// token holding its first byte through the token holding its last (to the
/// end of the row when no token holds the last); none once a block's first
/// byte is in no token.
pub fn generation_mask(
    offsets: &[std::ops::Range<usize>],
    blocks: &[std::ops::Range<usize>],
) -> Vec<bool> {
    let token_at = |b: usize| offsets.iter().position(|o| o.start <= b && b < o.end);
    let mut mask = vec![false; offsets.len()];
    for block in blocks {
        let Some(first) = token_at(block.start) else {
            break;
        };
        let last = token_at(block.end - 1).unwrap_or(offsets.len() - 1);
        for m in mask.iter_mut().take(last + 1).skip(first) {
            *m = true;
        }
    }
    mask
}

/// Byte length of the common prefix, on a char boundary.
pub fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    n
}

pub fn object(row: &Json) -> RowResult<&Map<String, Json>> {
    row.as_object()
        .ok_or_else(|| format!("row is a json {}, expected an object", kind(row)))
}

pub fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "boolean",
        Json::Number(_) => "number",
        Json::String(_) => "string",
        Json::Array(_) => "array",
        Json::Object(_) => "object",
    }
}

pub fn keys(obj: &Map<String, Json>) -> String {
    let k: Vec<&str> = obj.keys().map(String::as_str).collect();
    format!("[{}]", k.join(", "))
}

pub fn string<'a>(obj: &'a Map<String, Json>, field: &str) -> RowResult<&'a str> {
    match obj.get(field) {
        Some(Json::String(s)) => Ok(s),
        Some(v) => Err(format!("\"{field}\" must be a string, got a {}", kind(v))),
        None => Err(format!("missing \"{field}\"")),
    }
}

/// A list of token ids (non-negative integers below 2^32).
pub fn id_list(obj: &Map<String, Json>, field: &str) -> RowResult<Vec<u32>> {
    let Some(v) = obj.get(field) else {
        return Err(format!("missing \"{field}\""));
    };
    let list = v
        .as_array()
        .ok_or_else(|| format!("\"{field}\" must be a list of token ids, got a {}", kind(v)))?;
    list.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("\"{field}\"[{i}] = {x} is not a token id"))
        })
        .collect()
}

/// Labels: token ids or -100.
pub fn label_list(obj: &Map<String, Json>, field: &str, vocab: u32) -> RowResult<Vec<i32>> {
    let list = obj
        .get(field)
        .and_then(Json::as_array)
        .ok_or_else(|| format!("\"{field}\" must be a list of labels"))?;
    list.iter()
        .enumerate()
        .map(|(i, x)| match x.as_i64() {
            Some(-100) => Ok(IGNORE_INDEX),
            Some(n) if n >= 0 && n < i64::from(vocab) => Ok(n as i32),
            _ => Err(format!(
                "\"{field}\"[{i}] = {x} is neither -100 nor a token id below the model's vocab_size {vocab}"
            )),
        })
        .collect()
}

/// A pre-tokenized sequence: ids, and labels aligned with them (all ids
/// when the labels field is absent).
pub fn pretokenized(
    enc: &Encoder,
    obj: &Map<String, Json>,
    ids_field: &str,
    labels_field: &str,
) -> RowResult<Sequence> {
    let input_ids = id_list(obj, ids_field)?;
    enc.check_ids(&input_ids, ids_field)?;
    let labels = if obj.contains_key(labels_field) {
        let l = label_list(obj, labels_field, enc.model_vocab)?;
        if l.len() != input_ids.len() {
            return Err(format!(
                "\"{labels_field}\" has {} entries but \"{ids_field}\" has {}; they must be aligned",
                l.len(),
                input_ids.len()
            ));
        }
        l
    } else {
        input_ids.iter().map(|&t| t as i32).collect()
    };
    Ok(Sequence::new(input_ids, labels))
}

/// OpenAI-style messages: objects with a string `role` and a string
/// `content` (null or missing only next to `tool_calls`). Objects are kept
/// whole so templates see `tool_calls` and the like.
pub fn messages(v: &Json, field: &str) -> RowResult<Vec<Json>> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("\"{field}\" must be a list of messages, got a {}", kind(v)))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let o = m
                .as_object()
                .ok_or_else(|| format!("{field}[{i}] must be an object, got a {}", kind(m)))?;
            if !o.get("role").is_some_and(Json::is_string) {
                return Err(format!("{field}[{i}] needs a string \"role\""));
            }
            match o.get("content") {
                Some(Json::String(_)) => Ok(m.clone()),
                None | Some(Json::Null) if o.contains_key("tool_calls") => Ok(m.clone()),
                _ => Err(format!("{field}[{i}] needs a string \"content\"")),
            }
        })
        .collect()
}

/// ShareGPT role names → chat roles (function calls are assistant turns and
/// trained on; observations are tool results).
pub fn sharegpt_role(from: &str) -> Option<&'static str> {
    Some(match from {
        "human" | "user" => "user",
        "gpt" | "assistant" | "function_call" => "assistant",
        "system" => "system",
        "observation" | "tool" | "function" => "tool",
        _ => return None,
    })
}

fn sharegpt_message(m: &Json, at: &str) -> RowResult<Json> {
    let o = m
        .as_object()
        .ok_or_else(|| format!("{at} must be an object, got a {}", kind(m)))?;
    let from = string(o, "from").map_err(|e| format!("{at}: {e}"))?;
    let value = string(o, "value").map_err(|e| format!("{at}: {e}"))?;
    let role = sharegpt_role(from).ok_or_else(|| {
        format!("{at}: unknown \"from\" {from:?} (expected human, user, gpt, assistant, system, function_call, observation or tool)")
    })?;
    Ok(serde_json::json!({"role": role, "content": value}))
}

/// ShareGPT `conversations` (`{from, value}` list), with an optional
/// row-level `system` string put first.
pub fn sharegpt(obj: &Map<String, Json>, field: &str) -> RowResult<Vec<Json>> {
    let v = &obj[field];
    let list = v
        .as_array()
        .ok_or_else(|| format!("\"{field}\" must be a list of messages, got a {}", kind(v)))?;
    let mut out = Vec::with_capacity(list.len() + 1);
    if let Some(sys) = obj.get("system") {
        let s = sys.as_str().ok_or("\"system\" must be a string")?;
        if !s.is_empty() {
            out.push(serde_json::json!({"role": "system", "content": s}));
        }
    }
    for (i, m) in list.iter().enumerate() {
        out.push(sharegpt_message(m, &format!("{field}[{i}]"))?);
    }
    Ok(out)
}

/// A string (one message of `default_role`), one message object (OpenAI or
/// ShareGPT shape) or a list of messages.
pub fn to_messages(v: &Json, default_role: &str, field: &str) -> RowResult<Vec<Json>> {
    match v {
        Json::String(s) => Ok(vec![
            serde_json::json!({"role": default_role, "content": s}),
        ]),
        Json::Object(o) if o.contains_key("from") => Ok(vec![sharegpt_message(v, field)?]),
        Json::Object(_) => messages(&Json::Array(vec![v.clone()]), field),
        Json::Array(list) if list.first().is_some_and(|m| m.get("from").is_some()) => list
            .iter()
            .enumerate()
            .map(|(i, m)| sharegpt_message(m, &format!("{field}[{i}]")))
            .collect(),
        Json::Array(_) => messages(v, field),
        _ => Err(format!(
            "\"{field}\" must be a string or messages, got a {}",
            kind(v)
        )),
    }
}

/// Tool schemas for the template: a list, or a JSON string holding one.
pub fn tools(obj: &Map<String, Json>) -> RowResult<Option<Json>> {
    match obj.get("tools") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Json::String(s)) => serde_json::from_str(s)
            .map(Some)
            .map_err(|e| format!("\"tools\" is a string but not json: {e}")),
        Some(v) => Ok(Some(v.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("aé", "aè"), 1);
        assert_eq!(common_prefix_len("", "x"), 0);
    }

    #[test]
    fn sharegpt_maps_roles_and_system() {
        let row = json!({"system": "S", "conversations": [
            {"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"},
            {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}]});
        let m = sharegpt(row.as_object().unwrap(), "conversations").unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
        let bad = json!({"conversations": [{"from": "robot", "value": "x"}]});
        let e = sharegpt(bad.as_object().unwrap(), "conversations").unwrap_err();
        assert!(e.contains("conversations[0]") && e.contains("robot"), "{e}");
    }

    #[test]
    fn messages_need_string_content() {
        let e = messages(&json!([{"role": "user", "content": 3}]), "messages").unwrap_err();
        assert_eq!(e, "messages[0] needs a string \"content\"");
        assert!(messages(&json!([{"role": "assistant", "tool_calls": []}]), "m").is_ok());
    }
}
