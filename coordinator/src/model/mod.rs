//! Hugging Face model folders: what the coordinator reads of a job's model
//! before admitting it ([`config`]: its `config.json`, a checkpoint's
//! completeness) and complete folders written from a checkpoint
//! ([`export`]). Imports [`crate::job`] and [`crate::stream`] (the
//! tokenizer side of a folder).

pub mod config;
pub mod export;
