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
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja text (written into exported model folders).
    pub text: String,
    /// Where the template came from, for messages.
    pub source: String,
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

impl ChatTemplate {
    /// Compiles `text` with HF's Jinja settings, each render bounded by
    /// [`TEMPLATE_FUEL`].
    pub fn new(text: &str, source: impl Into<String>) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", text.to_string())
            .map_err(|e| format!("does not compile: {e:#}"))?;
        Ok(Self {
            env,
            text: text.to_string(),
            source: source.into(),
            bos_token: String::new(),
            eos_token: String::new(),
            pad_token: None,
            unk_token: None,
            missing: None,
            needed: Default::default(),
        })
    }

    /// Renders `messages` (JSON objects with at least `role` and `content`).
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        if let Some((_, looked)) = &self.missing {
            self.needed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(format!("no chat template ({looked})"));
        }
        let tmpl = self.env.get_template("chat").expect("added in new()");
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            pad_token => self.pad_token.as_deref(),
            unk_token => self.unk_token.as_deref(),
        };
        tmpl.render(ctx)
            .map_err(|e| format!("chat template ({}) failed: {e}", self.source))
    }
}

impl ChatTemplate {
    /// Whether the tokenizer has no template (see the type's docs).
    pub fn is_missing(&self) -> bool {
        self.missing.is_some()
    }

    /// The job error once a chat row needed the missing template.
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
    chat_template: Option<String>,
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
        chat_template: v.get("chat_template").and_then(template_field),
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

/// Finds and compiles the chat template for a dataset and the special
/// tokens the data stream appends (see the module docs for the order).
pub fn resolve(
    tokenizer: &Tokenizer,
    tokenizer_path: Option<&Path>,
    template_file: Option<&Path>,
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
    let jinja = tokenizer_path
        .map(|p| p.with_file_name(CHAT_TEMPLATE_FILE))
        .filter(|p| p.is_file());
    let (mut tmpl, builtin) = if let Some(f) = template_file.or(jinja.as_deref()) {
        let text = read_template_file(f)?;
        (
            compile(&text, f.display().to_string(), f.to_path_buf())?,
            false,
        )
    } else if let (Some(text), Some(p)) = (&cfg.chat_template, &cfg_path) {
        (compile(text, p.display().to_string(), p.clone())?, false)
    } else {
        let t = compile(
            BUILTIN_TEMPLATE,
            "built-in".into(),
            PathBuf::from("<built-in>"),
        )?;
        (t, true)
    };
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
        let (t, s) = resolve(&Tokenizer::Bytes, None, None).unwrap();
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
        let (builtin, _) = resolve(&Tokenizer::Bytes, None, None).unwrap();
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
}
