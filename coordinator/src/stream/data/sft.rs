//! SFT rows → one labelled [`Sequence`]. Shapes, detected by keys in this
//! order: pre-tokenized `input_ids` (+ optional aligned `labels`), chat
//! `messages`, ShareGPT `conversations`, `prompt` + `completion`,
//! `prompt` + `response`, GSM8K `question` + `answer`. Labelling follows
//! [`super::format`].

use serde_json::Value as Json;

use crate::stream::doc::Sequence;

use super::format::{self, keys, object, require_loss, Encoder, RowResult};

/// Builds the training sequence of one SFT row.
pub fn sft_row(enc: &Encoder, row: &Json) -> RowResult<Sequence> {
    let obj = object(row)?;
    let seq = if obj.contains_key("input_ids") {
        format::pretokenized(enc, obj, "input_ids", "labels")?
    } else if let Some(m) = obj.get("messages") {
        enc.chat(
            &format::messages(m, "messages")?,
            format::tools(obj)?.as_ref(),
        )?
    } else if obj.contains_key("conversations") {
        let msgs = format::sharegpt(obj, "conversations")?;
        enc.chat(&msgs, format::tools(obj)?.as_ref())?
    } else if let Some(answer_key) = ["completion", "response"]
        .into_iter()
        .find(|k| obj.contains_key(*k) && obj.contains_key("prompt"))
    {
        let tools = format::tools(obj)?;
        enc.prompt_answer(
            &obj["prompt"],
            &obj[answer_key],
            tools.as_ref(),
            ("prompt", answer_key),
        )?
    } else if obj.contains_key("question") && obj.contains_key("answer") {
        let q = format::string(obj, "question")?;
        let a = format::string(obj, "answer")?;
        format::join(enc.prompt_ids(q)?, enc.completion_ids(a)?)
    } else {
        return Err(format!(
            "no known sft row shape: expected \"messages\", \"conversations\", \"prompt\"+\"completion\", \"prompt\"+\"response\", \"question\"+\"answer\" or \"input_ids\"; found keys {}",
            keys(obj)
        ));
    };
    require_loss(seq, "the example")
}
