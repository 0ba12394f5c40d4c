//! `accrue bench data`: the data layer's numbers, one JSON object per row.
//! - `tokenize`: rows/s of building a token store (JSON parse, chat template,
//!   tokenization with offsets, loss masks, write) on every core, beside
//!   Hugging Face `datasets.map(batched=True, num_proc=2)` with the same
//!   tokenizer and template (`scripts/reference/bench_tokenize.py`, which
//!   also loads the JSON into Arrow), run interleaved (ours, reference,
//!   ours, …) so a change in machine load hits both; each side's best
//!   round is reported (timings on a shared machine only get slower);
//! - `submit`: for a synthetic dataset, the time from a spec to the first
//!   step plan handed to a worker (parse, admission reading the data through
//!   the cache, the core's submit, a worker's Ready) with a cold cache and a
//!   warm one, and the coordinator's anonymous resident memory per document
//!   afterwards (tokens are mapped, not resident). Each runs in a child
//!   process so one measurement's heap does not count in the next;
//! - `planner`: documents/s of planning steps from a 10-source mixture
//!   (interleave, selection, cursor advance, source-pure packing).
//!
//! Printing code, not domain logic.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use accrue_coordinator::core::{Coordinator, CoordinatorOptions, Event, Registration};
use accrue_coordinator::stream::cursor::{Cursor, Order, SourceOrder};
use accrue_coordinator::stream::plan::{self, PackItem, PackProblem, StepTarget};

/// What to run.
#[derive(Debug, Clone)]
pub struct DataBenchOpts {
    /// `shared/data` (dolly and the phi-3-mini tokenizer), if present.
    pub shared: Option<PathBuf>,
    /// Rows of the synthetic chat dataset.
    pub synthetic_rows: u64,
    /// The Python with `datasets` (or `None`: no reference rows).
    pub python: Option<PathBuf>,
    /// Scratch directory (datasets, caches).
    pub work: PathBuf,
    /// This binary, for the child measurements.
    pub exe: PathBuf,
}

/// The reference and the helper it imports, embedded so the benchmark runs
/// from any directory; written under the work directory.
const REFERENCE: &str = include_str!("../../../scripts/reference/bench_tokenize.py");
const REFERENCE_DEPS: &str = include_str!("../../../scripts/reference/_deps.py");

/// One output row.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct DataRow {
    pub bench: String,
    pub dataset: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_rows_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_anon_bytes_per_doc: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapped_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sources: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs_per_s: Option<f64>,
    /// Rounds each side ran (the best is reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounds: Option<u32>,
}

/// Writes `n` synthetic chat rows (`messages`: a user turn and an
/// assistant turn of a few dozen words) to `path`.
pub fn synthetic_chat(path: &Path, n: u64, seed: u64) -> std::io::Result<()> {
    const WORDS: &[&str] = &[
        "the",
        "model",
        "learns",
        "a",
        "mixture",
        "of",
        "sources",
        "token",
        "cache",
        "step",
        "document",
        "exactly",
        "once",
        "per",
        "epoch",
        "rust",
        "python",
        "loss",
        "weight",
        "coordinator",
        "worker",
        "plan",
        "memory",
        "mapped",
        "stream",
        "data",
        "eval",
        "source",
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    let sentence = |rng: &mut ChaCha8Rng, n: usize| -> String {
        (0..n)
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(" ")
    };
    for i in 0..n {
        let q = format!(
            "question {i}: {}?",
            sentence(&mut rng, 8 + (i % 17) as usize)
        );
        let a = sentence(&mut rng, 12 + (i % 41) as usize);
        let row = serde_json::json!({"messages": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": a},
        ]});
        serde_json::to_writer(&mut w, &row)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// The shared dolly file as chat rows (user: prompt, assistant: response),
/// repeated `times`.
fn dolly_chat(shared: &Path, out: &Path, times: usize) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(shared.join("sft/dolly_hhrlhf_train_small.jsonl"))?;
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    let mut n = 0;
    for _ in 0..times {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line)?;
            let row = serde_json::json!({"messages": [
                {"role": "user", "content": v["prompt"]},
                {"role": "assistant", "content": v["response"]},
            ]});
            serde_json::to_writer(&mut w, &row)?;
            w.write_all(b"\n")?;
            n += 1;
        }
    }
    w.flush()?;
    Ok(n)
}

/// A job spec over `file` with `tokenizer` and the cache at `cache`.
fn spec_text(file: &Path, tokenizer: &str, cache: &Path, out: &Path) -> String {
    format!(
        "[job]\nname = \"bench\"\nepochs = 1\noutput_dir = {out:?}\n\
         [model]\ninit = \"random\"\nconfig = {cfg:?}\n\
         [data]\ntrain = [{file:?}]\nformat = \"sft\"\ntokenizer = {tokenizer:?}\nmax_tokens = 4096\n\
         on_bad_line = \"skip\"\non_overlong = \"skip\"\ncache_dir = {cache:?}\n\
         [batch]\ndocs_per_step = 64\n",
        out = out.display().to_string(),
        cfg = out.with_extension("config.json").display().to_string(),
        file = file.display().to_string(),
        tokenizer = tokenizer,
        cache = cache.display().to_string(),
    )
}

/// Runs the benchmark, writing rows to `out` as they come.
pub fn data(opts: &DataBenchOpts, out: &mut dyn Write) -> anyhow::Result<Vec<DataRow>> {
    std::fs::create_dir_all(opts.work.join("reference"))?;
    let script = opts.work.join("reference/bench_tokenize.py");
    std::fs::write(&script, REFERENCE)?;
    std::fs::write(opts.work.join("reference/_deps.py"), REFERENCE_DEPS)?;
    let mut rows = Vec::new();
    let mut emit = |r: DataRow, out: &mut dyn Write| -> anyhow::Result<()> {
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
        out.flush()?;
        rows.push(r);
        Ok(())
    };
    let tokenizer = opts
        .shared
        .as_ref()
        .map(|s| s.join("tokenizers/phi-3-mini/tokenizer.json"))
        .filter(|t| t.is_file());
    let tok_arg = tokenizer
        .as_ref()
        .map_or_else(|| "bytes".to_string(), |t| t.display().to_string());
    let synth = opts.work.join("synthetic-chat.jsonl");
    if !synth.is_file() {
        synthetic_chat(&synth, opts.synthetic_rows, 0)?;
    }
    // Tokenization, ours then the reference's, per dataset.
    let mut sets: Vec<(String, PathBuf)> = Vec::new();
    if let Some(shared) = &opts.shared {
        for (name, times) in [("dolly-chat", 1), ("dolly-chat-x20", 20)] {
            let f = opts.work.join(format!("{name}.jsonl"));
            dolly_chat(shared, &f, times)?;
            sets.push((name.to_string(), f));
        }
    }
    sets.push((
        format!("synthetic-chat-{}", opts.synthetic_rows),
        synth.clone(),
    ));
    for (name, file) in &sets {
        // The large set once (minutes for the reference), the small ones
        // three times.
        let rounds = if std::fs::metadata(file)?.len() > 100 << 20 {
            1
        } else {
            3
        };
        let (mut n, mut best_secs) = (0, f64::INFINITY);
        let mut reference: Option<f64> = None;
        for _ in 0..rounds {
            let (rows, secs) = tokenize_ours(file, &tok_arg)?;
            (n, best_secs) = (rows, best_secs.min(secs));
            if let (Some(py), Some(tok)) = (&opts.python, &tokenizer) {
                if let Some(r) = reference_rate(py, &script, tok, file)? {
                    reference = Some(reference.map_or(r, |b| b.max(r)));
                }
            }
        }
        let ours = n as f64 / best_secs;
        emit(
            DataRow {
                bench: "tokenize".into(),
                dataset: name.clone(),
                rows: Some(n),
                rows_per_s: Some(ours),
                reference_rows_per_s: reference,
                ratio: reference.map(|r| ours / r),
                seconds: Some(best_secs),
                rounds: Some(rounds),
                ..Default::default()
            },
            out,
        )?;
    }
    // Submit to first step, cold then warm, and memory per document.
    let cache = opts.work.join("submit-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let runs = opts.work.join("runs");
    std::fs::create_dir_all(&runs)?;
    std::fs::write(
        runs.join("job.config.json"),
        r#"{"model_type": "llama", "vocab_size": 32064, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )?;
    let spec = runs.join("job.toml");
    std::fs::write(
        &spec,
        spec_text(&synth, &tok_arg, &cache, &runs.join("job")),
    )?;
    for state in ["cold", "warm"] {
        let child = Command::new(&opts.exe)
            .args(["bench", "data-submit-child"])
            .arg(&spec)
            .output()
            .context("running the submit child")?;
        anyhow::ensure!(
            child.status.success(),
            "submit child failed: {}",
            String::from_utf8_lossy(&child.stderr)
        );
        let mut row: DataRow = serde_json::from_slice(&child.stdout)
            .with_context(|| String::from_utf8_lossy(&child.stdout).into_owned())?;
        row.cache = Some(state.into());
        row.dataset = format!("synthetic-chat-{}", opts.synthetic_rows);
        emit(row, out)?;
    }
    emit(planner(10, 1_000_000, 256)?, out)?;
    Ok(rows)
}

/// Builds a store of `file` in a fresh cache; (rows, seconds).
fn tokenize_ours(file: &Path, tokenizer: &str) -> anyhow::Result<(u64, f64)> {
    let dir = tempfile::tempdir()?;
    let section: accrue_coordinator::job::data::DataSection = toml::from_str(&format!(
        "train = [{:?}]\nformat = \"sft\"\ntokenizer = {tokenizer:?}\n",
        file.display().to_string()
    ))?;
    let enc = accrue_coordinator::stream::data::encoder(&section, u32::MAX)?;
    let ekey = accrue_coordinator::stream::data::encoder_key(&section, u32::MAX, None)?;
    let key = accrue_coordinator::stream::data::cache::file_key(file, ekey)?;
    let t0 = Instant::now();
    let meta = accrue_coordinator::stream::data::cache::build(
        &dir.path().join("store"),
        &key,
        file,
        &enc,
        section.format,
        &|_| {},
    )?;
    Ok((meta.rows_read, t0.elapsed().as_secs_f64()))
}

fn reference_rate(
    py: &Path,
    script: &Path,
    tok: &Path,
    file: &Path,
) -> anyhow::Result<Option<f64>> {
    let out = Command::new(py)
        .arg(script)
        .arg(tok.parent().unwrap_or(Path::new(".")))
        .arg(file)
        .args(["--num-proc", "2"])
        .output()
        .context("running the datasets reference")?;
    if !out.status.success() {
        eprintln!("reference failed: {}", String::from_utf8_lossy(&out.stderr));
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or("{}");
    let v: serde_json::Value = serde_json::from_str(line)?;
    Ok(v["rows_per_s"].as_f64())
}

/// Anonymous resident memory of this process (`RssAnon`), in bytes.
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The child of a `submit` row: from the spec to the first plan sent, then
/// the resident memory per document. Prints one JSON row.
pub fn submit_child(spec_path: &Path) -> anyhow::Result<DataRow> {
    let base = rss_anon();
    let t0 = Instant::now();
    let text = std::fs::read_to_string(spec_path)?;
    let spec = accrue_coordinator::job::spec::JobSpec::parse(&text, Path::new("/"))
        .map_err(|p| anyhow::anyhow!("{}", problems(&p)))?;
    let admitted = accrue_coordinator::shell::admission::admit(&spec, true)
        .map_err(|p| anyhow::anyhow!("{}", problems(&p)))?;
    let ds = admitted.dataset.context("no dataset")?;
    let mapped = ds.report.tokens * 5;
    let docs: Arc<[accrue_coordinator::stream::doc::Document]> = ds.into_job_docs().into();
    let n = docs.len() as u64;
    let mut c = Coordinator::new(CoordinatorOptions::default());
    let now = 1_000;
    c.handle(
        Event::SubmitJob {
            id: "job".into(),
            spec: Arc::new(spec),
            spec_toml: String::new(),
            docs,
            start: None,
        },
        now,
    )?;
    let reg = Registration {
        hostname: "h".into(),
        collective_addr: "127.0.0.1:1".into(),
        ..Default::default()
    };
    c.handle(
        Event::RegisterWorker {
            id: "w".into(),
            reg,
        },
        now,
    )?;
    let fx = c.handle(Event::SessionOpened { worker: "w".into() }, now)?;
    let generation = fx
        .then()
        .iter()
        .find_map(|f| match f {
            accrue_coordinator::core::Effect::Send {
                msg: accrue_coordinator::core::ToWorker::Configure { generation, .. },
                ..
            } => Some(*generation),
            _ => None,
        })
        .context("no Configure sent")?;
    let fx = c.handle(
        Event::Ready {
            worker: "w".into(),
            job: "job".into(),
            generation,
            step: 0,
        },
        now,
    )?;
    let planned = fx.then().iter().any(|f| {
        matches!(
            f,
            accrue_coordinator::core::Effect::Send {
                msg: accrue_coordinator::core::ToWorker::Plan { .. },
                ..
            }
        )
    });
    anyhow::ensure!(planned, "no plan sent after Ready");
    let secs = t0.elapsed().as_secs_f64();
    let grown = rss_anon().saturating_sub(base);
    Ok(DataRow {
        bench: "submit".into(),
        seconds: Some(secs),
        docs: Some(n),
        rss_anon_bytes_per_doc: Some(grown as f64 / n.max(1) as f64),
        mapped_bytes: Some(mapped),
        ..Default::default()
    })
}

/// Documents/s of planning steps of `docs_per_step` from a mixture of
/// `sources` sources over `docs` documents: interleave, select, advance the
/// cursor, pack (one source per microbatch) for 8 ranks.
pub fn planner(sources: u32, docs: u64, docs_per_step: u64) -> anyhow::Result<DataRow> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let lens: Vec<u32> = (0..docs).map(|_| rng.random_range(32..1024)).collect();
    let per = docs / u64::from(sources);
    let parts: Vec<SourceOrder> = (0..sources)
        .map(|s| SourceOrder {
            start: u64::from(s) * per,
            len: per,
            epochs: None,
        })
        .collect();
    let weights: Vec<f64> = (0..sources).map(|s| 1.0 + f64::from(s)).collect();
    let order = Order::mixture(1, true, parts, weights);
    let max_tokens = 8192;
    let target = StepTarget::new(
        accrue_coordinator::job::batch::StepSize::Docs(docs_per_step),
        8,
        max_tokens,
    );
    let mut cursor = Cursor::default();
    let steps = 2000;
    let t0 = Instant::now();
    let mut planned = 0u64;
    for _ in 0..steps {
        let mut offered = Vec::new();
        let candidates = order.candidates(&cursor).map(|c| {
            offered.push(c.index);
            u64::from(lens[c.index as usize])
        });
        let sel = plan::select(target, candidates);
        let items: Vec<PackItem> = sel
            .taken
            .iter()
            .map(|&i| PackItem {
                doc: i,
                seq_lens: plan::SeqLens::one(lens[offered[i] as usize]),
                loss_tokens: u64::from(lens[offered[i] as usize]) / 2,
                is_pair: false,
            })
            .collect();
        let groups = sel
            .taken
            .iter()
            .map(|&i| order.source_of(offered[i]) as u32)
            .collect();
        let problem = PackProblem {
            items,
            max_tokens,
            world_size: 8,
            min_microbatches_per_rank: 1,
            groups,
        };
        let solution = plan::solve(&problem)?;
        planned += solution.normalizers.documents;
        cursor = order.advance(&cursor, &sel);
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(DataRow {
        bench: "planner".into(),
        dataset: format!("synthetic, {docs} docs"),
        sources: Some(sources),
        docs_per_step: Some(docs_per_step),
        docs: Some(planned),
        seconds: Some(secs),
        docs_per_s: Some(planned as f64 / secs),
        ..Default::default()
    })
}

/// Spec problems, one per line, as `accrue validate` prints them.
fn problems(p: &[accrue_coordinator::job::section::SpecProblem]) -> String {
    p.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner row plans whole steps from every source.
    #[test]
    fn the_planner_row_plans_whole_steps() {
        let r = planner(3, 30_000, 32).unwrap();
        assert_eq!(r.docs, Some(2000 * 32));
        assert!(r.docs_per_s.unwrap() > 0.0);
    }

    /// The submit child gets from a spec over synthetic rows to a first
    /// plan, cold then warm, and measures memory per document.
    #[test]
    fn the_submit_child_reaches_a_first_plan_cold_and_warm() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let synth = d.join("s.jsonl");
        synthetic_chat(&synth, 500, 0).unwrap();
        let text = std::fs::read_to_string(&synth).unwrap();
        assert_eq!(text.lines().count(), 500);
        std::fs::write(d.join("job.config.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
        let spec = d.join("job.toml");
        std::fs::write(
            &spec,
            spec_text(&synth, "bytes", &d.join("cache"), &d.join("job")),
        )
        .unwrap();
        for _ in 0..2 {
            let r = submit_child(&spec).unwrap();
            assert_eq!((r.bench.as_str(), r.docs), ("submit", Some(500)));
            assert!(r.seconds.unwrap() > 0.0 && r.mapped_bytes.unwrap() > 0);
        }
    }
}
