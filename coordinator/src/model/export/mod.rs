//! Complete Hugging Face model folders.
//!
//! A checkpoint's weights and `config.json` come from the workers; the
//! tokenizer side (`tokenizer.json`, `tokenizer_config.json` with the chat
//! template the job trained with, `special_tokens_map.json`,
//! `generation_config.json`) comes from the coordinator, which owns the
//! tokenizer ([`tokenizer_files`], written into every checkpoint and
//! published policy directory). `accrue export` ([`export`]) turns a
//! checkpoint into the folder a user uploads: weights only (no optimizer
//! state), in a chosen dtype, sharded by size with an index.

mod adapter;
mod byte_tokenizer;
mod folder;
mod run;
mod weights;

pub use byte_tokenizer::tokenizer_json as byte_tokenizer_json;
pub use folder::{
    tokenizer_files, write_tokenizer_files, OPTIONAL_TOKENIZER_FILES, TOKENIZER_FILES,
};
pub use run::export;
pub use weights::{parse_size, Dtype, ExportError, ExportOptions, ExportReport};
