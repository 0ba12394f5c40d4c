//! The tokenizer side of a model folder, from a job's data section: the
//! same tokenizer, chat template and special tokens the data stream used.

use std::path::Path;

use serde_json::{json, Value};

use crate::job::data::DataSection;
use crate::stream::data::{self, DataError};

/// The files [`tokenizer_files`] makes, in the order written.
pub const TOKENIZER_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// `(file name, bytes)` of the tokenizer files for `data`'s tokenizer.
pub fn tokenizer_files(data: &DataSection) -> Result<Vec<(String, Vec<u8>)>, DataError> {
    // The vocabulary bound only matters for pre-tokenized rows.
    let enc = data::encoder(data, u32::MAX)?;
    let t = &enc.template;
    let id = |token: &str| enc.tok.token_to_id(token);
    let (tokenizer_json, mut config) = if data.is_byte_tokenizer() {
        (
            super::byte_tokenizer::tokenizer_json()
                .to_string()
                .into_bytes(),
            json!({"tokenizer_class": "PreTrainedTokenizerFast"}),
        )
    } else {
        let path = Path::new(&data.tokenizer);
        let bytes =
            crate::job::input::read(path, crate::job::input::MAX_TOKENIZER_BYTES, "tokenizer")?;
        let cfg_path = path.with_file_name("tokenizer_config.json");
        // Read with the same bound as the data stream reads it.
        let cfg = if cfg_path.is_file() {
            let b = crate::job::input::read(
                &cfg_path,
                crate::job::input::MAX_CONFIG_BYTES,
                "tokenizer config",
            )?;
            serde_json::from_slice(&b).map_err(|e| DataError::Tokenizer {
                path: cfg_path.clone(),
                message: format!("invalid json: {e}"),
            })?
        } else {
            json!({"tokenizer_class": "PreTrainedTokenizerFast"})
        };
        (bytes, cfg)
    };
    let obj = config.as_object_mut().expect("an object");
    // The template the job trained with wins over the file's own (it may
    // come from data.chat_template or be the built-in one).
    obj.insert("chat_template".into(), t.text.clone().into());
    obj.insert("bos_token".into(), t.bos_token.clone().into());
    obj.insert("eos_token".into(), t.eos_token.clone().into());
    if let Some(p) = &t.pad_token {
        obj.insert("pad_token".into(), p.clone().into());
    }
    obj.entry("clean_up_tokenization_spaces")
        .or_insert(Value::Bool(false));
    let mut specials = json!({
        "bos_token": t.bos_token,
        "eos_token": t.eos_token,
    });
    if let Some(p) = &t.pad_token {
        specials["pad_token"] = p.clone().into();
    }
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
    let pretty = |v: &Value| serde_json::to_vec_pretty(v).expect("json serializes");
    Ok(vec![
        (TOKENIZER_FILES[0].into(), tokenizer_json),
        (TOKENIZER_FILES[1].into(), pretty(&config)),
        (TOKENIZER_FILES[2].into(), pretty(&specials)),
        (TOKENIZER_FILES[3].into(), pretty(&generation)),
    ])
}

/// Writes `files` into `dir` (created if missing), each through a
/// temporary file and a rename so a reader never sees half a file.
pub fn write_tokenizer_files(dir: &Path, files: &[(String, Vec<u8>)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, bytes) in files {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, dir.join(name))?;
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

    #[test]
    fn a_hf_tokenizer_is_copied_with_the_jobs_template() {
        let shared =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tokenizers/phi-3-mini");
        if !shared.join("tokenizer.json").is_file() {
            eprintln!("skipped: {} is absent (shared data)", shared.display());
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let tpl = tmp.path().join("t.jinja");
        std::fs::write(&tpl, "{% for m in messages %}[{{ m.content }}]{% endfor %}").unwrap();
        let d = data(&format!(
            "train = [\"x.jsonl\"]\nformat = \"sft\"\ntokenizer = {:?}\nchat_template = {:?}\n",
            shared.join("tokenizer.json"),
            tpl
        ));
        let files = tokenizer_files(&d).unwrap();
        let original = std::fs::read(shared.join("tokenizer.json")).unwrap();
        assert_eq!(files[0].1, original, "tokenizer.json is copied as is");
        let cfg: Value = serde_json::from_slice(&files[1].1).unwrap();
        assert_eq!(
            cfg["chat_template"],
            "{% for m in messages %}[{{ m.content }}]{% endfor %}"
        );
        assert_eq!(cfg["eos_token"], "<|endoftext|>");
        write_tokenizer_files(tmp.path(), &files).unwrap();
        for f in TOKENIZER_FILES {
            assert!(tmp.path().join(f).is_file(), "{f}");
        }
    }
}
