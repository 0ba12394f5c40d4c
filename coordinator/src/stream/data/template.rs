//! Chat templates: Jinja text rendered with minijinja the way
//! `transformers`' `apply_chat_template` does it (`trim_blocks`,
//! `lstrip_blocks`, loop controls, Python string/dict methods through
//! `minijinja-contrib`'s pycompat, `raise_exception`, and the variables
//! `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
//! `pad_token`, `unk_token`).
//!
//! Which template (first found wins):
//! 1. `data.chat_template`: a file holding the Jinja text, or a
//!    `tokenizer_config.json`-style JSON file whose `chat_template` is used;
//! 2. `chat_template.jinja` next to the `tokenizer.json` (where
//!    `transformers`' `save_pretrained` has written it since mid-2025; it
//!    overrides the config's, as `AutoTokenizer` reads it);
//! 3. `chat_template` in `tokenizer_config.json` next to the `tokenizer.json`
//!    (a string, or a list of `{name, template}` from which "default" is
//!    taken);
//! 4. for the byte tokenizer only, the built-in template [`BUILTIN_TEMPLATE`]:
//!    `{bos}<|user|>\n{text}\n<|assistant|>\n{text}{eos}<|user|>\n...`, i.e.
//!    every turn is `<|role|>\n` + content, followed by `\n` for non-assistant
//!    turns and by the EOS token for assistant turns (so the model learns to
//!    stop, and the loss span of a turn is its content plus EOS).
//!    `bos_token` there is `<|bos|>`. A Hugging Face tokenizer with no
//!    template gets none: a chat row fails the job
//!    ([`DataError::NoChatTemplate`], naming where it looked); rows that
//!    need no template (prompt/completion, pre-tokenized) still load.
//!
//! BOS/EOS: from `tokenizer_config.json` (`bos_token`, `eos_token`, each a
//! string or `{content}`); without one, EOS is the first of
//! [`EOS_FALLBACKS`] the tokenizer knows. The byte tokenizer uses `<|bos|>`
//! and `<|eos|>`.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use super::error::{DataError, Result};
use super::tokenize::{Tokenizer, BYTE_EOS};
use crate::job::input::{self, MAX_CONFIG_BYTES};

/// The built-in chat template (see the module docs).
/// Stands for the assistant's content in [`ChatTemplate::render_followup`]
/// (a private-use character no tokenizer or template produces).
const TURN_SENTINEL: &str = "\u{10FFFE}accrue-turn\u{10FFFE}";

pub const BUILTIN_TEMPLATE: &str = r#"{{ bos_token }}{% for message in messages %}{{ '<|' + message.role + '|>\n' + message.content }}{% if message.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"#;

/// The file `transformers` writes a tokenizer's chat template to, beside
/// `tokenizer.json`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// EOS token names tried, in order, when no `tokenizer_config.json` names one.
pub const EOS_FALLBACKS: &[&str] = &[
    "<|endoftext|>",
    "</s>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<eos>",
];

/// A compiled chat template with the special-token strings it renders.
/// For a Hugging Face tokenizer without a template it is [`Self::is_missing`]:
/// rendering fails, and the loaders turn the first such failure into a job
/// error naming where the template was looked for
/// ([`DataError::NoChatTemplate`]), never a skipped row.
///
/// A model may carry several named templates (a `chat_template` list in
/// `tokenizer_config.json`, `additional_chat_templates/NAME.jinja`); the one
/// rendered is chosen as `apply_chat_template` chooses it: the name the job
/// asks for (`data.chat_template_name`), else `tool_use` for a row with
/// tools when there is one, else `default`.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The default template's Jinja text (written into exported model
    /// folders when the model does not carry it).
    pub text: String,
    /// Where the template came from, for messages.
    pub source: String,
    /// The templates' names (`default` for a single one).
    names: Vec<String>,
    /// The name the job asked for.
    chosen: Option<String>,
    pub bos_token: String,
    pub eos_token: String,
    pub pad_token: Option<String>,
    unk_token: Option<String>,
    /// Where a template was looked for in vain (a tokenizer without one).
    missing: Option<(PathBuf, String)>,
    /// A chat row asked a missing template to render.
    needed: std::sync::atomic::AtomicBool,
}

/// Instructions one render may run (issue 33): a chat template comes with
/// the model, from the Hub, and one that loops for ever would hang
/// admission. Real templates use thousands per message; this stops a
/// runaway one within about a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// The special tokens the data stream appends itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Specials {
    pub eos_id: u32,
}

/// Where `{% generation %}` starts and ends in a render (private-use
/// characters: the blocks' text is cut out at them, see [`Rendered`]).
const GENERATION_START: char = '\u{10FFFD}';
const GENERATION_END: char = '\u{10FFFC}';

/// A rendered conversation, with the byte ranges of its `{% generation %}`
/// blocks (what `return_assistant_tokens_mask` marks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// `None` when the template marks no generation blocks.
    pub generation: Option<Vec<std::ops::Range<usize>>>,
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant
/// tracker, a jinja2 extension minijinja does not have) as blocks that
/// print a marker character, with the tags' own whitespace control:
/// `{%- generation %}` strips before, `{% endgeneration -%}` after, and
/// `trim_blocks`/`lstrip_blocks` apply as to any block tag.
fn rewrite_generation_tags(text: &str) -> (String, bool) {
    static TAG: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("valid regex")
    });
    let re = &*TAG;
    let mut marked = false;
    let out = re.replace_all(text, |c: &regex::Captures<'_>| {
        marked = true;
        let marker = if c.get(2).is_some() {
            GENERATION_END
        } else {
            GENERATION_START
        };
        format!(
            "{{%{} if true %}}{{{{ '{marker}' }}}}{{% endif {}%}}",
            &c[1], &c[3]
        )
    });
    (out.into_owned(), marked)
}

/// `tojson` as transformers defines it for templates: Python's
/// `json.dumps(x, ensure_ascii=False, indent=…, separators=…,
/// sort_keys=…)`, not minijinja's (compact, HTML-escaped): a tool schema
/// renders byte for byte as the model saw it.
fn py_tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json: Json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        json = sorted(json);
    }
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or("").to_string()),
        },
    };
    let (item, key) = match (&separators, &indent) {
        (Some(s), _) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        (_, Some(_)) => (",".to_string(), ": ".to_string()),
        (_, None) => (", ".to_string(), ": ".to_string()),
    };
    let mut out = Vec::new();
    let fmt = PyFormatter {
        item,
        key,
        indent,
        open: Vec::new(),
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(&json, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from(
        String::from_utf8(out).expect("serde_json writes utf-8"),
    ))
}

fn sorted(v: Json) -> Json {
    match v {
        Json::Object(m) => {
            let mut entries: Vec<(String, Json)> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Json::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Json::Array(a) => Json::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// Python `json.dumps` layout: `item` between elements, `key` after a key,
/// and with `indent` each element on its own line.
struct PyFormatter {
    item: String,
    key: String,
    indent: Option<String>,
    /// Whether each open container has an element yet.
    open: Vec<bool>,
}

impl PyFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.open.len() {
                w.write_all(ind.as_bytes())?;
            }
        }
        Ok(())
    }

    fn element<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item.as_bytes())?;
        }
        if let Some(top) = self.open.last_mut() {
            *top = true;
        }
        self.newline(w)
    }

    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        if self.open.pop() == Some(true) {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.element(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key.as_bytes())
    }
}

/// transformers' `_alias_reasoning_fields`: a message's reasoning under any
/// of its names is also passed as `thinking` (first) and
/// `reasoning_content` (last), the names templates read.
fn alias_reasoning(messages: &[Json]) -> Vec<Json> {
    const FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    messages
        .iter()
        .map(|m| {
            let Some(obj) = m.as_object() else {
                return m.clone();
            };
            let Some(r) = FIELDS
                .iter()
                .find_map(|k| obj.get(*k).filter(|v| !v.is_null()))
            else {
                return m.clone();
            };
            let mut out = serde_json::Map::new();
            out.insert("thinking".into(), r.clone());
            for (k, v) in obj {
                out.insert(k.clone(), v.clone());
            }
            out.insert("reasoning_content".into(), r.clone());
            Json::Object(out)
        })
        .collect()
}

impl ChatTemplate {
    /// Compiles `text` with HF's Jinja settings, each render bounded by
    /// [`TEMPLATE_FUEL`].
    pub fn new(text: &str, source: impl Into<String>) -> Result<Self, String> {
        Self::named(vec![("default".to_string(), text.to_string())], source)
    }

    /// Compiles named templates (one of them `default` unless the job
    /// names the one to use).
    pub fn named(
        templates: Vec<(String, String)>,
        source: impl Into<String>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| -> Result<Value, Error> {
            Ok(Value::from(
                chrono::Local::now().format(&format).to_string(),
            ))
        });
        env.add_filter("tojson", py_tojson);
        let mut names = Vec::new();
        let mut text = String::new();
        for (name, body) in templates {
            let (rewritten, _) = rewrite_generation_tags(&body);
            env.add_template_owned(name.clone(), rewritten)
                .map_err(|e| format!("template {name:?} does not compile: {e:#}"))?;
            if name == "default" {
                text = body;
            }
            names.push(name);
        }
        Ok(Self {
            env,
            text,
            source: source.into(),
            names,
            chosen: None,
            bos_token: String::new(),
            eos_token: String::new(),
            pad_token: None,
            unk_token: None,
            missing: None,
            needed: Default::default(),
        })
    }

    /// Uses the template named `name` for every row; an error names the
    /// templates there are.
    pub fn choose(&mut self, name: &str) -> Result<(), String> {
        if !self.names.iter().any(|n| n == name) {
            return Err(format!(
                "no chat template named {name:?} (the model has {:?})",
                self.names
            ));
        }
        self.chosen = Some(name.to_string());
        Ok(())
    }

    /// The template a row renders with (see the type's docs).
    fn pick(&self, tools: Option<&Json>) -> Result<&str, String> {
        if let Some(c) = &self.chosen {
            return Ok(c);
        }
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if tools.is_some() && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(format!(
                "chat template ({}): several templates and no default: name one with data.chat_template_name (there are {:?})",
                self.source, self.names
            ))
        }
    }

    /// Renders `messages` (JSON objects with at least `role` and `content`).
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        Ok(self
            .render_marked(messages, tools, add_generation_prompt)?
            .text)
    }

    /// The text the template puts after an assistant turn for the
    /// `messages` that follow it (a tool's results, a user's reply), up to
    /// and including the generation prompt of the next assistant turn:
    /// what an episode's tokens continue with after a policy turn (issue
    /// 36). The assistant's content is rendered as a sentinel and the text
    /// after it kept; `ended`: the policy sampled the end-of-turn token
    /// (`eos_token`) itself, so the template's own is left out.
    pub fn render_followup(&self, messages: &[Json], ended: bool) -> Result<String, String> {
        let mut msgs = vec![
            serde_json::json!({"role": "user", "content": "-"}),
            serde_json::json!({"role": "assistant", "content": TURN_SENTINEL}),
        ];
        msgs.extend(messages.iter().cloned());
        let text = self.render(&msgs, None, true)?;
        let at = text.rfind(TURN_SENTINEL).ok_or_else(|| {
            format!(
                "chat template ({}) does not render the assistant's content as given, so other messages cannot follow the policy's turn",
                self.source
            )
        })?;
        let tail = &text[at + TURN_SENTINEL.len()..];
        Ok(match tail.strip_prefix(self.eos_token.as_str()) {
            Some(rest) if ended && !self.eos_token.is_empty() => rest.to_string(),
            _ => tail.to_string(),
        })
    }

    /// [`Self::render`] with where the `{% generation %}` blocks are.
    pub fn render_marked(
        &self,
        messages: &[Json],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<Rendered, String> {
        if let Some((_, looked)) = &self.missing {
            self.needed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(format!("no chat template ({looked})"));
        }
        let name = self.pick(tools)?;
        let tmpl = self.env.get_template(name).expect("added in named()");
        let messages = alias_reasoning(messages);
        let ctx = minijinja::context! {
            messages => Value::from_serialize(&messages),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            pad_token => self.pad_token.as_deref(),
            unk_token => self.unk_token.as_deref(),
        };
        let raw = tmpl
            .render(ctx)
            .map_err(|e| format!("chat template ({}) failed: {e}", self.source))?;
        split_generation(raw, &self.source)
    }
}

/// Cuts the generation markers out of a render, keeping their ranges.
fn split_generation(raw: String, source: &str) -> Result<Rendered, String> {
    if !raw.contains([GENERATION_START, GENERATION_END]) {
        return Ok(Rendered {
            text: raw,
            generation: None,
        });
    }
    let mut text = String::with_capacity(raw.len());
    let mut spans = Vec::new();
    let mut open: Option<usize> = None;
    for c in raw.chars() {
        match c {
            GENERATION_START if open.is_none() => open = Some(text.len()),
            GENERATION_END if open.is_some() => {
                let s = open.take().expect("checked");
                if text.len() > s {
                    spans.push(s..text.len());
                }
            }
            GENERATION_START | GENERATION_END => {
                return Err(format!(
                    "chat template ({source}): unbalanced {{% generation %}} blocks, or a message holds U+10FFFC/U+10FFFD"
                ))
            }
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err(format!(
            "chat template ({source}): a {{% generation %}} block is not closed"
        ));
    }
    Ok(Rendered {
        text,
        generation: Some(spans),
    })
}

impl ChatTemplate {
    /// Whether the tokenizer has no template (see the type's docs).
    pub fn is_missing(&self) -> bool {
        self.missing.is_some()
    }

    /// The job error when the template is missing, needed or not yet (a
    /// served job's calls all need it).
    pub fn require(&self) -> Result<()> {
        self.needed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.check_needed()
    }

    /// The job's error when a row needed a template that is missing.
    pub fn check_needed(&self) -> Result<()> {
        match &self.missing {
            Some((tokenizer, looked)) if self.needed.load(std::sync::atomic::Ordering::Relaxed) => {
                Err(DataError::NoChatTemplate {
                    tokenizer: tokenizer.clone(),
                    looked: looked.clone(),
                })
            }
            _ => Ok(()),
        }
    }
}

/// What `tokenizer_config.json` says, as far as the data stream cares.
#[derive(Debug, Default)]
struct TokenizerConfig {
    /// `(name, template)`: one `default` for a string, every entry of a list.
    chat_templates: Vec<(String, String)>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    add_bos_token: bool,
}

fn token_field(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// The `chat_template` of a config: a string, or the "default" entry of a
/// list of `{name, template}`.
fn template_field(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_string),
        _ => None,
    }
}

fn read_config(path: &Path) -> Result<TokenizerConfig> {
    let err = |message: String| DataError::Tokenizer {
        path: path.to_path_buf(),
        message,
    };
    let text = input::read_to_string(path, MAX_CONFIG_BYTES, "tokenizer config")?;
    let v: Json = serde_json::from_str(&text).map_err(|e| err(format!("invalid json: {e}")))?;
    let field = |k: &str| v.get(k).and_then(token_field);
    Ok(TokenizerConfig {
        chat_templates: match v.get("chat_template") {
            Some(Json::String(t)) => vec![("default".into(), t.clone())],
            Some(Json::Array(list)) => list
                .iter()
                .filter_map(|t| {
                    Some((
                        t.get("name")?.as_str()?.to_string(),
                        t.get("template")?.as_str()?.to_string(),
                    ))
                })
                .collect(),
            _ => Vec::new(),
        },
        bos_token: field("bos_token"),
        eos_token: field("eos_token"),
        pad_token: field("pad_token"),
        unk_token: field("unk_token"),
        add_bos_token: v.get("add_bos_token").and_then(Json::as_bool) == Some(true),
    })
}

/// Reads a `data.chat_template` file: Jinja text, or JSON with a
/// `chat_template` field.
fn read_template_file(path: &Path) -> Result<String> {
    let err = |message: String| DataError::Template {
        path: path.to_path_buf(),
        message,
    };
    let text = input::read_to_string(path, MAX_CONFIG_BYTES, "chat template")?;
    if path.extension().is_some_and(|e| e == "json") {
        let v: Json = serde_json::from_str(&text).map_err(|e| err(format!("invalid json: {e}")))?;
        return v
            .get("chat_template")
            .and_then(template_field)
            .ok_or_else(|| {
                err("json file has no chat_template string (or \"default\" entry)".into())
            });
    }
    Ok(text)
}

/// The folder `transformers` keeps a model's named templates in, beside
/// `tokenizer.json` (`NAME.jinja`).
pub const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";

/// The named template files of the model folder `folder`
/// (`additional_chat_templates/NAME.jinja`), sorted; none without the
/// directory. The one listing the data stream, the token cache's key, the
/// checkpoint's tokenizer files and `accrue export` share.
pub fn named_template_files(folder: &Path) -> std::io::Result<Vec<PathBuf>> {
    let dir = folder.join(CHAT_TEMPLATE_DIR);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        if p.is_file() && p.extension().is_some_and(|x| x == "jinja") {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// The folder a tokenizer file sits in.
fn folder_of(tokenizer: &Path) -> &Path {
    tokenizer.parent().unwrap_or(Path::new("."))
}

/// Templates a model carries beside its tokenizer, by name, as
/// `AutoTokenizer` assembles them: the config's (a string is `default`),
/// `chat_template.jinja` as `default` over it, and every
/// `additional_chat_templates/NAME.jinja`; and where they came from.
fn model_templates(
    tokenizer_path: Option<&Path>,
    from_config: Vec<(String, String)>,
    cfg_path: &Option<PathBuf>,
) -> Result<(Vec<(String, String)>, String)> {
    let mut named = from_config;
    let mut source = cfg_path
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let Some(tok) = tokenizer_path else {
        return Ok((named, source));
    };
    let set = |named: &mut Vec<(String, String)>, name: String, text: String| match named
        .iter_mut()
        .find(|(n, _)| *n == name)
    {
        Some(slot) => slot.1 = text,
        None => named.push((name, text)),
    };
    let jinja = tok.with_file_name(CHAT_TEMPLATE_FILE);
    if jinja.is_file() {
        let text = input::read_to_string(&jinja, MAX_CONFIG_BYTES, "chat template")?;
        set(&mut named, "default".into(), text);
        source = jinja.display().to_string();
    }
    let dir = tok.with_file_name(CHAT_TEMPLATE_DIR);
    let files = named_template_files(folder_of(tok)).map_err(|e| input::InputError::io(&dir, e))?;
    for f in &files {
        let name = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = input::read_to_string(f, MAX_CONFIG_BYTES, "chat template")?;
        set(&mut named, name, text);
    }
    if source.is_empty() && !files.is_empty() {
        source = dir.display().to_string();
    }
    Ok((named, source))
}

/// Finds and compiles the chat template for a dataset and the special
/// tokens the data stream appends (see the module docs for the order).
pub fn resolve(
    tokenizer: &Tokenizer,
    tokenizer_path: Option<&Path>,
    template_file: Option<&Path>,
    template_name: Option<&str>,
) -> Result<(ChatTemplate, Specials)> {
    let config = match tokenizer_path {
        Some(p) => {
            let cfg = p.with_file_name("tokenizer_config.json");
            if cfg.is_file() {
                Some((read_config(&cfg)?, cfg))
            } else {
                None
            }
        }
        None => None,
    };
    let (cfg, cfg_path) = match config {
        Some((c, p)) => (c, Some(p)),
        None => (TokenizerConfig::default(), None),
    };
    let compile = |text: &str, source: String, path: PathBuf| {
        ChatTemplate::new(text, source).map_err(|message| DataError::Template { path, message })
    };
    let is_bytes = matches!(tokenizer, Tokenizer::Bytes);
    let (mut tmpl, builtin) = if let Some(f) = template_file {
        let text = read_template_file(f)?;
        (
            compile(&text, f.display().to_string(), f.to_path_buf())?,
            false,
        )
    } else {
        let (named, source) =
            model_templates(tokenizer_path, cfg.chat_templates.clone(), &cfg_path)?;
        if named.is_empty() {
            let t = compile(
                BUILTIN_TEMPLATE,
                "built-in".into(),
                PathBuf::from("<built-in>"),
            )?;
            (t, true)
        } else {
            let path = PathBuf::from(&source);
            let t = ChatTemplate::named(named, source)
                .map_err(|message| DataError::Template { path, message })?;
            (t, false)
        }
    };
    if let Some(name) = template_name {
        tmpl.choose(name).map_err(|message| DataError::Template {
            path: PathBuf::from(&tmpl.source),
            message,
        })?;
    }
    if is_bytes {
        tmpl.bos_token = "<|bos|>".into();
        tmpl.eos_token = "<|eos|>".into();
        return Ok((tmpl, Specials { eos_id: BYTE_EOS }));
    }
    let tok_path = tokenizer_path.map_or_else(PathBuf::new, Path::to_path_buf);
    if builtin {
        // The built-in template is the byte tokenizer's: a model's chats
        // rendered with it would train another format than the model's.
        let cfg_where = match &cfg_path {
            Some(p) => format!("no chat_template in {}", p.display()),
            None => format!(
                "no {} beside it",
                tok_path.with_file_name("tokenizer_config.json").display()
            ),
        };
        let looked = format!(
            "no {} beside the tokenizer, {cfg_where}, and no data.chat_template",
            tok_path.with_file_name(CHAT_TEMPLATE_FILE).display()
        );
        tmpl.missing = Some((tok_path.clone(), looked));
    }
    let eos_token = match &cfg.eos_token {
        Some(e) => e.clone(),
        None => EOS_FALLBACKS
            .iter()
            .find(|t| tokenizer.token_to_id(t).is_some())
            .map(|t| t.to_string())
            .ok_or_else(|| DataError::Tokenizer {
                path: tok_path.clone(),
                message: format!(
                    "no eos token: no tokenizer_config.json with eos_token next to it, and none of {EOS_FALLBACKS:?} is in the vocabulary"
                ),
            })?,
    };
    let eos_id = tokenizer
        .token_to_id(&eos_token)
        .ok_or_else(|| DataError::Tokenizer {
            path: tok_path.clone(),
            message: format!("eos token {eos_token:?} is not in the vocabulary"),
        })?;
    tmpl.bos_token = match (&cfg.bos_token, builtin) {
        (Some(b), false) => b.clone(),
        (Some(b), true) if cfg.add_bos_token => b.clone(),
        _ => String::new(),
    };
    tmpl.eos_token = eos_token;
    tmpl.pad_token = cfg.pad_token;
    tmpl.unk_token = cfg.unk_token;
    Ok((tmpl, Specials { eos_id }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msgs() -> Vec<Json> {
        vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "2+2?"}),
            json!({"role": "assistant", "content": "4"}),
        ]
    }

    #[test]
    fn builtin_template_renders_turns_and_eos() {
        let (t, s) = resolve(&Tokenizer::Bytes, None, None, None).unwrap();
        assert_eq!(s.eos_id, BYTE_EOS);
        let out = t.render(&msgs(), None, false).unwrap();
        assert_eq!(
            out,
            "<|bos|><|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4<|eos|>"
        );
        let gen = t.render(&msgs()[..2], None, true).unwrap();
        assert!(out.starts_with(&gen), "{gen:?}");
    }

    /// Issue 33 (11): chat templates ran without a fuel limit; one that
    /// loops (here 10^8 iterations) hung admission. It now fails, naming
    /// its source, within a few seconds.
    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let text =
            "{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}x";
        let t = ChatTemplate::new(text, "models--org--loop").unwrap();
        let started = std::time::Instant::now();
        let e = t.render(&msgs(), None, false).unwrap_err();
        assert!(e.contains("models--org--loop"), "{e}");
        assert!(e.contains("fuel"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        // A real template's conversation is far from the limit.
        let long: Vec<Json> = (0..2000)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "x"}))
            .collect();
        let (builtin, _) = resolve(&Tokenizer::Bytes, None, None, None).unwrap();
        assert!(builtin.render(&long, None, false).is_ok());
    }

    #[test]
    fn hf_style_template_with_python_methods_and_raise() {
        let text = "{% for m in messages %}{% if m['role'] not in ['user','assistant','system'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n{{ m['content'].strip().upper() }}|\n{% endfor %}";
        let t = ChatTemplate::new(text, "test").unwrap();
        let m = vec![json!({"role": "user", "content": "  hi "})];
        // trim_blocks drops the newline after `endif`, not the one before `endfor`.
        assert_eq!(t.render(&m, None, false).unwrap(), "HI|\n");
        let bad = vec![json!({"role": "robot", "content": "x"})];
        let e = t.render(&bad, None, false).unwrap_err();
        assert!(e.contains("bad role robot"), "{e}");
    }

    #[test]
    fn template_list_takes_default() {
        let v =
            json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(template_field(&v).as_deref(), Some("D"));
        assert_eq!(
            token_field(&json!({"content": "<s>"})).as_deref(),
            Some("<s>")
        );
    }

    /// `tojson` writes what Python's `json.dumps` writes (transformers'
    /// filter): `", "`/`": "` separators, key order kept, no HTML escaping,
    /// non-ASCII as is; with `indent`, one element per line.
    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ messages[0].x | tojson }}|{{ messages[0].x | tojson(indent=2) }}|{{ messages[0].x | tojson(sort_keys=true, separators=(',', ':')) }}",
            "test",
        )
        .unwrap();
        let m =
            vec![json!({"role": "user", "x": {"z": [1, 2.5, "<é>"], "a": {}, "b": [], "c": null}})];
        assert_eq!(
            t.render(&m, None, false).unwrap(),
            "{\"z\": [1, 2.5, \"<é>\"], \"a\": {}, \"b\": [], \"c\": null}|{\n  \"z\": [\n    1,\n    2.5,\n    \"<é>\"\n  ],\n  \"a\": {},\n  \"b\": [],\n  \"c\": null\n}|{\"a\":{},\"b\":[],\"c\":null,\"z\":[1,2.5,\"<é>\"]}"
        );
    }

    /// `{% generation %}` blocks render as transformers renders them (their
    /// tags' whitespace control and trim_blocks included) and give the
    /// blocks' byte ranges.
    #[test]
    fn generation_blocks_render_and_mark_their_text() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>\n{% if m.role == 'assistant' %}  {%- generation %}\n{{ m.content }}!{% endgeneration -%}\n\n{% else %}{{ m.content }};{% endif %}{% endfor %}",
            "test",
        )
        .unwrap();
        let r = t.render_marked(&msgs()[1..], None, false).unwrap();
        assert_eq!(r.text, "<user>\n2+2?;<assistant>\n4!");
        let want: Vec<std::ops::Range<usize>> = std::iter::once(24..26).collect();
        assert_eq!(r.generation, Some(want));
        assert_eq!(&r.text[24..26], "4!");
        let plain = ChatTemplate::new("{{ messages[0].content }}", "t").unwrap();
        assert_eq!(
            plain
                .render_marked(&msgs(), None, false)
                .unwrap()
                .generation,
            None
        );
    }

    /// Named templates: `tool_use` for a row with tools, `default`
    /// otherwise, or the one the job names; an unknown name lists the
    /// names there are.
    #[test]
    fn named_templates_are_chosen_as_transformers_chooses() {
        let mut t = ChatTemplate::named(
            vec![
                ("default".into(), "D".into()),
                ("tool_use".into(), "T".into()),
            ],
            "test",
        )
        .unwrap();
        assert_eq!(t.render(&msgs(), None, false).unwrap(), "D");
        assert_eq!(t.render(&msgs(), Some(&json!([])), false).unwrap(), "T");
        t.choose("default").unwrap();
        assert_eq!(t.render(&msgs(), Some(&json!([])), false).unwrap(), "D");
        let e = t.choose("rag").unwrap_err();
        assert!(e.contains("\"rag\"") && e.contains("tool_use"), "{e}");
        let only = ChatTemplate::named(vec![("rag".into(), "R".into())], "test").unwrap();
        let e = only.render(&msgs(), None, false).unwrap_err();
        assert!(e.contains("data.chat_template_name"), "{e}");
    }

    /// A message's reasoning reaches the template under `thinking` and
    /// `reasoning_content`, whichever name the row used.
    #[test]
    fn reasoning_is_aliased_as_transformers_does() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.thinking }}/{{ m.reasoning_content }}{% endfor %}",
            "t",
        )
        .unwrap();
        let m = vec![json!({"role": "assistant", "content": "6", "reasoning": "r"})];
        assert_eq!(t.render(&m, None, false).unwrap(), "r/r");
    }
}
