//! Admission: the checks that read what a parsed spec points at. `accrue
//! validate` and `submit` both run [`admit`], so they say the same thing:
//! - the model ([`crate::model::config`]): its config's `vocab_size`, and a
//!   `model.init` checkpoint complete and intact;
//! - the tokenizer against the model: `vocab_size` must hold every id the
//!   tokenizer makes, special and added tokens included (the byte
//!   tokenizer's BOS/EOS/PAD are 256–258). A smaller embedding used to
//!   crash the worker's trainer on the first lookup past its end while the
//!   job showed "running, step 0";
//! - the data, when scanned: read and tokenized by the readers the job
//!   will train from (`crate::stream::data`), every bad row named by `file:line`,
//!   and the step size checked against what the dataset holds
//!   ([`crate::job::limits`]).

use std::path::Path;

use crate::job::limits::{self, DatasetSize};
use crate::job::section::SpecProblem;
use crate::job::spec::JobSpec;
use crate::model::config::{self, ModelConfig};
use crate::stream::data::{self, DataError, Dataset};

/// What admission read: the model's config and, when the data was
/// scanned, the dataset (a streamed job has none).
#[derive(Debug)]
pub struct Admitted {
    pub model: ModelConfig,
    pub dataset: Option<Dataset>,
}

/// Runs every admission check on a parsed (validated) spec; with
/// `scan_data`, reads the whole dataset too. Every problem comes back with
/// its spec field.
pub fn admit(spec: &JobSpec, scan_data: bool) -> Result<Admitted, Vec<SpecProblem>> {
    let mut problems = Vec::new();
    let model = match config::check(&spec.model) {
        Ok(m) => Some(m),
        Err(p) => {
            problems.extend(p);
            None
        }
    };
    // Without a model config the data is still checked, bounded by nothing.
    let vocab = model.as_ref().map_or(u32::MAX, |m| m.vocab_size);
    let dataset = match data::encoder(&spec.data, vocab) {
        Err(e) => {
            problems.push(data_problem(spec, &e));
            None
        }
        Ok(enc) => {
            let tokenizer_ids = enc.tok.vocab_size();
            if let Some(m) = model.as_ref().filter(|m| m.vocab_size < tokenizer_ids) {
                problems.push(vocab_problem(spec, m, tokenizer_ids));
            }
            if scan_data && spec.data.is_generate() {
                let vocab = model.as_ref().map_or(u32::MAX, |m| m.vocab_size);
                if let Err(e) = crate::rl::scorer::Scorer::load(spec, vocab, None) {
                    problems.push(loop_problem(spec, &e));
                }
            }
            // A served job's calls are chat messages: its template must be
            // there (the tokenizer's, data.chat_template, or the default).
            if spec.rl.serve.is_some() {
                if let Err(e) = enc.template.require() {
                    problems.push(SpecProblem::new(
                        "rl.serve",
                        format!("the endpoint renders chat messages: {e}"),
                    ));
                }
            }
            if scan_data && !spec.data.is_stream() {
                match data::load_job(&enc, spec, &|_, _| {}) {
                    Ok(ds) => Some(ds),
                    Err(e) => {
                        problems.push(data_problem(spec, &e));
                        None
                    }
                }
            } else {
                None
            }
        }
    };
    if let Some(m) = model.as_ref() {
        let replay = spec.rl.routing_replay == Some(true);
        if replay && m.routing_width.is_none() {
            problems.push(SpecProblem::new(
                "rl.routing_replay",
                format!(
                    "the model ({}) has no experts: routing replay is for mixture-of-experts models",
                    m.path.display()
                ),
            ));
        }
    }
    if let Some(m) = model.as_ref().filter(|_| spec.parallel.context > 1) {
        // The attention split over a group is causal within documents:
        // windowed layers and expert routing are not split yet.
        let windowed = m.arch.layers.iter().any(|l| l.window.is_some());
        let what = match (m.arch.moe.is_some(), windowed) {
            (true, _) => Some("mixture-of-experts layers"),
            (false, true) => Some("sliding-window attention layers"),
            (false, false) => None,
        };
        if let Some(what) = what {
            problems.push(SpecProblem::new(
                "parallel.context",
                format!(
                    "the model ({}) has {what}, which context parallelism does not split yet",
                    m.path.display()
                ),
            ));
        }
    }
    if let Some(lora) = spec.lora.as_ref() {
        lora.check_init(&mut |f, m| problems.push(SpecProblem::new(f, m)));
    }
    if let (Some(m), Some(lora)) = (model.as_ref(), spec.lora.as_ref()) {
        if let Err(e) = accrue_arch::lora::resolve(&m.arch, &lora.target_modules.targets()) {
            problems.push(SpecProblem::new(
                "lora.target_modules",
                format!("{e} ({})", m.path.display()),
            ));
        }
    }
    if let Some(ds) = &dataset {
        let size = DatasetSize {
            docs: ds.docs.len() as u64,
            tokens: ds.report.tokens,
        };
        limits::check_against_dataset(&spec.step_shape(), size, &mut |f, m| {
            problems.push(SpecProblem::new(f, m));
        });
    }
    match model {
        Some(model) if problems.is_empty() => Ok(Admitted { model, dataset }),
        _ => Err(problems),
    }
}

fn vocab_problem(spec: &JobSpec, m: &ModelConfig, tokenizer_ids: u32) -> SpecProblem {
    let tokenizer = if spec.data.is_byte_tokenizer() {
        "the byte tokenizer's".to_string()
    } else {
        format!("the tokenizer {}'s", spec.data.tokenizer)
    };
    SpecProblem::new(
        m.field,
        format!(
            "vocab_size = {} in {} cannot hold {tokenizer} {tokenizer_ids} token ids \
             (special tokens included): every id must be below vocab_size, so it must be at \
             least {tokenizer_ids}",
            m.vocab_size,
            m.path.display()
        ),
    )
}

/// A problem of the RL loop's prompts, stop strings or verifier.
fn loop_problem(spec: &JobSpec, e: &crate::rl::scorer::LoopError) -> SpecProblem {
    use crate::rl::scorer::LoopError;
    match e {
        LoopError::Data(d) => data_problem(spec, d),
        LoopError::Stop { index, .. } => {
            SpecProblem::new(format!("rl.sampling.stop[{index}]"), e.to_string())
        }
        LoopError::Verify(_) | LoopError::Round { .. } | LoopError::Scoring { .. } => {
            SpecProblem::new("rl.verifier", e.to_string())
        }
        LoopError::Env { .. } => SpecProblem::new("rl.env", e.to_string()),
    }
}

/// A data error as a problem of the spec field that names the file at
/// fault (the tokenizer, the template, a dataset file), else `data`.
fn data_problem(spec: &JobSpec, e: &DataError) -> SpecProblem {
    let field = match e {
        DataError::Tokenizer { .. } => "data.tokenizer".to_string(),
        DataError::Template { .. } | DataError::NoChatTemplate { .. } => {
            "data.chat_template".to_string()
        }
        DataError::FormatMismatch { .. } => "data.format".to_string(),
        DataError::Input(i) => field_of_path(spec, i.path()),
        DataError::Io { path, .. } | DataError::Changed { path } => field_of_path(spec, path),
        DataError::Json { at, .. } | DataError::Row { at, .. } | DataError::Overlong { at, .. } => {
            field_of_path(spec, &at.path)
        }
        DataError::NoDocuments { .. } => "data.train".to_string(),
    };
    SpecProblem::new(field, e.to_string())
}

fn field_of_path(spec: &JobSpec, path: &Path) -> String {
    let d = &spec.data;
    if let Some(i) = d.train.iter().position(|f| f == path) {
        return format!("data.train[{i}]");
    }
    if let Some(i) = spec.rl.eval_prompts.iter().position(|f| f == path) {
        return format!("rl.eval_prompts[{i}]");
    }
    for (i, src) in d.sources.iter().enumerate() {
        if let Some(j) = src.entries().position(|f| f == path) {
            return format!("data.sources[{i}].paths[{j}]");
        }
        if src.chat_template.as_deref() == Some(path) {
            return format!("data.sources[{i}].chat_template");
        }
    }
    if d.chat_template.as_deref() == Some(path) {
        return "data.chat_template".into();
    }
    if !d.is_byte_tokenizer() && Path::new(&d.tokenizer) == path {
        return "data.tokenizer".into();
    }
    "data".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, vocab: u32, batch: &str, rows: &str) -> JobSpec {
        std::fs::write(
            dir.join("tiny.json"),
            crate::model::config::tests::tiny(vocab),
        )
        .unwrap();
        std::fs::write(dir.join("train.jsonl"), rows).unwrap();
        let text = format!(
            "[job]\nname = \"t\"\nsteps = 3\noutput_dir = \"out\"\n\
             [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
             [data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n[batch]\n{batch}\n"
        );
        JobSpec::parse(&text, dir).unwrap()
    }

    const ROWS: &str = "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n\
                        {\"prompt\": \"2+2=\", \"completion\": \"4\"}\n";

    /// Issue 14 item 1: a model whose vocab_size is below the byte
    /// tokenizer's 259 ids passed validate and submit, then hung the job.
    #[test]
    fn a_model_vocab_below_the_tokenizers_ids_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), 100, "docs_per_step = 1", ROWS);
        let p = admit(&s, false).unwrap_err();
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].field, "model.config");
        assert!(
            p[0].message.starts_with(&format!(
                "vocab_size = 100 in {} cannot hold the byte tokenizer's 259 token ids",
                dir.path().join("tiny.json").display()
            )),
            "{}",
            p[0].message
        );
        let s = spec(dir.path(), 259, "docs_per_step = 1", ROWS);
        let ok = admit(&s, true).unwrap();
        assert_eq!(ok.model.vocab_size, 259);
        assert_eq!(ok.dataset.unwrap().docs.len(), 2);
    }

    /// A real HF tokenizer (phi-3-mini: 32011 ids, added tokens included)
    /// against the model: its own config's 32064 holds them, 32000 (the
    /// base vocabulary without the chat tokens) does not.
    #[test]
    fn a_hf_tokenizers_added_tokens_count() {
        let Some(shared) = crate::stream::data::tests::shared_data() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let tok = shared.join("tokenizers/phi-3-mini/tokenizer.json");
        let with_tok = |vocab| {
            let mut s = spec(dir.path(), vocab, "docs_per_step = 1", ROWS);
            s.data.tokenizer = tok.display().to_string();
            s
        };
        let ok = admit(&with_tok(32064), true).unwrap();
        assert_eq!(ok.dataset.unwrap().tokenizer_vocab, 32011);
        let p = admit(&with_tok(32000), false).unwrap_err();
        assert_eq!(p[0].field, "model.config");
        assert!(
            p[0].message.contains(&format!(
                "cannot hold the tokenizer {}'s 32011 token ids",
                tok.display()
            )),
            "{}",
            p[0].message
        );
    }

    /// Context parallelism does not split expert routing or windowed
    /// attention yet: such a model is refused naming the field and file.
    #[test]
    fn context_parallelism_refuses_what_it_does_not_split() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(dir.path(), 320, "docs_per_step = 1", ROWS);
        s.parallel.context = 2;
        assert!(admit(&s, false).is_ok(), "a dense model");
        let configs = [
            (
                r#"{"model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}"#,
                "mixture-of-experts",
            ),
            (
                r#"{"model_type": "mistral", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 16}"#,
                "sliding-window",
            ),
        ];
        for (config, what) in configs {
            std::fs::write(dir.path().join("tiny.json"), config).unwrap();
            let p = admit(&s, false).unwrap_err();
            assert_eq!(p.len(), 1, "{p:?}");
            assert_eq!(p[0].field, "parallel.context");
            assert!(
                p[0].message.contains(what) && p[0].message.contains("tiny.json"),
                "{}",
                p[0].message
            );
        }
        s.parallel.context = 1;
        assert!(admit(&s, false).is_ok(), "without context parallelism");
    }

    #[test]
    fn a_scan_names_the_bad_line_and_checks_the_step_against_the_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), 320, "docs_per_step = 3", ROWS);
        assert!(admit(&s, false).is_ok(), "no scan, no dataset check");
        let p = admit(&s, true).unwrap_err();
        assert_eq!(p[0].field, "batch.docs_per_step");
        assert!(
            p[0].message.starts_with("3 is more than the 2 documents"),
            "{p:?}"
        );
        let s = spec(
            dir.path(),
            320,
            "docs_per_step = 1",
            &format!("{ROWS}{{\"prompt\": 1}}\n"),
        );
        let p = admit(&s, true).unwrap_err();
        assert_eq!(p[0].field, "data.train[0]");
        assert!(p[0].message.contains("train.jsonl:3: "), "{p:?}");
    }
}
