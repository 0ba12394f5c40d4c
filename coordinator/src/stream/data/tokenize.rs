//! Tokenizers: the built-in byte tokenizer and Hugging Face `tokenizer.json`
//! files (the `tokenizers` crate).
//!
//! Byte tokenizer (`data.tokenizer = "bytes"`): ids 0..=255 are the bytes of
//! the UTF-8 text, 256 = BOS, 257 = EOS, 258 = PAD, vocab size 259. Like a
//! HF tokenizer it recognises its special tokens in text: the literal
//! strings `<|bos|>`, `<|eos|>` and `<|pad|>` become ids 256..=258 (that is
//! how the built-in chat template places BOS and EOS). With
//! `add_special_tokens` it prepends BOS, the way Llama's post-processor does.
//!
//! HF tokenizers: run as transformers 5 runs them (the pipeline of the
//! config's `tokenizer_class`, [`super::tokenizer_class`]), loaded with
//! truncation and padding switched off (a
//! `tokenizer.json` may carry either, and the data stream never truncates).
//! `add_special_tokens` runs the file's own post-processor; BOS and EOS ids
//! come from `tokenizer_config.json` (see [`super::template`]).

use std::ops::Range;
use std::path::Path;

use super::error::{DataError, Result};
use super::tokenizer_class::{self, ClassConfig, Rebuild};

pub const BYTE_BOS: u32 = 256;
pub const BYTE_EOS: u32 = 257;
pub const BYTE_PAD: u32 = 258;
pub const BYTE_VOCAB: u32 = 259;
const BYTE_SPECIALS: [(&str, u32); 3] = [
    ("<|bos|>", BYTE_BOS),
    ("<|eos|>", BYTE_EOS),
    ("<|pad|>", BYTE_PAD),
];

/// A loaded tokenizer.
pub enum Tokenizer {
    Bytes,
    Hf(Box<tokenizers::Tokenizer>),
}

/// Token ids with their byte ranges in the encoded text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub offsets: Vec<Range<usize>>,
}

impl Tokenizer {
    /// Loads a HF `tokenizer.json` as transformers runs it: with the
    /// pipeline of the `tokenizer_class` named in `tokenizer_config.json`
    /// beside it (see [`super::tokenizer_class`]).
    pub fn from_file(path: &Path) -> Result<Self> {
        let err = |message: String| DataError::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        let bytes =
            crate::job::input::read(path, crate::job::input::MAX_TOKENIZER_BYTES, "tokenizer")?;
        let config = path.with_file_name("tokenizer_config.json");
        let class = if config.is_file() {
            let text = crate::job::input::read(
                &config,
                crate::job::input::MAX_CONFIG_BYTES,
                "tokenizer config",
            )?;
            let v: serde_json::Value =
                serde_json::from_slice(&text).map_err(|e| DataError::Tokenizer {
                    path: config.clone(),
                    message: format!("invalid json: {e}"),
                })?;
            ClassConfig::from_config(&v)
        } else {
            ClassConfig::default()
        };
        let bytes = match tokenizer_class::rebuild(&class) {
            Rebuild::AsWritten => bytes,
            Rebuild::Replace(parts) => {
                let mut file: serde_json::Value = serde_json::from_slice(&bytes)
                    .map_err(|e| err(format!("invalid json: {e}")))?;
                tokenizer_class::apply(&mut file, &parts);
                serde_json::to_vec(&file).map_err(|e| err(e.to_string()))?
            }
            Rebuild::Unknown(name) => {
                tracing::warn!(
                    tokenizer = %path.display(),
                    "tokenizer_class {name}: transformers rebuilds this class's pipeline and Accrue runs tokenizer.json as written; its ids may differ from transformers' (check with `accrue data show`)"
                );
                bytes
            }
        };
        let mut tok = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| err(e.to_string()))?;
        tok.with_truncation(None)
            .map_err(|e| err(format!("cannot disable truncation: {e}")))?;
        tok.with_padding(None);
        Ok(Tokenizer::Hf(Box::new(tok)))
    }

    /// Number of ids the model's embedding must hold, added tokens included.
    pub fn vocab_size(&self) -> u32 {
        match self {
            Tokenizer::Bytes => BYTE_VOCAB,
            Tokenizer::Hf(t) => {
                let max_added = t
                    .get_added_tokens_decoder()
                    .keys()
                    .map(|&id| id + 1)
                    .max()
                    .unwrap_or(0);
                (t.get_vocab_size(true) as u32).max(max_added)
            }
        }
    }

    /// The id of a token string (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes => BYTE_SPECIALS
                .iter()
                .find(|(s, _)| *s == token)
                .map(|&(_, id)| id),
            Tokenizer::Hf(t) => t.token_to_id(token),
        }
    }

    /// Token ids of `text`.
    pub fn ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Bytes => Ok(byte_encode(text, add_special_tokens).ids),
            Tokenizer::Hf(t) => t
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| format!("tokenizer failed: {e}")),
        }
    }

    /// The text of `ids`, special tokens left out (a generated
    /// completion as a verifier reads it).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| format!("tokenizer failed to decode: {e}")),
        }
    }

    /// The text of `ids` with their special tokens spelled out (what a
    /// document shows as trained: `accrue data show`).
    pub fn decode_all(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Tokenizer::Bytes => {
                let mut bytes = Vec::new();
                for &t in ids {
                    match t {
                        0..=255 => bytes.push(t as u8),
                        BYTE_BOS => bytes.extend_from_slice(b"<|bos|>"),
                        BYTE_EOS => bytes.extend_from_slice(b"<|eos|>"),
                        _ => bytes.extend_from_slice(format!("<|{t}|>").as_bytes()),
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| format!("tokenizer failed to decode: {e}")),
        }
    }

    /// Token ids of `text` with each token's byte range in `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Encoded, String> {
        match self {
            Tokenizer::Bytes => Ok(byte_encode(text, add_special_tokens)),
            Tokenizer::Hf(t) => {
                let e = t
                    .encode(text, add_special_tokens)
                    .map_err(|e| format!("tokenizer failed: {e}"))?;
                Ok(Encoded {
                    ids: e.get_ids().to_vec(),
                    offsets: e.get_offsets().iter().map(|&(a, b)| a..b).collect(),
                })
            }
        }
    }
}

fn byte_encode(text: &str, add_bos: bool) -> Encoded {
    let mut out = Encoded::default();
    if add_bos {
        out.ids.push(BYTE_BOS);
        out.offsets.push(0..0);
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let special = (bytes[i] == b'<')
            .then(|| {
                BYTE_SPECIALS
                    .iter()
                    .find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
            })
            .flatten();
        if let Some(&(s, id)) = special {
            out.ids.push(id);
            out.offsets.push(i..i + s.len());
            i += s.len();
        } else {
            out.ids.push(u32::from(bytes[i]));
            out.offsets.push(i..i + 1);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_maps_bytes_and_specials() {
        let t = Tokenizer::Bytes;
        let e = t.encode("<|bos|>hé<|eos|>", false).unwrap();
        assert_eq!(e.ids, vec![256, b'h' as u32, 0xc3, 0xa9, 257]);
        assert_eq!(e.offsets, vec![0..7, 7..8, 8..9, 9..10, 10..17]);
        assert_eq!(t.ids("a<|x", true).unwrap(), vec![256, 97, 60, 124, 120]);
        assert_eq!(t.vocab_size(), 259);
        assert_eq!(t.token_to_id("<|pad|>"), Some(BYTE_PAD));
    }
}
