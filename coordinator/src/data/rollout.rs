//! Rollout rows → a [`Rollout`]: `prompt` (text) or `prompt_ids`,
//! `completion` (text) or `completion_ids`, `reward` (number), `group`
//! (string or number; default: the prompt text, or the prompt ids),
//! `policy_version` (default 0) and optional `old_logprobs`, one per
//! completion token. Ids win over text when a row has both.
//!
//! A text prompt is tokenized with the tokenizer's special tokens (BOS for
//! the byte tokenizer) and a text completion gets EOS appended, as for SFT
//! prompt/completion rows; given ids are used as they are. Labels cover the
//! completion tokens only. `old_logprobs` are stored aligned with
//! `input_ids`, 0.0 on prompt positions (those carry no loss).
//!
//! GSM8K `question`/`answer` rows carry no sampled completion and no reward,
//! so they are rejected here with that reason (they load as SFT rows).

use serde_json::{Map, Value as Json};

use crate::doc::Rollout;

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
    let (prompt, prompt_text) = if obj.contains_key("prompt_ids") {
        let ids = format::id_list(obj, "prompt_ids")?;
        enc.check_ids(&ids, "prompt_ids")?;
        (ids, None)
    } else {
        let p = format::string(obj, "prompt")?;
        (enc.prompt_ids(p)?, Some(p))
    };
    let completion = if obj.contains_key("completion_ids") {
        let ids = format::id_list(obj, "completion_ids")?;
        enc.check_ids(&ids, "completion_ids")?;
        ids
    } else {
        enc.completion_ids(format::string(obj, "completion")?)?
    };
    let reward = obj["reward"]
        .as_f64()
        .filter(|r| r.is_finite())
        .ok_or_else(|| format!("\"reward\" must be a finite number, got {}", obj["reward"]))?;
    let group = match obj.get("group") {
        None | Some(Json::Null) => match prompt_text {
            Some(p) => p.to_string(),
            None => format!("{prompt:?}"),
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
        seq,
        reward,
        group,
        policy_version,
        old_logprobs,
    })
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
