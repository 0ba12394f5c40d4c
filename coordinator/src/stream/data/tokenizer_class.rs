//! The tokenizer pipeline `transformers` actually runs for a
//! `tokenizer.json`.
//!
//! Since transformers 5, `AutoTokenizer` does not run a `tokenizer.json` as
//! written when `tokenizer_config.json` names a tokenizer class with its own
//! pipeline (`tokenizer_class: "LlamaTokenizer"`, `"GemmaTokenizer"`, …): it
//! takes the file's vocabulary and merges and rebuilds the normalizer,
//! pre-tokenizer and decoder as that class defines them, from the config's
//! `legacy` and `add_prefix_space`. Files converted from SentencePiece before
//! that carry the legacy pipeline (a `Prepend("▁")` normalizer, applied to
//! every segment between special tokens), so the same chat gives other ids:
//! phi-3-mini's two-turn chat is 33 ids read as written, 31 as transformers
//! reads it (no `▁` after `<|end|>`). Training on ids the model's own
//! tokenizer never makes is a silent quality bug, so the data stream applies
//! the same rebuild for the classes the models Accrue trains use.
//!
//! Classes that run the file as written (`PreTrainedTokenizerFast`,
//! `TokenizersBackend`, no class) are left alone. Another class with its own
//! pipeline is run as written and logged once: its ids may differ from
//! transformers' (`accrue data show` prints them).

use serde_json::{json, Value as Json};

/// What of `tokenizer_config.json` decides the pipeline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassConfig {
    pub tokenizer_class: Option<String>,
    pub legacy: Option<bool>,
    pub add_prefix_space: Option<bool>,
}

impl ClassConfig {
    pub fn from_config(cfg: &Json) -> ClassConfig {
        ClassConfig {
            tokenizer_class: cfg
                .get("tokenizer_class")
                .and_then(Json::as_str)
                .map(str::to_string),
            legacy: cfg.get("legacy").and_then(Json::as_bool),
            add_prefix_space: cfg.get("add_prefix_space").and_then(Json::as_bool),
        }
    }
}

/// How a class's pipeline relates to its `tokenizer.json`.
#[derive(Debug, Clone, PartialEq)]
pub enum Rebuild {
    /// The file runs as written.
    AsWritten,
    /// transformers replaces these parts of the file (`normalizer`,
    /// `pre_tokenizer`, `decoder`, `post_processor`; `null` removes one).
    Replace(Vec<(&'static str, Json)>),
    /// A class with its own pipeline that is not reproduced here.
    Unknown(String),
}

fn metaspace_decoder(strip: bool) -> Json {
    let mut steps = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if strip {
        steps.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({"type": "Sequence", "decoders": steps})
}

fn byte_level(add_prefix_space: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": true})
}

/// Qwen2's pre-tokenizer split (transformers' `PRETOKENIZE_REGEX`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pipeline transformers builds for `cfg`'s class (the classes'
/// `__init__` in transformers 5: `models/*/tokenization_*.py`).
pub fn rebuild(cfg: &ClassConfig) -> Rebuild {
    let Some(class) = cfg.tokenizer_class.as_deref() else {
        return Rebuild::AsWritten;
    };
    let class = class.strip_suffix("Fast").unwrap_or(class);
    match class {
        "PreTrainedTokenizer" | "PreTrainedTokenizerFast" | "TokenizersBackend" => {
            Rebuild::AsWritten
        }
        "LlamaTokenizer" => {
            let prefix = cfg.add_prefix_space.unwrap_or(true);
            // transformers' `_get_prepend_scheme`; the class's `legacy`
            // defaults to false.
            let scheme = match (prefix, cfg.legacy.unwrap_or(false)) {
                (false, _) => "never",
                (true, true) => "always",
                (true, false) => "first",
            };
            Rebuild::Replace(vec![
                ("normalizer", Json::Null),
                (
                    "pre_tokenizer",
                    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": false}),
                ),
                ("decoder", metaspace_decoder(prefix)),
            ])
        }
        "GemmaTokenizer" => Rebuild::Replace(vec![
            (
                "normalizer",
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}),
            ),
            (
                "pre_tokenizer",
                json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
            ),
            ("decoder", metaspace_decoder(false)),
        ]),
        "Qwen2Tokenizer" => Rebuild::Replace(vec![
            ("normalizer", json!({"type": "NFC"})),
            (
                "pre_tokenizer",
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": cfg.add_prefix_space.unwrap_or(false), "trim_offsets": true, "use_regex": false}
                ]}),
            ),
            ("decoder", byte_level(true)),
        ]),
        "GPT2Tokenizer" | "CodeGenTokenizer" => Rebuild::Replace(vec![
            (
                "pre_tokenizer",
                byte_level(cfg.add_prefix_space.unwrap_or(false)),
            ),
            ("decoder", byte_level(true)),
        ]),
        "GPTNeoXTokenizer" => Rebuild::Replace(vec![
            ("normalizer", json!({"type": "NFC"})),
            (
                "pre_tokenizer",
                byte_level(cfg.add_prefix_space.unwrap_or(false)),
            ),
            ("decoder", byte_level(true)),
        ]),
        other => Rebuild::Unknown(other.to_string()),
    }
}

/// `tokenizer.json` with the parts `parts` replaced.
pub fn apply(file: &mut Json, parts: &[(&'static str, Json)]) {
    if let Some(obj) = file.as_object_mut() {
        for (key, value) in parts {
            obj.insert((*key).to_string(), value.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(class: &str, legacy: Option<bool>, prefix: Option<bool>) -> ClassConfig {
        ClassConfig {
            tokenizer_class: Some(class.into()),
            legacy,
            add_prefix_space: prefix,
        }
    }

    fn pre(r: &Rebuild) -> &Json {
        match r {
            Rebuild::Replace(parts) => {
                &parts.iter().find(|(k, _)| *k == "pre_tokenizer").unwrap().1
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn llama_prepend_scheme_follows_legacy_and_prefix_space() {
        let scheme = |c| pre(&rebuild(&c))["prepend_scheme"].clone();
        assert_eq!(scheme(cfg("LlamaTokenizerFast", None, None)), "first");
        assert_eq!(scheme(cfg("LlamaTokenizer", Some(true), None)), "always");
        assert_eq!(
            scheme(cfg("LlamaTokenizer", Some(false), Some(false))),
            "never"
        );
        assert_eq!(rebuild(&ClassConfig::default()), Rebuild::AsWritten);
        assert_eq!(
            rebuild(&cfg("PreTrainedTokenizerFast", None, None)),
            Rebuild::AsWritten
        );
        assert_eq!(
            rebuild(&cfg("T5Tokenizer", None, None)),
            Rebuild::Unknown("T5Tokenizer".into())
        );
    }
}
