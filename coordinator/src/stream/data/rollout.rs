//! Rollout rows → a [`Rollout`]: `prompt` (text) or `prompt_ids`,
//! `completion` (text) or `completion_ids`, `reward` (number), `group`
//! (string or number; default: the prompt text, its JSON for messages, or
//! the prompt ids),
//! `policy_version` (default 0) and optional `old_logprobs`, one per
//! completion token. Ids win over text when a row has both.
//!
//! Text prompt and completion follow the SFT prompt/completion rules
//! ([`super::format`]): the prompt with the tokenizer's special tokens (BOS
//! for the byte tokenizer), the completion with EOS appended; a message-list
//! prompt goes through the chat template. Given ids are used as they are. Labels cover the
//! completion tokens only. `old_logprobs` are stored aligned with
//! `input_ids`, 0.0 on prompt positions (those carry no loss).
//!
//! GSM8K `question`/`answer` rows carry no sampled completion and no reward,
//! so they are rejected here with that reason (they load as SFT rows).

use serde_json::{Map, Value as Json};

use crate::stream::doc::Rollout;

use super::format::{self, keys, object, require_loss, Encoder, RowResult};

/// Builds the rollout of one row.
pub fn rollout_row(enc: &Encoder, row: &Json) -> RowResult<Rollout> {
    let obj = object(row)?;
    let has_prompt = obj.contains_key("prompt") || obj.contains_key("prompt_ids");
    let has_completion = obj.contains_key("completion") || obj.contains_key("completion_ids");
    if !(has_prompt && has_completion && obj.contains_key("reward")) {
        if obj.contains_key("question") && obj.contains_key("answer") {
            return Err("question/answer rows (gsm8k) have no sampled completion and reward: rollout rows need a completion and reward (load these rows with data.format = \"sft\", or generate rollouts from them)".into());
        }
        return Err(format!(
            "rollout rows need \"prompt\" or \"prompt_ids\", \"completion\" or \"completion_ids\", and \"reward\"; found keys {}",
            keys(obj)
        ));
    }
    let given_ids = |field: &str| -> RowResult<Option<Vec<u32>>> {
        if !obj.contains_key(field) {
            return Ok(None);
        }
        let ids = format::id_list(obj, field)?;
        enc.check_ids(&ids, field)?;
        Ok(Some(ids))
    };
    let (prompt, completion) = match (given_ids("prompt_ids")?, given_ids("completion_ids")?) {
        (Some(p), Some(c)) => (p, c),
        (Some(p), None) => (p, enc.completion_ids(format::string(obj, "completion")?)?),
        (None, Some(c)) => (enc.prompt_ids(format::string(obj, "prompt")?)?, c),
        (None, None) => {
            let tools = format::tools(obj)?;
            let names = ("prompt", "completion");
            enc.prompt_answer_ids(&obj["prompt"], &obj["completion"], tools.as_ref(), names)?
        }
    };
    let reward = obj["reward"]
        .as_f64()
        .filter(|r| r.is_finite())
        .ok_or_else(|| format!("\"reward\" must be a finite number, got {}", obj["reward"]))?;
    let group = match obj.get("group") {
        None | Some(Json::Null) => match obj.get("prompt") {
            Some(Json::String(p)) if !obj.contains_key("prompt_ids") => p.clone(),
            Some(p) if !obj.contains_key("prompt_ids") => p.to_string(),
            _ => format!("{prompt:?}"),
        },
        Some(Json::String(s)) => s.clone(),
        Some(Json::Number(n)) => n.to_string(),
        Some(v) => {
            return Err(format!(
                "\"group\" must be a string or a number, got a {}",
                format::kind(v)
            ))
        }
    };
    let policy_version = match obj.get("policy_version") {
        None | Some(Json::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("\"policy_version\" must be a non-negative integer, got {v}"))?,
    };
    let old_logprobs = logprobs(obj, prompt.len(), completion.len())?;
    let seq = require_loss(format::join(prompt, completion), "the rollout")?;
    Ok(Rollout {
        routing: None,
        seq,
        reward,
        group,
        policy_version,
        old_logprobs,
    })
}

/// A rollout row checked as the data stream checks file rows: built by
/// [`rollout_row`], then refused when longer than a row of `limit` (the
/// caller names where the row came from). Streamed rollouts go through
/// here too.
pub fn checked_rollout(
    enc: &Encoder,
    limit: crate::job::parallel::RowBudget,
    row: &Json,
) -> RowResult<Rollout> {
    let r = rollout_row(enc, row)?;
    let tokens = r.seq.len() as u64;
    if tokens > u64::from(limit.tokens()) {
        return Err(format!(
            "the rollout has {tokens} tokens, more than {limit} (it is never truncated)"
        ));
    }
    Ok(r)
}

fn logprobs(
    obj: &Map<String, Json>,
    prompt: usize,
    completion: usize,
) -> RowResult<Option<Vec<f32>>> {
    let list = match obj.get("old_logprobs") {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Array(l)) => l,
        Some(v) => {
            return Err(format!(
                "\"old_logprobs\" must be a list of numbers, got a {}",
                format::kind(v)
            ))
        }
    };
    if list.len() != completion {
        return Err(format!(
            "\"old_logprobs\" has {} entries but the completion has {completion} tokens (a text completion counts its appended eos)",
            list.len()
        ));
    }
    let mut out = vec![0.0f32; prompt];
    for (i, x) in list.iter().enumerate() {
        let lp = x
            .as_f64()
            .filter(|v| v.is_finite())
            .ok_or_else(|| format!("\"old_logprobs\"[{i}] = {x} is not a finite number"))?;
        out.push(lp as f32);
    }
    Ok(Some(out))
}
