//! `data.format = "prompts"`: the RL loop's prompt files (issue 17). One
//! row is one prompt and the reference its verifier checks against:
//! - chat: `{"messages": [...]}` whose last turn is not the assistant's
//!   (the prompt, rendered with the generation prompt), the reference in
//!   `"reference"`/`"answer"`; or whose last turn is the assistant's, which
//!   is then the reference;
//! - GSM8K: `{"question", "answer"}` (the reference is the whole answer:
//!   the `gsm8k` verifier reads the number after `####`);
//! - plain: `{"prompt": str or messages, "reference"|"answer"|"completion"}`.
//!
//! A prompt's id is its `DocId` (file index, line), stable across restarts.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value as Json};

use crate::stream::data::error::{DataError, Result};
use crate::stream::data::format::{self, Encoder, RowResult};
use crate::stream::data::read;
use crate::stream::doc::DocId;

/// One prompt of the loop.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub id: DocId,
    /// What the worker continues (special tokens and template included).
    pub ids: Vec<u32>,
    /// The prompt as text (what a `command` verifier is given).
    pub text: String,
    pub reference: String,
    /// Rendered from chat messages by the chat template (a multi-turn
    /// episode's environment turns are then rendered by it too).
    pub chat: bool,
}

/// A job's prompts, in file order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PromptSet {
    pub prompts: Vec<Prompt>,
}

impl PromptSet {
    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }
}

/// Reads the prompt files (file `i` of `files` gets `DocId::file =
/// first_file + i`). `tools`: the tool definitions a chat row without
/// its own `"tools"` is rendered with (a multi-turn job's built-in tools).
pub fn load(
    enc: &Encoder,
    files: &[impl AsRef<Path>],
    first_file: u32,
    tools: Option<&Json>,
) -> Result<Arc<PromptSet>> {
    let mut prompts = Vec::new();
    for (f, path) in files.iter().enumerate() {
        let path = path.as_ref();
        for row in read::read_rows(path)? {
            let at = row.location(path);
            let value = row.value.as_ref().map_err(|message| DataError::Json {
                at: at.clone(),
                message: message.clone(),
            })?;
            let (ids, text, reference) = prompt_row(enc, value, tools).map_err(|reason| {
                // A tokenizer without a chat template is the job's error.
                match enc.template.check_needed() {
                    Err(e) => e,
                    Ok(()) => DataError::Row { at, reason },
                }
            })?;
            prompts.push(Prompt {
                id: DocId {
                    file: first_file + f as u32,
                    line: row.doc_line(),
                },
                ids,
                text,
                reference,
                chat: is_chat_row(value),
            });
        }
    }
    if prompts.is_empty() {
        return Err(DataError::NoDocuments {
            rows: 0,
            bad: 0,
            overlong: 0,
        });
    }
    Ok(Arc::new(PromptSet { prompts }))
}

/// Whether a (valid) prompt row is chat messages, which the template
/// renders, rather than text.
fn is_chat_row(row: &Json) -> bool {
    row.get("question").is_none()
        && (row.get("messages").is_some() || row.get("prompt").is_some_and(|p| !p.is_string()))
}

const REFERENCE_FIELDS: [&str; 3] = ["reference", "answer", "completion"];

fn reference(obj: &Map<String, Json>) -> RowResult<Option<String>> {
    for f in REFERENCE_FIELDS {
        if obj.contains_key(f) {
            return format::string(obj, f).map(|s| Some(s.to_string()));
        }
    }
    Ok(None)
}

/// (prompt ids, prompt text, reference) of one row. A chat row is
/// rendered with its own `"tools"` (a list of tool definitions, as
/// `apply_chat_template(tools=…)` takes them), else with `tools`.
pub fn prompt_row(
    enc: &Encoder,
    row: &Json,
    tools: Option<&Json>,
) -> RowResult<(Vec<u32>, String, String)> {
    let obj = format::object(row)?;
    let missing = || {
        format!(
            "a prompt row needs a reference answer (one of \"reference\", \"answer\", \"completion\"); keys: {}",
            format::keys(obj)
        )
    };
    if let Some(q) = obj.get("question") {
        let q = q
            .as_str()
            .ok_or("\"question\" must be a string".to_string())?;
        let r = format::string(obj, "answer")?;
        return Ok((enc.prompt_ids(q)?, q.to_string(), r.to_string()));
    }
    let (mut msgs, field) = match (obj.get("messages"), obj.get("prompt")) {
        (Some(m), _) => (format::messages(m, "messages")?, "messages"),
        (None, Some(Json::String(p))) => {
            let r = reference(obj)?.ok_or_else(missing)?;
            return Ok((enc.prompt_ids(p)?, p.clone(), r));
        }
        (None, Some(m)) => (format::messages(m, "prompt")?, "prompt"),
        (None, None) => {
            return Err(format!(
                "not a prompt row: expected \"messages\", \"prompt\" or \"question\"; keys: {}",
                format::keys(obj)
            ))
        }
    };
    let r = match reference(obj)? {
        Some(r) => r,
        None if msgs.last().is_some_and(|m| m["role"] == "assistant") => {
            let last = msgs.pop().expect("checked");
            last["content"].as_str().unwrap_or_default().to_string()
        }
        None => return Err(missing()),
    };
    if msgs.is_empty() {
        return Err(format!("\"{field}\" holds no prompt turn"));
    }
    let tools = match obj.get("tools") {
        None | Some(Json::Null) => tools,
        Some(t @ Json::Array(_)) => Some(t),
        Some(_) => return Err("\"tools\" must be a list of tool definitions".into()),
    };
    let text = enc.template.render(&msgs, tools, true)?;
    Ok((enc.tok.ids(&text, false)?, text, r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn enc() -> Encoder {
        let data: crate::job::data::DataSection =
            toml::from_str("format = \"prompts\"\ntrain = []").unwrap();
        crate::stream::data::encoder(&data, 300).unwrap()
    }

    fn prompt_row_plain(e: &Encoder, row: &Json) -> RowResult<(Vec<u32>, String, String)> {
        prompt_row(e, row, None)
    }

    /// A chat row is rendered with its own tools, else the job's; a text
    /// row never (no template renders it).
    #[test]
    fn chat_rows_render_tools() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("t.jinja");
        std::fs::write(
            &t,
            "{% if tools %}[tools]{% for x in tools %} {{ x.function.name }}{% endfor %}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
        )
        .unwrap();
        let data: crate::job::data::DataSection = toml::from_str(&format!(
            "format = \"prompts\"\ntrain = []\nchat_template = \"{}\"",
            t.display()
        ))
        .unwrap();
        let e = crate::stream::data::encoder(&data, 300).unwrap();
        let job_tools = json!([{"type": "function", "function": {"name": "calculator"}}]);
        let chat = json!({"messages": [{"role": "user", "content": "2*3"}], "reference": "6"});
        let (_, text, _) = prompt_row(&e, &chat, Some(&job_tools)).unwrap();
        // (The newline after a block tag is trimmed, as transformers'
        // template environment does.)
        assert_eq!(text, "[tools] calculator<|user|>2*3\n<|assistant|>");
        let (_, text, _) = prompt_row(&e, &chat, None).unwrap();
        assert_eq!(text, "<|user|>2*3\n<|assistant|>");
        let own = json!({"messages": [{"role": "user", "content": "x"}], "reference": "y",
            "tools": [{"type": "function", "function": {"name": "search"}}]});
        let (_, text, _) = prompt_row(&e, &own, Some(&job_tools)).unwrap();
        assert!(text.starts_with("[tools] search<|user|>"), "{text}");
        let bad =
            json!({"messages": [{"role": "user", "content": "x"}], "reference": "y", "tools": 3});
        let err = prompt_row(&e, &bad, None).unwrap_err();
        assert!(err.contains("\"tools\" must be a list"), "{err}");
        let text_row = json!({"prompt": "2*3=", "reference": "6"});
        let (_, text, _) = prompt_row(&e, &text_row, Some(&job_tools)).unwrap();
        assert_eq!(text, "2*3=");
    }

    #[test]
    fn the_three_shapes_read() {
        let e = enc();
        let (ids, text, r) =
            prompt_row_plain(&e, &json!({"prompt": "1+2=", "completion": "3"})).unwrap();
        assert_eq!((text.as_str(), r.as_str()), ("1+2=", "3"));
        assert_eq!(ids, e.prompt_ids("1+2=").unwrap());
        let (_, text, r) = prompt_row_plain(
            &e,
            &json!({"question": "How many?", "answer": "so\n#### 4"}),
        )
        .unwrap();
        assert_eq!((text.as_str(), r.as_str()), ("How many?", "so\n#### 4"));
        let chat = json!({"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]});
        let (ids, text, r) = prompt_row_plain(&e, &chat).unwrap();
        assert_eq!(r, "4");
        assert!(text.contains("2+2?") && !text.contains('4'), "{text:?}");
        assert_eq!(ids, e.tok.ids(&text, false).unwrap());
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "reference": "x"});
        assert_eq!(prompt_row_plain(&e, &chat).unwrap().2, "x");
    }

    #[test]
    fn bad_rows_name_the_problem_and_the_line() {
        let e = enc();
        let err = prompt_row_plain(&e, &json!({"prompt": "1+2="})).unwrap_err();
        assert!(err.contains("needs a reference answer"), "{err}");
        let err = prompt_row_plain(&e, &json!({"text": "x"})).unwrap_err();
        assert!(err.contains("not a prompt row"), "{err}");
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"a\", \"answer\": \"b\"}\n{\"prompt\": 3}\n",
        )
        .unwrap();
        let err = load(&e, &[&p], 0, None).unwrap_err().to_string();
        assert!(err.contains("p.jsonl:2"), "{err}");
        std::fs::write(&p, "{\"prompt\": \"a\", \"answer\": \"b\"}\n\n{\"question\": \"q\", \"answer\": \"#### 1\"}\n").unwrap();
        let set = load(&e, &[&p], 0, None).unwrap();
        let ids: Vec<DocId> = set.prompts.iter().map(|p| p.id).collect();
        assert_eq!(
            ids,
            [DocId { file: 0, line: 1 }, DocId { file: 0, line: 3 }]
        );
    }
}
