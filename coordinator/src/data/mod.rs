//! The coordinator's data stream, first half: read the job's dataset files,
//! tokenize every row into a [`Document`] with a stable [`DocId`], and
//! report what was skipped. (The seeded per-epoch order is the cursor's job,
//! `crate::cursor`.)
//!
//! - [`read`]: JSONL / JSON array / gzip readers.
//! - [`tokenize`]: the built-in byte tokenizer and HF `tokenizer.json`.
//! - [`template`]: chat templates (HF Jinja through minijinja, or built in).
//! - [`format`], [`sft`], [`dpo`], [`rollout`]: row shapes → documents.
//! - [`synth`]: a seeded arithmetic demo dataset in all three formats.
//!
//! The whole dataset is held in memory, tokenized once at job start: the
//! planner needs every document's length up front, and the datasets this
//! serves are small next to a model. Rows are tokenized on all cores
//! (tokenizing is the cost), in chunks whose results are then taken in
//! file order, so errors and ids do not depend on the thread count.
//!
//! Bad rows (invalid JSON, an unknown shape, wrong types, no loss tokens)
//! are errors naming `path:line`, or are skipped and counted with
//! `data.on_bad_line = "skip"`. Documents longer than `data.max_tokens` (a
//! pair counts chosen + rejected, which share a microbatch) are errors or,
//! with `data.on_overlong = "skip"`, skipped and counted. Nothing is ever
//! truncated.

pub mod dpo;
pub mod error;
pub mod format;
pub mod read;
pub mod rollout;
pub mod sft;
pub mod synth;
pub mod template;
pub mod tokenize;

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tracing::{debug, info, warn};

use crate::doc::{DocBody, DocId, Document};
use crate::spec::{DataFormat, DataSection, ObjectiveKind, OnBad};

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
/// [`crate::admission`]).
pub fn encoder(data: &DataSection, model_vocab: u32) -> Result<Encoder> {
    let (tok, tok_path) = if data.is_byte_tokenizer() {
        (Tokenizer::Bytes, None)
    } else {
        let p = Path::new(&data.tokenizer);
        (Tokenizer::from_file(p)?, Some(p))
    };
    let (template, specials) = template::resolve(&tok, tok_path, data.chat_template.as_deref())?;
    Ok(Encoder {
        tok,
        template,
        eos_id: specials.eos_id,
        model_vocab,
    })
}

/// Builds the body of one row for a format; the error is the reason.
pub fn build_doc(enc: &Encoder, format: DataFormat, row: &Json) -> Result<DocBody, String> {
    Ok(match format {
        DataFormat::Sft => DocBody::Sft(sft::sft_row(enc, row)?),
        DataFormat::Dpo => {
            let (chosen, rejected) = dpo::dpo_row(enc, row)?;
            DocBody::Pair { chosen, rejected }
        }
        DataFormat::Rollouts => DocBody::Rollout(rollout::rollout_row(enc, row)?),
    })
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
    if format_for(objective) != data.format {
        return Err(DataError::FormatMismatch {
            objective,
            format: data.format,
        });
    }
    if data.is_stream() {
        // Rollouts are pushed while the job runs (`core::stream`).
        return Ok(Dataset {
            docs: Vec::new(),
            files: Vec::new(),
            report: LoadReport::default(),
            tokenizer_vocab: enc.tok.vocab_size(),
        });
    }
    let mut report = LoadReport::default();
    let mut docs = Vec::new();
    for (file, path) in data.train.iter().enumerate() {
        let fr = load_file(enc, data, file as u32, path, &mut docs)?;
        info!(path = %path.display(), rows = fr.rows, docs = fr.docs, bad = fr.bad_lines_skipped, overlong = fr.overlong_skipped, "dataset file loaded");
        report.rows += fr.rows;
        report.docs += fr.docs;
        report.bad_lines_skipped += fr.bad_lines_skipped;
        report.overlong_skipped += fr.overlong_skipped;
        report.per_file.push(fr);
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
        files: data.train.clone(),
        report,
        tokenizer_vocab: enc.tok.vocab_size(),
    })
}

fn load_file(
    enc: &Encoder,
    data: &DataSection,
    file: u32,
    path: &Path,
    docs: &mut Vec<Document>,
) -> Result<FileReport> {
    let mut fr = FileReport {
        path: path.to_path_buf(),
        ..Default::default()
    };
    let rows = read::read_rows(path)?;
    let bodies = build_all(enc, data.format, &rows);
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
        if tokens > u64::from(data.max_tokens) {
            let e = DataError::Overlong {
                at: at(),
                tokens,
                limit: data.max_tokens,
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
    if fr.bad_lines_skipped + fr.overlong_skipped > 0 {
        warn!(path = %path.display(), bad = fr.bad_lines_skipped, overlong = fr.overlong_skipped, "rows skipped");
    }
    Ok(fr)
}

/// Builds every row's body, in parallel chunks, results in row order
/// (rows that are not valid JSON get a placeholder error the caller
/// replaces).
fn build_all(
    enc: &Encoder,
    format: DataFormat,
    rows: &[read::RawRow],
) -> Vec<Result<DocBody, String>> {
    let build = |r: &read::RawRow| match &r.value {
        Ok(v) => build_doc(enc, format, v),
        Err(e) => Err(e.clone()),
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if threads == 1 || rows.len() < 256 {
        return rows.iter().map(build).collect();
    }
    let chunk = rows.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = rows
            .chunks(chunk)
            .map(|part| s.spawn(move || part.iter().map(build).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("tokenizer thread panicked"))
            .collect()
    })
}

#[cfg(test)]
pub(crate) mod tests;
