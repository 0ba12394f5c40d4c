//! The coordinator's data stream, first half: read the job's dataset files,
//! tokenize every row into a [`Document`] with a stable [`DocId`], and
//! report what was skipped. (The seeded per-epoch order is the cursor's job,
//! `crate::stream::cursor`.)
//!
//! - [`read`], [`parquet`]: JSONL / JSON array / gzip / parquet readers.
//! - `crate::job::locate`: directories, globs, HF snapshots and model ids → files.
//! - [`cache`], [`token_store`]: the token cache and its mapped stores.
//! - [`tokenize`]: the built-in byte tokenizer and HF `tokenizer.json`.
//! - [`template`]: chat templates (HF Jinja through minijinja, or built in).
//! - [`format`](mod@format), [`sft`], [`dpo`], [`rollout`]: row shapes → documents.
//! - `crate::rl::prompts`: the RL loop's prompt files (`data.format = "prompts"`).
//! - [`synth`]: a seeded arithmetic demo dataset in all three formats.
//!
//! A job's documents are indexed in memory (the planner needs every
//! document's length up front); their tokens stay in the token cache's
//! mapped stores ([`cache`], [`token_store`]) unless loaded [`Via::Memory`].
//! Rows are tokenized on all cores (tokenizing is the cost), in batches
//! whose results are then taken in file order, so errors and ids do not
//! depend on the thread count. Files stream ([`read::for_each_batch`]):
//! JSON Lines (gzipped or not) and parquet never need the whole file in
//! memory. A job's sources ([`crate::job::sources`]) load in order, each a
//! contiguous range of documents.
//!
//! Bad rows (invalid JSON, an unknown shape, wrong types, no loss tokens)
//! are errors naming `path:line`, or are skipped and counted with
//! `data.on_bad_line = "skip"`. Documents longer than `data.max_tokens` (a
//! pair counts chosen + rejected, which share a microbatch) are errors or,
//! with `data.on_overlong = "skip"`, skipped and counted. Nothing is ever
//! truncated.

pub mod build;
pub mod cache;
pub mod dpo;
pub mod error;
pub mod format;
pub mod parquet;
pub mod read;
pub mod rollout;
pub mod row;
pub mod sft;
pub mod synth;
pub mod synth_tools;
pub mod template;
pub mod token_store;
pub mod tokenize;
pub mod tokenizer_class;

use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};

use crate::job::data::{DataFormat, DataSection, OnBad};
use crate::job::objective::ObjectiveKind;
use crate::job::parallel::RowBudget;
use crate::job::sources::Source;
use crate::stream::doc::{DocBody, DocId, Document};

pub use build::build_doc;
pub use error::{DataError, Location, Result};
pub use format::Encoder;
pub use synth::{synth_arithmetic, SynthFiles};
pub use tokenize::Tokenizer;

/// A loaded dataset: every document, in file order.
#[derive(Debug)]
pub struct Dataset {
    pub docs: Vec<Document>,
    /// `data.train`, in order (`DocId::file` indexes it).
    pub files: Vec<PathBuf>,
    pub report: LoadReport,
    /// The tokenizer's vocabulary size, special and added tokens included.
    pub tokenizer_vocab: u32,
    /// Each source's documents (a range of `docs`) and counts.
    pub sources: Vec<(std::ops::Range<usize>, SourceReport)>,
    /// `[eval]`: the eval sources' documents (ids after the training files).
    pub eval: Option<Box<Dataset>>,
}

impl Dataset {
    /// No documents (a generating or streamed job reads none up front).
    fn empty(enc: &Encoder) -> Dataset {
        Dataset {
            docs: Vec::new(),
            files: Vec::new(),
            report: LoadReport::default(),
            tokenizer_vocab: enc.tok.vocab_size(),
            sources: Vec::new(),
            eval: None,
        }
    }

    /// The documents a job holds: training, then eval.
    pub fn into_job_docs(self) -> Vec<Document> {
        let mut docs = self.docs;
        if let Some(e) = self.eval {
            docs.extend(e.docs);
        }
        docs
    }
}

/// What loading saw of one source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceReport {
    pub name: String,
    pub rows: u64,
    pub docs: u64,
    pub tokens: u64,
    pub bad_lines_skipped: u64,
    pub overlong_skipped: u64,
}

/// What loading saw, in total and per file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Non-blank rows read.
    pub rows: u64,
    /// Documents built (rows minus the skipped ones).
    pub docs: u64,
    pub bad_lines_skipped: u64,
    pub overlong_skipped: u64,
    /// Tokens over all documents (a pair counts both sequences).
    pub tokens: u64,
    /// Loss tokens over all documents.
    pub loss_tokens: u64,
    pub per_file: Vec<FileReport>,
}

/// Counts of one file of `data.train`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileReport {
    pub path: PathBuf,
    pub rows: u64,
    pub docs: u64,
    pub bad_lines_skipped: u64,
    pub overlong_skipped: u64,
}

/// The document kind each objective trains on.
pub fn format_for(objective: ObjectiveKind) -> DataFormat {
    match objective {
        ObjectiveKind::Sft => DataFormat::Sft,
        ObjectiveKind::Dpo => DataFormat::Dpo,
        ObjectiveKind::Pg => DataFormat::Rollouts,
    }
}

/// Loads the tokenizer and chat template a data section names, for a
/// model of `model_vocab` ids (the bound of pre-tokenized ids; that the
/// model holds the tokenizer's ids is admission's check,
/// [`crate::shell::admission`]).
pub fn encoder(data: &DataSection, model_vocab: u32) -> Result<Encoder> {
    encoder_with_template(data, model_vocab, None)
}

/// [`encoder`] with a source's own chat template instead of the job's.
pub fn encoder_with_template(
    data: &DataSection,
    model_vocab: u32,
    template: Option<&Path>,
) -> Result<Encoder> {
    let (tok, tok_path) = if data.is_byte_tokenizer() {
        (Tokenizer::Bytes, None)
    } else {
        let p = Path::new(&data.tokenizer);
        (Tokenizer::from_file(p)?, Some(p))
    };
    let template_file = template.or(data.chat_template.as_deref());
    let (template, specials) = template::resolve(
        &tok,
        tok_path,
        template_file,
        data.chat_template_name.as_deref(),
    )?;
    Ok(Encoder {
        tok,
        template,
        eos_id: specials.eos_id,
        model_vocab,
    })
}

/// How a load reads its files.
#[derive(Clone, Copy)]
pub enum Via<'a> {
    /// Tokenize into memory (tests, benchmarks, small checks).
    Memory,
    /// Through the token cache under this root: each file's store is
    /// opened, or built (with `progress`), and documents map its rows.
    Cache {
        root: &'a Path,
        progress: &'a (dyn Fn(&Path, cache::Progress) + Sync),
    },
}

/// Reads and tokenizes every file of `data.train` (paths already absolute)
/// into documents of the kind `data.format` names, which must be the one
/// `objective` trains on, for a model of `model_vocab` ids.
pub fn load(data: &DataSection, objective: ObjectiveKind, model_vocab: u32) -> Result<Dataset> {
    let enc = encoder(data, model_vocab)?;
    load_with(&enc, data, objective)
}

/// [`load`] with an encoder already built.
pub fn load_with(enc: &Encoder, data: &DataSection, objective: ObjectiveKind) -> Result<Dataset> {
    let sources = data.train_sources(None);
    let limit = RowBudget::single(data.max_tokens);
    load_sources(
        enc,
        data,
        limit,
        objective,
        &sources,
        &data.files(),
        Via::Memory,
    )
}

/// Loads a job's training sources through the token cache (`progress`
/// hears of every store being built).
pub fn load_job(
    enc: &Encoder,
    spec: &crate::job::spec::JobSpec,
    progress: &(dyn Fn(&Path, cache::Progress) + Sync),
) -> Result<Dataset> {
    let root = spec.data.cache_root();
    let sources = spec.data.train_sources(spec.job.epochs);
    let via = Via::Cache {
        root: &root,
        progress,
    };
    let files = spec.data.files();
    let limit = spec.parallel.row_budget(spec.data.max_tokens);
    let mut ds = load_sources(
        enc,
        &spec.data,
        limit,
        spec.objective.kind,
        &sources,
        &files,
        via,
    )?;
    if let Some(e) = &spec.eval {
        let eval_sources = crate::job::sources::resolve(&e.sources, files.len() as u32, None);
        let mut all = files.clone();
        all.extend(e.sources.iter().flat_map(|s| s.entries().cloned()));
        let ev = load_sources(
            enc,
            &spec.data,
            limit,
            spec.objective.kind,
            &eval_sources,
            &all,
            via,
        )?;
        ds.eval = Some(Box::new(ev));
    }
    Ok(ds)
}

/// Loads the given sources (their files indexed in `files`) through `via`.
pub fn load_sources(
    enc: &Encoder,
    data: &DataSection,
    limit: RowBudget,
    objective: ObjectiveKind,
    sources: &[Source],
    files: &[PathBuf],
    via: Via<'_>,
) -> Result<Dataset> {
    if data.is_generate() {
        // Prompts are read by `prompts::load`; rollouts come from the loop.
        return Ok(Dataset::empty(enc));
    }
    if format_for(objective) != data.format {
        return Err(DataError::FormatMismatch {
            objective,
            format: data.format,
        });
    }
    if data.is_stream() {
        // Rollouts are pushed while the job runs (`core::stream`).
        return Ok(Dataset::empty(enc));
    }
    let mut report = LoadReport::default();
    let mut docs = Vec::new();
    let mut loaded = Vec::new();
    for s in sources {
        let own;
        let enc = match &s.chat_template {
            Some(t) => {
                own = encoder_with_template(data, enc.model_vocab, Some(t))?;
                &own
            }
            None => enc,
        };
        let start = docs.len();
        let mut sr = SourceReport {
            name: s.name.clone(),
            ..Default::default()
        };
        for file in s.files.clone() {
            let path = &files[file as usize];
            let fr = match via {
                Via::Memory => load_file(enc, data, limit, file, path, &mut docs)?,
                Via::Cache { root, progress } => {
                    let cached = CachedFile {
                        file,
                        path,
                        root,
                        template: s.chat_template.as_deref(),
                        progress,
                    };
                    load_cached_file(enc, data, limit, &cached, &mut docs)?
                }
            };
            info!(path = %path.display(), rows = fr.rows, docs = fr.docs, bad = fr.bad_lines_skipped, overlong = fr.overlong_skipped, "dataset file loaded");
            sr.rows += fr.rows;
            sr.bad_lines_skipped += fr.bad_lines_skipped;
            sr.overlong_skipped += fr.overlong_skipped;
            report.rows += fr.rows;
            report.bad_lines_skipped += fr.bad_lines_skipped;
            report.overlong_skipped += fr.overlong_skipped;
            report.per_file.push(fr);
        }
        if let Some(max) = s.max_docs {
            docs.truncate(start + (max as usize).min(docs.len() - start));
        }
        sr.docs = (docs.len() - start) as u64;
        sr.tokens = docs[start..].iter().map(Document::tokens).sum();
        report.docs += sr.docs;
        loaded.push((start..docs.len(), sr));
    }
    report.tokens = docs.iter().map(Document::tokens).sum();
    report.loss_tokens = docs.iter().map(Document::loss_tokens).sum();
    if docs.is_empty() {
        return Err(DataError::NoDocuments {
            rows: report.rows,
            bad: report.bad_lines_skipped,
            overlong: report.overlong_skipped,
        });
    }
    Ok(Dataset {
        docs,
        files: files.to_vec(),
        report,
        tokenizer_vocab: enc.tok.vocab_size(),
        sources: loaded,
        eval: None,
    })
}

/// One file through the token cache: the store opened or built, its bad
/// rows and overlong documents dealt with by the job's policies, and its
/// documents mapping the store's rows.
struct CachedFile<'a> {
    file: u32,
    path: &'a Path,
    root: &'a Path,
    template: Option<&'a Path>,
    progress: &'a (dyn Fn(&Path, cache::Progress) + Sync),
}

fn load_cached_file(
    enc: &Encoder,
    data: &DataSection,
    limit: RowBudget,
    c: &CachedFile<'_>,
    docs: &mut Vec<Document>,
) -> Result<FileReport> {
    let (file, path, root, progress) = (c.file, c.path, c.root, c.progress);
    let key = cache::file_key(path, encoder_key(data, enc.model_vocab, c.template)?)?;
    let report = |p: cache::Progress| progress(path, p);
    let (store, found) = cache::open_or_build(root, &key, path, enc, data.format, &report)?;
    debug!(path = %path.display(), key = key.key, ?found, "token store");
    let mut fr = FileReport {
        path: path.to_path_buf(),
        rows: store.meta.rows_read,
        ..Default::default()
    };
    let at = |line: u64, element: Option<u64>| Location {
        path: path.to_path_buf(),
        line,
        element,
    };
    for b in &store.bad {
        match data.on_bad_line {
            OnBad::Skip => fr.bad_lines_skipped += 1,
            OnBad::Error if b.json => {
                return Err(DataError::Json {
                    at: at(b.line, b.element),
                    message: b.reason.clone(),
                })
            }
            OnBad::Error => {
                return Err(DataError::Row {
                    at: at(b.line, b.element),
                    reason: b.reason.clone(),
                })
            }
        }
    }
    docs.reserve(store.docs());
    for i in 0..store.docs() {
        let e = store.doc(i);
        let tokens = store.doc_tokens(i);
        if tokens > u64::from(limit.tokens()) {
            let err = DataError::Overlong {
                at: at(e.line, e.element),
                tokens,
                limit,
            };
            match data.on_overlong {
                OnBad::Skip => {
                    fr.overlong_skipped += 1;
                    continue;
                }
                OnBad::Error => return Err(err),
            }
        }
        docs.push(Document {
            id: DocId {
                file,
                line: e.element.unwrap_or(e.line),
            },
            body: store.body(i),
        });
        fr.docs += 1;
    }
    Ok(fr)
}

/// The cache key of an encoder for `data` (a source's own template
/// instead of `data.chat_template` when given).
pub fn encoder_key(
    data: &DataSection,
    model_vocab: u32,
    template: Option<&Path>,
) -> Result<cache::EncoderKey> {
    let tok = (!data.is_byte_tokenizer()).then(|| Path::new(&data.tokenizer));
    let template = template.or(data.chat_template.as_deref());
    cache::EncoderKey::new(
        tok,
        template,
        data.chat_template_name.as_deref(),
        data.format,
        model_vocab,
    )
}

fn load_file(
    enc: &Encoder,
    data: &DataSection,
    limit: RowBudget,
    file: u32,
    path: &Path,
    docs: &mut Vec<Document>,
) -> Result<FileReport> {
    let mut fr = FileReport {
        path: path.to_path_buf(),
        ..Default::default()
    };
    read::for_each_batch(path, 8192, |rows| {
        let bodies = build_all(enc, data.format, &rows);
        enc.template.check_needed()?;
        for (row, body) in rows.iter().zip(bodies) {
            fr.rows += 1;
            let at = || row.location(path);
            let body = match (&row.value, body) {
                (Err(message), _) => Err(DataError::Json {
                    at: at(),
                    message: message.clone(),
                }),
                (Ok(_), body) => body.map_err(|reason| DataError::Row { at: at(), reason }),
            };
            let body = match (body, data.on_bad_line) {
                (Ok(b), _) => b,
                (Err(e), OnBad::Skip) => {
                    debug!(error = %e, "skipping bad line");
                    fr.bad_lines_skipped += 1;
                    continue;
                }
                (Err(e), OnBad::Error) => return Err(e),
            };
            let doc = Document {
                id: DocId {
                    file,
                    line: row.doc_line(),
                },
                body,
            };
            let tokens = doc.tokens();
            if tokens > u64::from(limit.tokens()) {
                let e = DataError::Overlong {
                    at: at(),
                    tokens,
                    limit,
                };
                match data.on_overlong {
                    OnBad::Skip => {
                        debug!(error = %e, "skipping overlong document");
                        fr.overlong_skipped += 1;
                        continue;
                    }
                    OnBad::Error => return Err(e),
                }
            }
            fr.docs += 1;
            docs.push(doc);
        }
        Ok(())
    })?;
    if fr.bad_lines_skipped + fr.overlong_skipped > 0 {
        warn!(path = %path.display(), bad = fr.bad_lines_skipped, overlong = fr.overlong_skipped, "rows skipped");
    }
    Ok(fr)
}

/// Builds every row's body on every core (rayon), results in row order
/// (rows that are not valid JSON get a placeholder error the caller
/// replaces).
fn build_all(
    enc: &Encoder,
    format: DataFormat,
    rows: &[row::RawRow],
) -> Vec<Result<DocBody, String>> {
    let build = |r: &row::RawRow| match &r.value {
        Ok(v) => build_doc(enc, format, v),
        Err(e) => Err(e.clone()),
    };
    use rayon::prelude::*;
    rows.par_iter().map(build).collect()
}

#[cfg(test)]
pub(crate) mod tests;

#[cfg(test)]
mod cache_tests;
