//! Preference rows → a (chosen, rejected) pair of labelled sequences that
//! share the prompt tokens. Shapes, detected by keys:
//! - pre-tokenized `chosen_input_ids`/`rejected_input_ids` with optional
//!   aligned `chosen_labels`/`rejected_labels`;
//! - LLaMA-Factory: `conversations` (ShareGPT prompt, optional `system`) and
//!   `chosen`/`rejected` each one `{from, value}` message (or a list);
//! - TRL: `prompt`/`chosen`/`rejected`, each a string or messages (all
//!   strings: no chat template; the answer lists may repeat the prompt);
//! - TRL implicit prompt: `chosen`/`rejected` message lists without `prompt`
//!   (the prompt is their common leading messages);
//! - HH-RLHF: `chosen`/`rejected` transcript strings
//!   `"\n\nHuman: ...\n\nAssistant: ..."`. The prompt is their common prefix
//!   up to and including its last `"\n\nAssistant:"`; the answers are the
//!   rest (for the few rows that diverge before the final turn, the rest
//!   holds more than one turn; no row is dropped).

use serde_json::Value as Json;

use crate::stream::doc::Sequence;

use super::format::{self, common_prefix_len, keys, object, require_loss, Encoder, RowResult};

const HH_ASSISTANT: &str = "\n\nAssistant:";

/// Builds the (chosen, rejected) sequences of one preference row.
pub fn dpo_row(enc: &Encoder, row: &Json) -> RowResult<(Sequence, Sequence)> {
    let obj = object(row)?;
    let (chosen, rejected) = if obj.contains_key("chosen_input_ids") {
        (
            format::pretokenized(enc, obj, "chosen_input_ids", "chosen_labels")?,
            format::pretokenized(enc, obj, "rejected_input_ids", "rejected_labels")?,
        )
    } else {
        let (Some(c), Some(r)) = (obj.get("chosen"), obj.get("rejected")) else {
            return Err(format!(
                "no known dpo row shape: expected \"chosen\" and \"rejected\" (with \"prompt\" or \"conversations\", or hh-rlhf transcripts) or \"chosen_input_ids\"/\"rejected_input_ids\"; found keys {}",
                keys(obj)
            ));
        };
        let tools = format::tools(obj)?;
        let tools = tools.as_ref();
        if obj.contains_key("conversations") {
            let prompt = Json::Array(format::sharegpt(obj, "conversations")?);
            pair(enc, &prompt, c, r, tools)?
        } else if let Some(p) = obj.get("prompt") {
            pair(enc, p, c, r, tools)?
        } else {
            match (c, r) {
                (Json::String(c), Json::String(r)) => hh_pair(enc, c, r)?,
                (Json::Array(_), Json::Array(_)) => implicit_prompt_pair(enc, c, r, tools)?,
                _ => {
                    return Err(
                        "without \"prompt\", \"chosen\" and \"rejected\" must both be transcripts (strings) or both message lists".into(),
                    )
                }
            }
        }
    };
    Ok((
        require_loss(chosen, "the chosen sequence")?,
        require_loss(rejected, "the rejected sequence")?,
    ))
}

fn pair(
    enc: &Encoder,
    prompt: &Json,
    chosen: &Json,
    rejected: &Json,
    tools: Option<&Json>,
) -> RowResult<(Sequence, Sequence)> {
    Ok((
        enc.prompt_answer(prompt, chosen, tools, ("prompt", "chosen"))?,
        enc.prompt_answer(prompt, rejected, tools, ("prompt", "rejected"))?,
    ))
}

/// Splits HH-RLHF transcripts at the last shared `"\n\nAssistant:"`.
pub fn hh_split<'a>(chosen: &'a str, rejected: &'a str) -> RowResult<(&'a str, &'a str, &'a str)> {
    let shared = common_prefix_len(chosen, rejected);
    let cut = chosen[..shared]
        .rfind(HH_ASSISTANT)
        .map(|i| i + HH_ASSISTANT.len())
        .ok_or("\"chosen\" and \"rejected\" are strings without a \"prompt\", but they share no prefix ending in \"\\n\\nAssistant:\" (expected hh-rlhf transcripts)")?;
    Ok((&chosen[..cut], &chosen[cut..], &rejected[cut..]))
}

fn hh_pair(enc: &Encoder, chosen: &str, rejected: &str) -> RowResult<(Sequence, Sequence)> {
    let (prompt, c, r) = hh_split(chosen, rejected)?;
    let p = enc.prompt_ids(prompt)?;
    Ok((
        format::join(p.clone(), enc.completion_ids(c)?),
        format::join(p, enc.completion_ids(r)?),
    ))
}

fn implicit_prompt_pair(
    enc: &Encoder,
    chosen: &Json,
    rejected: &Json,
    tools: Option<&Json>,
) -> RowResult<(Sequence, Sequence)> {
    let c = format::messages(chosen, "chosen")?;
    let r = format::messages(rejected, "rejected")?;
    let shared = c.iter().zip(&r).take_while(|(a, b)| a == b).count();
    if shared == 0 || shared == c.len() || shared == r.len() {
        return Err(format!(
            "\"chosen\" and \"rejected\" message lists without \"prompt\" must share leading prompt messages and then differ (they share {shared} of {} and {})",
            c.len(),
            r.len()
        ));
    }
    let prompt = &c[..shared];
    let (pc, ac) = enc.chat_prompt_answer(prompt, &c[shared..], tools)?;
    let (pr, ar) = enc.chat_prompt_answer(prompt, &r[shared..], tools)?;
    Ok((format::join(pc, ac), format::join(pr, ar)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hh_split_takes_the_last_shared_assistant_marker() {
        let c = "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: joke?\n\nAssistant: no";
        let r = "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: joke?\n\nAssistant: ok: ...";
        let (p, a, b) = hh_split(c, r).unwrap();
        assert!(p.ends_with("joke?\n\nAssistant:"));
        assert_eq!((a, b), (" no", " ok: ..."));
        // Diverging before the final turn: split at the last shared marker.
        let r2 = "\n\nHuman: hi\n\nAssistant: hey\n\nHuman: joke?\n\nAssistant: no";
        let (p, a, _) = hh_split(c, r2).unwrap();
        assert_eq!(p, "\n\nHuman: hi\n\nAssistant:");
        assert!(a.starts_with(" yo\n\nHuman"));
        assert!(hh_split("a", "b").is_err());
    }
}
