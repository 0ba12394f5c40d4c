//! The tokenizer side of every checkpoint and published policy: the
//! workers write weights and `config.json`, the coordinator (which owns
//! the tokenizer) adds `tokenizer.json`, `tokenizer_config.json` with the
//! job's chat template, `special_tokens_map.json` and
//! `generation_config.json`, so each directory is a complete Hugging Face
//! model folder. Written once per directory, off the state lock; a write
//! that fails is handed to `on_error` (the service fails the job, as for
//! any output it cannot write).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::{debug, error};

use crate::core::JobId;
use crate::job::data::DataSection;
use crate::model::export::{tokenizer_files, write_tokenizer_files};

#[derive(Default)]
pub(super) struct TokenizerWriter {
    started: Mutex<HashSet<PathBuf>>,
}

impl TokenizerWriter {
    /// Writes `data`'s tokenizer files into `dir` unless already started
    /// for it (every rank gets the same request), on another thread;
    /// `on_error` gets what failed.
    pub fn write(
        &self,
        job: &JobId,
        data: &DataSection,
        dir: &Path,
        on_error: impl FnOnce(String) + Send + 'static,
    ) {
        let fresh = self
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(dir.to_path_buf());
        if !fresh {
            return;
        }
        let (job, data, dir) = (job.clone(), data.clone(), dir.to_path_buf());
        let work = move || {
            let result = tokenizer_files(&data)
                .map_err(|e| e.to_string())
                .and_then(|files| write_tokenizer_files(&dir, &files).map_err(|e| e.to_string()));
            match result {
                Ok(()) => debug!(%job, dir = %dir.display(), "tokenizer files written"),
                Err(e) => {
                    error!(%job, dir = %dir.display(), "tokenizer files not written: {e}");
                    on_error(format!("{}: tokenizer files: {e}", dir.display()));
                }
            }
        };
        // Never inline: the caller holds the state lock `on_error` takes.
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(work)),
            Err(_) => drop(std::thread::spawn(work)),
        }
    }
}
