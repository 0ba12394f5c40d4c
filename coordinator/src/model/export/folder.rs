//! The tokenizer side of a model folder, from a job's data section: the
//! same tokenizer, chat template and special tokens the data stream used.
//!
//! A Hugging Face tokenizer's files are carried as the model had them, byte
//! for byte (issue 34): `tokenizer.json`, `tokenizer_config.json`,
//! `special_tokens_map.json` and `chat_template.jinja` where the source
//! folder has them, so its `bos_token`, `add_bos_token` and template survive
//! a checkpoint and an export, and its named templates
//! (`additional_chat_templates/NAME.jinja`). Only a template the model does not have — one
//! given as `data.chat_template` — is written, as `chat_template.jinja`
//! (which `AutoTokenizer` prefers to the config's). Files the source lacks are made (a minimal config, the special
//! tokens); `generation_config.json` is always made (the eos/bos ids).

use std::path::Path;

use serde_json::{json, Value};

use crate::job::data::DataSection;
use crate::stream::data::template::{named_template_files, CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE};
use crate::stream::data::{self, DataError};

/// The files [`tokenizer_files`] always makes, in the order written.
pub const TOKENIZER_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// The files it makes when the tokenizer has them (copied by `accrue
/// export` when present, never reported missing).
pub const OPTIONAL_TOKENIZER_FILES: [&str; 1] = [CHAT_TEMPLATE_FILE];

/// `(file name, bytes)` of the tokenizer files for `data`'s tokenizer.
pub fn tokenizer_files(data: &DataSection) -> Result<Vec<(String, Vec<u8>)>, DataError> {
    // The vocabulary bound only matters for pre-tokenized rows.
    let enc = data::encoder(data, u32::MAX)?;
    let t = &enc.template;
    let id = |token: &str| enc.tok.token_to_id(token);
    let pretty = |v: &Value| serde_json::to_vec_pretty(v).expect("json serializes");
    let specials = {
        let mut v = json!({
            "bos_token": t.bos_token,
            "eos_token": t.eos_token,
        });
        if let Some(p) = &t.pad_token {
            v["pad_token"] = p.clone().into();
        }
        v
    };
    let mut generation = json!({
        "eos_token_id": enc.eos_id,
        "do_sample": false,
    });
    if let Some(bos) = id(&t.bos_token) {
        generation["bos_token_id"] = bos.into();
    }
    if let Some(pad) = t.pad_token.as_deref().and_then(id) {
        generation["pad_token_id"] = pad.into();
    }
    if data.is_byte_tokenizer() {
        let mut config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": t.text,
            "bos_token": t.bos_token,
            "eos_token": t.eos_token,
            "clean_up_tokenization_spaces": false,
        });
        if let Some(p) = &t.pad_token {
            config["pad_token"] = p.clone().into();
        }
        let tokenizer_json = super::byte_tokenizer::tokenizer_json()
            .to_string()
            .into_bytes();
        return Ok(vec![
            (TOKENIZER_FILES[0].into(), tokenizer_json),
            (TOKENIZER_FILES[1].into(), pretty(&config)),
            (TOKENIZER_FILES[2].into(), pretty(&specials)),
            (TOKENIZER_FILES[3].into(), pretty(&generation)),
        ]);
    }
    let path = Path::new(&data.tokenizer);
    let read = |name: &str, what: &'static str, limit: u64| -> Result<Option<Vec<u8>>, DataError> {
        let p = path.with_file_name(name);
        if !p.is_file() {
            return Ok(None);
        }
        Ok(Some(crate::job::input::read(&p, limit, what)?))
    };
    let limit = crate::job::input::MAX_CONFIG_BYTES;
    let tokenizer_json =
        crate::job::input::read(path, crate::job::input::MAX_TOKENIZER_BYTES, "tokenizer")?;
    let source_config = read("tokenizer_config.json", "tokenizer config", limit)?;
    let config_template = match &source_config {
        Some(b) => {
            let v: Value = serde_json::from_slice(b).map_err(|e| DataError::Tokenizer {
                path: path.with_file_name("tokenizer_config.json"),
                message: format!("invalid json: {e}"),
            })?;
            !v["chat_template"].is_null()
        }
        None => false,
    };
    let config = match source_config {
        Some(b) => b,
        None => pretty(&json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": t.bos_token,
            "eos_token": t.eos_token,
            "clean_up_tokenization_spaces": false,
        })),
    };
    let special_map = match read("special_tokens_map.json", "special tokens map", limit)? {
        Some(b) => b,
        None => pretty(&specials),
    };
    let mut files = vec![
        (TOKENIZER_FILES[0].to_string(), tokenizer_json),
        (TOKENIZER_FILES[1].to_string(), config),
        (TOKENIZER_FILES[2].to_string(), special_map),
        (TOKENIZER_FILES[3].to_string(), pretty(&generation)),
    ];
    // The template the job trained with: the model's own file as it is; a
    // template the model does not carry (data.chat_template, or the
    // built-in fallback) written as chat_template.jinja.
    let own_jinja = read(CHAT_TEMPLATE_FILE, "chat template", limit)?;
    let jinja = match (&data.chat_template, own_jinja) {
        (Some(_), _) => Some(t.text.clone().into_bytes()),
        (None, Some(own)) => Some(own),
        // The model's config carries its template; a tokenizer with none
        // trained no chat, so no template is made up for it.
        (None, None) if config_template || t.is_missing() => None,
        // Only named templates (additional_chat_templates/): no default
        // to write.
        (None, None) if t.text.is_empty() => None,
        (None, None) => Some(t.text.clone().into_bytes()),
    };
    if let Some(j) = jinja {
        files.push((CHAT_TEMPLATE_FILE.to_string(), j));
    }
    // The model's named templates, as its folder has them.
    if data.chat_template.is_none() {
        let folder = path.parent().unwrap_or(Path::new("."));
        let named = named_template_files(folder).map_err(|e| {
            crate::job::input::InputError::io(&path.with_file_name(CHAT_TEMPLATE_DIR), e)
        })?;
        for p in named {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            let bytes = crate::job::input::read(&p, limit, "chat template")?;
            files.push((format!("{CHAT_TEMPLATE_DIR}/{name}"), bytes));
        }
    }
    Ok(files)
}

/// Writes `files` into `dir` (created if missing), each through a
/// temporary file and a rename so a reader never sees half a file.
pub fn write_tokenizer_files(dir: &Path, files: &[(String, Vec<u8>)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in files {
        let path = dir.join(name);
        let parent = path.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent)?;
        let file = path.file_name().unwrap_or_default().to_string_lossy();
        let tmp = parent.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(toml_text: &str) -> DataSection {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn the_byte_tokenizer_folder_names_its_specials_and_template() {
        let files = tokenizer_files(&data("train = [\"x.jsonl\"]\nformat = \"sft\"\n")).unwrap();
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, TOKENIZER_FILES);
        let get = |n: &str| -> Value {
            serde_json::from_slice(&files.iter().find(|(f, _)| f == n).unwrap().1).unwrap()
        };
        let cfg = get("tokenizer_config.json");
        assert_eq!(
            cfg["chat_template"],
            crate::stream::data::template::BUILTIN_TEMPLATE
        );
        assert_eq!(cfg["bos_token"], "<|bos|>");
        assert_eq!(cfg["eos_token"], "<|eos|>");
        let generation = get("generation_config.json");
        assert_eq!(generation["eos_token_id"], 257);
        assert_eq!(generation["bos_token_id"], 256);
        let tok = get("tokenizer.json");
        assert_eq!(tok["added_tokens"][1]["content"], "<|eos|>");
    }

    fn shared_tokenizer(name: &str) -> Option<std::path::PathBuf> {
        let dir = std::env::var("ACCRUE_SHARED_DATA").map_or_else(
            |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data"),
            std::path::PathBuf::from,
        );
        let dir = dir.join("tokenizers").join(name);
        if dir.join("tokenizer.json").is_file() {
            return Some(dir);
        }
        assert!(
            std::env::var("ACCRUE_REQUIRE_SHARED_DATA").as_deref() != Ok("1"),
            "{} is absent (shared data)",
            dir.display()
        );
        eprintln!("skipped: {} is absent (shared data)", dir.display());
        None
    }

    fn file<'a>(files: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    /// A template given as `data.chat_template` is what the job trained
    /// with: it is written as chat_template.jinja; the model's own files
    /// are carried unchanged.
    #[test]
    fn a_hf_tokenizer_is_copied_with_the_jobs_template() {
        let Some(shared) = shared_tokenizer("phi-3-mini") else {
            return;
        };
        let tmp = tempfile::tempdir().unwrap();
        let tpl = tmp.path().join("t.jinja");
        std::fs::write(&tpl, "{% for m in messages %}[{{ m.content }}]{% endfor %}").unwrap();
        let d = data(&format!(
            "train = [\"x.jsonl\"]\nformat = \"sft\"\ntokenizer = {:?}\nchat_template = {:?}\n",
            shared.join("tokenizer.json"),
            tpl
        ));
        let files = tokenizer_files(&d).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            let original = std::fs::read(shared.join(f)).unwrap();
            assert!(
                file(&files, f) == Some(&original[..]),
                "{f} is copied as is"
            );
        }
        assert_eq!(
            file(&files, CHAT_TEMPLATE_FILE),
            Some(&b"{% for m in messages %}[{{ m.content }}]{% endfor %}"[..])
        );
        let generation: Value =
            serde_json::from_slice(file(&files, "generation_config.json").unwrap()).unwrap();
        assert_eq!(generation["eos_token_id"], 32000);
        write_tokenizer_files(tmp.path(), &files).unwrap();
        for f in TOKENIZER_FILES.iter().chain(&OPTIONAL_TOKENIZER_FILES) {
            assert!(tmp.path().join(f).is_file(), "{f}");
        }
    }

    /// Issue 34: a folder as transformers' save_pretrained writes it today
    /// (the template in chat_template.jinja, the config without one, a
    /// bos_token the template does not use) came out of a checkpoint with
    /// the built-in template in its config and `"bos_token": ""`. Every
    /// file the model has is carried byte for byte now.
    #[test]
    fn the_models_own_files_survive_byte_for_byte() {
        let Some(shared) = shared_tokenizer("phi-3-mini") else {
            return;
        };
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::copy(shared.join("tokenizer.json"), model.join("tokenizer.json")).unwrap();
        let mut cfg: Value =
            serde_json::from_slice(&std::fs::read(shared.join("tokenizer_config.json")).unwrap())
                .unwrap();
        let template = cfg["chat_template"].as_str().unwrap().to_string();
        let obj = cfg.as_object_mut().unwrap();
        obj.remove("chat_template");
        obj.insert("add_bos_token".into(), false.into());
        let cfg_bytes = serde_json::to_vec_pretty(&cfg).unwrap();
        std::fs::write(model.join("tokenizer_config.json"), &cfg_bytes).unwrap();
        std::fs::write(model.join(CHAT_TEMPLATE_FILE), &template).unwrap();
        let special = br#"{"bos_token": "<s>", "eos_token": "<|endoftext|>"}"#;
        std::fs::write(model.join("special_tokens_map.json"), special).unwrap();
        std::fs::create_dir_all(model.join(CHAT_TEMPLATE_DIR)).unwrap();
        let tool_use = "{{ tools | tojson }}";
        std::fs::write(
            model.join(CHAT_TEMPLATE_DIR).join("tool_use.jinja"),
            tool_use,
        )
        .unwrap();
        let d = data(&format!(
            "train = [\"x.jsonl\"]\nformat = \"sft\"\ntokenizer = {:?}\n",
            model.join("tokenizer.json")
        ));
        let files = tokenizer_files(&d).unwrap();
        assert_eq!(file(&files, "tokenizer_config.json"), Some(&cfg_bytes[..]));
        assert_eq!(file(&files, CHAT_TEMPLATE_FILE), Some(template.as_bytes()));
        assert_eq!(file(&files, "special_tokens_map.json"), Some(&special[..]));
        let named = format!("{CHAT_TEMPLATE_DIR}/tool_use.jinja");
        assert_eq!(file(&files, &named), Some(tool_use.as_bytes()));
        let out = tmp.path().join("ckpt");
        write_tokenizer_files(&out, &files).unwrap();
        assert_eq!(
            std::fs::read(out.join(&named)).unwrap(),
            tool_use.as_bytes()
        );
        // The config's own template (the older layout) is carried in the
        // config, not doubled into a file.
        let d = data(&format!(
            "train = [\"x.jsonl\"]\nformat = \"sft\"\ntokenizer = {:?}\n",
            shared.join("tokenizer.json")
        ));
        let files = tokenizer_files(&d).unwrap();
        assert_eq!(file(&files, CHAT_TEMPLATE_FILE), None);
        let original = std::fs::read(shared.join("tokenizer_config.json")).unwrap();
        assert!(file(&files, "tokenizer_config.json") == Some(&original[..]));
    }

    /// A model with only named templates (no default) gets no made-up
    /// `chat_template.jinja`; its named ones are carried.
    #[test]
    fn only_named_templates_are_carried_and_no_default_is_made_up() {
        let Some(shared) = shared_tokenizer("phi-3-mini") else {
            return;
        };
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        std::fs::create_dir_all(model.join(CHAT_TEMPLATE_DIR)).unwrap();
        std::fs::copy(shared.join("tokenizer.json"), model.join("tokenizer.json")).unwrap();
        std::fs::write(
            model.join("tokenizer_config.json"),
            r#"{"eos_token": "<|endoftext|>", "tokenizer_class": "LlamaTokenizer"}"#,
        )
        .unwrap();
        std::fs::write(model.join(CHAT_TEMPLATE_DIR).join("rag.jinja"), "R").unwrap();
        let d = data(&format!(
            "train = [\"x.jsonl\"]\nformat = \"sft\"\ntokenizer = {:?}\n",
            model.join("tokenizer.json")
        ));
        let files = tokenizer_files(&d).unwrap();
        assert_eq!(file(&files, CHAT_TEMPLATE_FILE), None);
        assert_eq!(
            file(&files, &format!("{CHAT_TEMPLATE_DIR}/rag.jinja")),
            Some(&b"R"[..])
        );
    }
}
