//! `[model]`: the model a job starts from (a fresh random one from a
//! config, or a checkpoint directory) and the dtype of its parameters.
//! Reading the config itself is `crate::model::config`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::input;
use crate::job::section::check_file;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    Float32,
    Bfloat16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// "random" or a Hugging Face checkpoint directory.
    pub init: String,
    /// HF config.json; required when init = "random".
    #[serde(default)]
    pub config: Option<PathBuf>,
    #[serde(default)]
    pub dtype: Dtype,
    /// When `init` is a checkpoint of ours: `true` (default) resumes it
    /// (step, data cursor, optimizer state); `false` takes only its weights
    /// (e.g. DPO starting from an SFT checkpoint).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub resume: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

impl ModelSection {
    pub fn is_random(&self) -> bool {
        self.init == "random"
    }

    /// The checks of `[model]`: a config for a random model, a checkpoint
    /// directory with a config.json otherwise (paths already resolved).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.is_random() {
            match &self.config {
                None => bad(
                    "model.config",
                    "required when model.init = \"random\"".into(),
                ),
                Some(c) => check_file(bad, "model.config", c),
            }
        } else if self.init.is_empty() {
            bad(
                "model.init",
                "must not be empty: \"random\" or a checkpoint directory".into(),
            );
        } else {
            let dir = Path::new(&self.init);
            if !dir.is_dir() {
                bad(
                    "model.init",
                    format!(
                        "expected \"random\" or a checkpoint directory; {} is not a directory",
                        dir.display()
                    ),
                );
            } else if let Err(e) = input::check(&dir.join("config.json")) {
                bad("model.init", format!("no config.json: {e}"));
            }
            if let Some(c) = &self.config {
                check_file(bad, "model.config", c);
            }
        }
    }
}
