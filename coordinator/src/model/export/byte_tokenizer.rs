//! The built-in byte tokenizer as a Hugging Face `tokenizer.json`: a
//! byte-level BPE with no merges (every byte is its own token, id = the
//! byte's value), the special tokens `<|bos|>` `<|eos|>` `<|pad|>` as
//! added tokens 256..=258, and a post-processor that prepends BOS when
//! special tokens are added — what [`crate::stream::data::tokenize`] does, so
//! `AutoTokenizer` encodes and decodes exactly as the data stream did.

use serde_json::{json, Map, Value};

use crate::stream::data::tokenize::{BYTE_BOS, BYTE_EOS, BYTE_PAD};

/// GPT-2's byte → printable character map that the ByteLevel
/// pre-tokenizer and decoder use (a token string per byte).
fn byte_chars() -> [char; 256] {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        out[b as usize] = char::from_u32(c).expect("below the surrogates");
    }
    out
}

fn added(id: u32, content: &str) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": true,
    })
}

/// The `tokenizer.json` of the byte tokenizer.
pub fn tokenizer_json() -> Value {
    let vocab: Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), json!(b)))
        .collect();
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false,
    });
    let bos = json!({"SpecialToken": {"id": "<|bos|>", "type_id": 0}});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added(BYTE_BOS, "<|bos|>"),
            added(BYTE_EOS, "<|eos|>"),
            added(BYTE_PAD, "<|pad|>"),
        ],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                "<|bos|>": {"id": "<|bos|>", "ids": [BYTE_BOS], "tokens": ["<|bos|>"]},
            },
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::stream::data::tokenize::Tokenizer;

    fn hf() -> tokenizers::Tokenizer {
        tokenizers::Tokenizer::from_bytes(tokenizer_json().to_string().as_bytes()).unwrap()
    }

    /// Texts with ASCII, multi-byte UTF-8, control bytes, the special
    /// strings, near-misses of them and whitespace runs.
    fn texts() -> Vec<String> {
        let mut out: Vec<String> = [
            "",
            "12+30=42",
            "  leading and trailing  ",
            "tabs\tand\nnewlines\r\n",
            "héllo wörld — ✓ 日本語 🙂",
            "<|bos|>user\nhi<|eos|>",
            "<|bo|> <|eos <|pad|><|pad|>",
            "\u{0}\u{1}\u{7f}",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..200 {
            let n = rng.random_range(0..40);
            let s: String = (0..n)
                .map(|_| match rng.random_range(0..4) {
                    0 => char::from_u32(rng.random_range(0..0x80)).unwrap(),
                    1 => char::from_u32(rng.random_range(0x80..0x800)).unwrap(),
                    2 => {
                        ['<', '|', 'b', 'o', 's', '>', 'e', 'p', 'a', 'd'][rng.random_range(0..10)]
                    }
                    _ => char::from_u32(rng.random_range(0x1F300..0x1F600)).unwrap(),
                })
                .collect();
            out.push(s);
        }
        out
    }

    #[test]
    fn encodes_and_decodes_exactly_as_the_byte_tokenizer() {
        let hf = hf();
        let ours = Tokenizer::Bytes;
        for text in texts() {
            for special in [false, true] {
                let want = ours.ids(&text, special).unwrap();
                let got = hf
                    .encode(text.as_str(), special)
                    .unwrap()
                    .get_ids()
                    .to_vec();
                assert_eq!(got, want, "{text:?} (add_special_tokens {special})");
                let back = hf.decode(&want, false).unwrap();
                let expect = if special {
                    format!("<|bos|>{text}")
                } else {
                    text.clone()
                };
                assert_eq!(back, expect, "decoding {text:?}");
            }
        }
        assert_eq!(hf.get_vocab_size(true) as u32, ours.vocab_size());
    }
}
