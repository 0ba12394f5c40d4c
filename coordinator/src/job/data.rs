//! `[data]`: where a job's documents come from (files, a mixture of
//! sources, pushed rollouts or the RL loop's own), their format, the
//! tokenizer and chat template, and the tokens of one microbatch. The
//! sources themselves are [`crate::job::sources`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::locate;
use crate::job::section::{check_file, is_default};
use crate::job::sources::{self, Source, SourceSpec};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    Sft,
    Dpo,
    Rollouts,
    /// Prompts and reference answers for the RL loop (`data.source =
    /// "generate"`; see `crate::rl::prompts`).
    Prompts,
}

/// Where a job's documents come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The files of `data.train`, read and tokenized at submit.
    #[default]
    Files,
    /// Rollouts pushed through the `Rollouts.PushRollouts` RPC while the
    /// job runs (policy gradient only; see `crate::rl::stream`).
    Stream,
    /// The RL loop: the coordinator reads prompts from `data.train`, has
    /// the job's workers sample `rl.group_size` completions of each,
    /// scores them with `[rl.verifier]` and trains on them as a stream
    /// (see `crate::rl`).
    Generate,
}

/// What to do with a document longer than `max_tokens`, or a malformed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnBad {
    #[default]
    Error,
    Skip,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// JSONL, JSON array or gzipped files (none when `source = "stream"`).
    #[serde(default)]
    pub train: Vec<PathBuf>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub source: DataSource,
    pub format: DataFormat,
    /// "bytes" (built in) or a path to a HF tokenizer.json.
    #[serde(default = "default_tokenizer")]
    pub tokenizer: String,
    /// A Jinja chat template file, overriding the one found next to the
    /// tokenizer (tokenizer_config.json) and the built-in template.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Which of the model's named chat templates renders the chats (a
    /// `chat_template` list in tokenizer_config.json, or
    /// `additional_chat_templates/NAME.jinja`); by default `tool_use` for a
    /// row with tools when the model has one, else `default`, as
    /// transformers' `apply_chat_template` chooses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_name: Option<String>,
    /// Tokens per microbatch.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default)]
    pub on_overlong: OnBad,
    #[serde(default)]
    pub on_bad_line: OnBad,
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// `[[data.sources]]`: a mixture, instead of `train`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceSpec>,
    /// Where token stores are kept (see `locate::default_cache_root`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}

fn default_tokenizer() -> String {
    "bytes".into()
}
fn default_max_tokens() -> u32 {
    4096
}
fn default_true() -> bool {
    true
}

impl DataSection {
    pub fn is_byte_tokenizer(&self) -> bool {
        self.tokenizer == "bytes"
    }

    /// True when the job trains on a rollout queue rather than on file
    /// documents: pushed rollouts, or the RL loop's own.
    pub fn is_stream(&self) -> bool {
        matches!(self.source, DataSource::Stream | DataSource::Generate)
    }

    /// True when the coordinator generates the job's rollouts (RL loop).
    pub fn is_generate(&self) -> bool {
        self.source == DataSource::Generate
    }

    /// The training sources: `[[data.sources]]`, or `train` as one source
    /// named `train`. `job_epochs` is every source's default.
    pub fn train_sources(&self, job_epochs: Option<u64>) -> Vec<Source> {
        if self.sources.is_empty() {
            let one = SourceSpec {
                name: Some("train".into()),
                paths: self.train.clone(),
                ..Default::default()
            };
            return sources::resolve(&[one], 0, job_epochs);
        }
        sources::resolve(&self.sources, 0, job_epochs)
    }

    /// Every training file, in source order (`DocId::file` indexes it).
    pub fn files(&self) -> Vec<PathBuf> {
        if self.sources.is_empty() {
            return self.train.clone();
        }
        self.sources
            .iter()
            .flat_map(|s| s.entries().cloned())
            .collect()
    }

    /// Whether the job mixes several sources.
    pub fn is_mixture(&self) -> bool {
        self.sources.len() > 1
    }

    /// Where this job's token stores are kept.
    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(locate::default_cache_root)
    }

    /// The checks of `[data]`: files for a job that reads files and none
    /// for one that is pushed its rollouts, every named file present (paths
    /// already resolved), prompts for the RL loop. Whether the sources'
    /// docs fill a step is `rules::source_docs_fill_step`.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        let needs_files = !self.is_stream() || self.is_generate();
        if self.train.is_empty() && self.sources.is_empty() && needs_files {
            bad(
                "data.train",
                "list at least one dataset file (or give [[data.sources]])".into(),
            );
        }
        if !self.train.is_empty() && !self.sources.is_empty() {
            bad(
                "data.sources",
                "give data.train or [[data.sources]], not both".into(),
            );
        }
        if self.is_stream() && !self.sources.is_empty() {
            bad("data.sources", "a streamed job reads no files".into());
        }
        if self.source == DataSource::Stream && !self.train.is_empty() {
            bad(
                "data.train",
                "a streamed job reads no files: leave data.train out, or use data.source = \"files\""
                    .into(),
            );
        }
        if self.is_generate() && self.format != DataFormat::Prompts {
            bad(
                "data.format",
                "data.source = \"generate\" reads prompts: it needs data.format = \"prompts\""
                    .into(),
            );
        }
        for (i, f) in self.train.iter().enumerate() {
            check_file(bad, &format!("data.train[{i}]"), f);
        }
        sources::validate(&self.sources, "data.sources", false, bad);
        for (i, s) in self.sources.iter().enumerate() {
            for (j, f) in s.entries().enumerate() {
                check_file(bad, &format!("data.sources[{i}].paths[{j}]"), f);
            }
            if let Some(t) = &s.chat_template {
                check_file(bad, &format!("data.sources[{i}].chat_template"), t);
            }
        }
        if !self.is_byte_tokenizer() {
            check_file(bad, "data.tokenizer", Path::new(&self.tokenizer));
        }
        if let Some(t) = &self.chat_template {
            check_file(bad, "data.chat_template", t);
        }
        if self.max_tokens == 0 {
            bad("data.max_tokens", "must be at least 1".into());
        }
    }
}
