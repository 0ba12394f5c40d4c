//! The tokenizer side of every checkpoint and published policy: the
//! workers write weights and `config.json`, the coordinator (which owns
//! the tokenizer) adds `tokenizer.json`, `tokenizer_config.json` with the
//! job's chat template, `special_tokens_map.json` and
//! `generation_config.json`, so each directory is a complete Hugging Face
//! model folder. Written once per directory, off the state lock; a write
//! that fails is handed to `on_error` (the service fails the job, as for
//! any output it cannot write).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::{debug, error};

use crate::core::JobId;
use crate::job::data::DataSection;
use crate::model::export::{tokenizer_files, write_tokenizer_files};

/// What a directory's write said, told to whoever asked for it.
type Done = Box<dyn FnOnce(Result<(), String>) + Send>;

/// A directory's tokenizer write: running (with who waits for it) or its
/// result.
enum Write {
    Running(Vec<Done>),
    Finished(Result<(), String>),
}

#[derive(Default)]
pub(super) struct TokenizerWriter {
    dirs: Mutex<HashMap<PathBuf, Write>>,
}

impl TokenizerWriter {
    /// Writes `data`'s tokenizer files into `dir` once, on another thread;
    /// `done` gets the result — of this write, or of the one that already
    /// ran or runs for `dir` (a checkpoint asked again is acknowledged
    /// again). `done` never runs on the caller's thread, which holds the
    /// state lock it takes.
    pub fn write(
        self: &std::sync::Arc<Self>,
        job: &JobId,
        data: &DataSection,
        dir: &Path,
        done: impl FnOnce(Result<(), String>) + Send + 'static,
    ) {
        let done: Done = Box::new(done);
        let mut dirs = self.dirs.lock().unwrap_or_else(|p| p.into_inner());
        match dirs.get_mut(dir) {
            Some(Write::Running(waiting)) => return waiting.push(done),
            Some(Write::Finished(result)) => {
                let result = result.clone();
                return spawn(move || done(result));
            }
            None => {
                dirs.insert(dir.to_path_buf(), Write::Running(vec![done]));
            }
        }
        drop(dirs);
        let (job, data, dir) = (job.clone(), data.clone(), dir.to_path_buf());
        let me = self.clone();
        spawn(move || {
            let result = tokenizer_files(&data)
                .map_err(|e| e.to_string())
                .and_then(|files| write_tokenizer_files(&dir, &files).map_err(|e| e.to_string()))
                .map_err(|e| format!("{}: tokenizer files: {e}", dir.display()));
            match &result {
                Ok(()) => debug!(%job, dir = %dir.display(), "tokenizer files written"),
                Err(e) => error!(%job, "tokenizer files not written: {e}"),
            }
            let waiting = {
                let mut dirs = me.dirs.lock().unwrap_or_else(|p| p.into_inner());
                match dirs.insert(dir, Write::Finished(result.clone())) {
                    Some(Write::Running(waiting)) => waiting,
                    _ => Vec::new(),
                }
            };
            for d in waiting {
                d(result.clone());
            }
        });
    }
}

/// Runs `work` off the caller's thread.
fn spawn(work: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(work)),
        Err(_) => drop(std::thread::spawn(work)),
    }
}
