//! A job's data sources: `[[data.sources]]` (a mixture) or the plain
//! `data.train` list (one source named `train`), and `[[eval.sources]]`.
//! One owner: the planner, the loaders, metrics and manifests ask
//! [`resolve`] which files a source holds and how it mixes.
//!
//! A source's documents are identified as always by `file:line`, where
//! `file` indexes the job's file list: the sources' files in order (after
//! directories and globs were expanded at submit), so a document's source
//! follows from its id.

use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::job::limits;
use crate::job::section::check_file;

/// One `[[data.sources]]` (or `[[eval.sources]]`) entry as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SourceSpec {
    /// Shown in metrics and manifests; default: the first file's stem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// One file, directory or glob ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// ... or several.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathBuf>,
    /// Relative share of the stream (normalised over the live sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// Share of the stream in (0, 1]; the fractions of a job sum to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// Documents of this source in every step (docs_per_step jobs: their
    /// sum is `batch.docs_per_step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs: Option<u64>,
    /// Passes over this source (default: `job.epochs`; endless under
    /// `job.steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    /// Only the first this many documents of the source (file order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_docs: Option<u64>,
    /// A chat template file for this source's rows (else `data.chat_template`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// Which split a directory entry keeps when its files are named by
    /// split (`train-00000-of-00002.parquet`, `test.jsonl`): default
    /// `train` (`test` for eval sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
}

impl SourceSpec {
    /// Every entry of `path` and `paths`.
    pub fn entries(&self) -> impl Iterator<Item = &PathBuf> {
        self.path.iter().chain(&self.paths)
    }

    pub fn entries_mut(&mut self) -> impl Iterator<Item = &mut PathBuf> {
        self.path.iter_mut().chain(self.paths.iter_mut())
    }
}

/// `[eval]`: a forward-only pass over its own sources every N steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EvalSection {
    /// Run after every N-th committed step (and after the last).
    pub every_steps: u64,
    pub sources: Vec<SourceSpec>,
}

impl EvalSection {
    /// The checks of `[eval]` alone (paths already resolved); how it fits
    /// the training job is `rules::eval_fits_training`.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.every_steps == 0 {
            bad("eval.every_steps", "must be at least 1".into());
        }
        if self.sources.is_empty() {
            bad("eval.sources", "list at least one eval source".into());
        }
        validate(&self.sources, "eval.sources", true, bad);
        // Eval sources fill no step (None): docs given to one are refused here too.
        validate_docs(&self.sources, "eval.sources", None, bad);
        for (i, s) in self.sources.iter().enumerate() {
            for (j, f) in s.entries().enumerate() {
                check_file(bad, &format!("eval.sources[{i}].paths[{j}]"), f);
            }
            if s.epochs.is_some() {
                bad(
                    &format!("eval.sources[{i}].epochs"),
                    "an eval source is read once per evaluation".into(),
                );
            }
        }
    }
}

/// A source resolved against the job: its files in the job's file list
/// and how it mixes.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub name: String,
    /// Indices into the job's file list.
    pub files: Range<u32>,
    /// Relative weight (> 0).
    pub weight: f64,
    pub epochs: Option<u64>,
    pub max_docs: Option<u64>,
    pub chat_template: Option<PathBuf>,
}

/// The sources of a list of entries whose files start at `first_file`.
/// Weights: `weight`, else `fraction`, else `docs`, else 1.
pub fn resolve(specs: &[SourceSpec], first_file: u32, job_epochs: Option<u64>) -> Vec<Source> {
    let mut next = first_file;
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.entries().count() as u32;
            let files = next..next + n;
            next += n;
            Source {
                name: name_of(s, i),
                files,
                weight: s
                    .weight
                    .or(s.fraction)
                    .or(s.docs.map(|d| d as f64))
                    .unwrap_or(1.0),
                epochs: s.epochs.or(job_epochs),
                max_docs: s.max_docs,
                chat_template: s.chat_template.clone(),
            }
        })
        .collect()
}

/// A source's name: given, else its first file's stem, else `source-i`.
pub fn name_of(s: &SourceSpec, i: usize) -> String {
    if let Some(n) = &s.name {
        return n.clone();
    }
    s.entries()
        .next()
        .and_then(|p| p.file_name())
        .map(|n| {
            let n = n.to_string_lossy();
            n.split('.').next().unwrap_or(&n).to_string()
        })
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| format!("source-{i}"))
}

/// The source of each file of the list (index = file).
pub fn file_sources(sources: &[Source]) -> Vec<u32> {
    let mut out = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        out.extend(s.files.clone().map(|_| i as u32));
    }
    out
}

/// Checks a list of source specs (`field` = `data.sources` or
/// `eval.sources`), every problem with its path; their docs per step
/// against the step's are [`validate_docs`].
pub fn validate(specs: &[SourceSpec], field: &str, eval: bool, bad: &mut impl FnMut(&str, String)) {
    let mut names = std::collections::BTreeSet::new();
    for (i, s) in specs.iter().enumerate() {
        let at = |f: &str| format!("{field}[{i}].{f}");
        if s.entries().next().is_none() {
            bad(&format!("{field}[{i}]"), "give path or paths".into());
        }
        for (j, p) in s.entries().enumerate() {
            if p.as_os_str().is_empty() {
                bad(
                    &format!("{field}[{i}].paths[{j}]"),
                    "must not be empty".into(),
                );
            }
        }
        let name = name_of(s, i);
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bad(
                &at("name"),
                format!("{name:?} may contain only ASCII letters, digits, '-', '_' and '.'"),
            );
        }
        if !names.insert(name.clone()) {
            bad(&at("name"), format!("{name:?} names two sources"));
        }
        let given = [s.weight.is_some(), s.fraction.is_some(), s.docs.is_some()]
            .iter()
            .filter(|&&x| x)
            .count();
        if eval && given > 0 {
            bad(
                &format!("{field}[{i}]"),
                "an eval source has no weight: every document is evaluated".into(),
            );
        }
        if given > 1 {
            bad(
                &format!("{field}[{i}]"),
                "give at most one of weight, fraction, docs".into(),
            );
        }
        if let Some(w) = s.weight {
            if !(w.is_finite() && w > 0.0) {
                bad(&at("weight"), format!("must be a positive number, got {w}"));
            }
        }
        if let Some(f) = s.fraction {
            if !(f.is_finite() && f > 0.0 && f <= 1.0) {
                bad(&at("fraction"), format!("must be in (0, 1], got {f}"));
            }
        }
        if s.docs == Some(0) {
            bad(&at("docs"), "must be at least 1".into());
        }
        if s.epochs == Some(0) {
            bad(&at("epochs"), "must be at least 1".into());
        }
        if let Some(e) = s.epochs {
            if let Some(m) = limits::over(e, limits::MAX_EPOCHS, "epochs") {
                bad(&at("epochs"), m);
            }
        }
        if s.max_docs == Some(0) {
            bad(&at("max_docs"), "must be at least 1".into());
        }
    }
    let kinds = |f: fn(&SourceSpec) -> bool| specs.iter().filter(|s| f(s)).count();
    let (weights, fractions, docs) = (
        kinds(|s| s.weight.is_some()),
        kinds(|s| s.fraction.is_some()),
        kinds(|s| s.docs.is_some()),
    );
    let mixed = [weights, fractions, docs]
        .iter()
        .filter(|&&n| n > 0)
        .count();
    if mixed > 1 {
        bad(
            field,
            "mix sources by one of weight, fraction or docs, the same for every source".into(),
        );
    }
    if fractions > 0 && fractions < specs.len() {
        bad(field, "give every source a fraction, or none".into());
    }
    if fractions == specs.len() && fractions > 0 {
        let sum: f64 = specs.iter().filter_map(|s| s.fraction).sum();
        if (sum - 1.0).abs() > 1e-6 {
            bad(field, format!("the fractions sum to {sum}, not 1"));
        }
    }
}

/// Sources mixed by `docs` per step: every source gives them, and they sum
/// to `batch.docs_per_step`.
pub fn validate_docs(
    specs: &[SourceSpec],
    field: &str,
    docs_per_step: Option<u64>,
    bad: &mut impl FnMut(&str, String),
) {
    let docs = specs.iter().filter(|s| s.docs.is_some()).count();
    if docs > 0 {
        if docs < specs.len() {
            bad(field, "give every source its docs per step, or none".into());
        }
        let sum: u64 = specs.iter().filter_map(|s| s.docs).sum();
        match docs_per_step {
            Some(n) if n == sum => {}
            Some(n) => bad(
                field,
                format!("the sources' docs sum to {sum}, but batch.docs_per_step = {n}"),
            ),
            None => bad(
                field,
                "docs per source needs batch.docs_per_step (their sum)".into(),
            ),
        }
    }
}
