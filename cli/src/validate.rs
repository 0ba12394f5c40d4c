//! `accrue validate JOB.toml`: checks a job spec offline with what the
//! coordinator runs on submit — [`JobSpec::parse`], then
//! [`accrue_coordinator::shell::admission::admit`] (the model's config against the tokenizer,
//! a `model.init` checkpoint whole, and the data read by the job's own
//! readers) — and prints every problem as `JOB.toml: <field>: <message>`,
//! like a compiler.
//!
//! The data is read when it is small ([`AUTO_SCAN_BYTES`] on disk in all:
//! a few seconds of tokenizing) or already in the token cache (then reading
//! is opening the stores), always with `--data`, never with `--no-data`;
//! when read, every source (and eval source) is reported: documents,
//! tokens, rows skipped as bad and documents skipped as over-long.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use accrue_coordinator::job::batch::StepSize;
use accrue_coordinator::job::input::{self, MAX_CONFIG_BYTES};
use accrue_coordinator::job::section::SpecProblem;
use accrue_coordinator::job::spec::JobSpec;
use accrue_coordinator::shell::admission::{self, Admitted};

/// `data.train` files up to this many bytes in all are read by default.
pub const AUTO_SCAN_BYTES: u64 = 16 << 20;

/// Whether `validate` reads the dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataScan {
    /// When its files hold at most [`AUTO_SCAN_BYTES`].
    #[default]
    Auto,
    Always,
    Never,
}

impl DataScan {
    /// Whether to read `spec`'s data; `Err` names the size when `Auto`
    /// decides against it.
    fn decide(self, spec: &JobSpec) -> Result<bool, u64> {
        match self {
            DataScan::Always => Ok(true),
            DataScan::Never => Ok(false),
            DataScan::Auto => {
                // Files that cannot be stat'ed were reported by parse.
                let files = all_files(spec);
                let bytes: u64 = files.iter().filter_map(|f| input::check(f).ok()).sum();
                if bytes <= AUTO_SCAN_BYTES || all_cached(spec, &files) {
                    Ok(true)
                } else {
                    Err(bytes)
                }
            }
        }
    }
}

/// Every data file of the job: training sources, then eval sources.
fn all_files(spec: &JobSpec) -> Vec<std::path::PathBuf> {
    let mut files = spec.data.files();
    if let Some(e) = &spec.eval {
        files.extend(e.sources.iter().flat_map(|s| s.entries().cloned()));
    }
    files
}

/// Whether every file already has its token store (so reading the data is
/// opening the stores). Sources with their own template count as uncached.
fn all_cached(spec: &JobSpec, files: &[std::path::PathBuf]) -> bool {
    if spec.data.sources.iter().any(|s| s.chat_template.is_some()) {
        return false;
    }
    let Ok(model) = accrue_coordinator::model::config::read_config(&spec.model) else {
        return false;
    };
    let Ok(enc) = accrue_coordinator::stream::data::encoder_key(&spec.data, model.vocab_size, None)
    else {
        return false;
    };
    let root = spec.data.cache_root();
    files.iter().all(|f| {
        accrue_coordinator::stream::data::cache::file_key(f, enc)
            .is_ok_and(|k| root.join(k.key).join("meta.json").is_file())
    })
}

/// Validates the spec text; `label` prefixes every problem line (usually the
/// path the user typed). Ok: the `ok: <name>` line and a summary. Err: one
/// line per problem.
pub fn check(
    label: &str,
    text: &str,
    base_dir: &Path,
    scan: DataScan,
) -> Result<Vec<String>, Vec<String>> {
    let lines = |problems: Vec<SpecProblem>| {
        problems
            .iter()
            .map(|p| format!("{label}: {}: {}", p.field, p.message))
            .collect::<Vec<_>>()
    };
    let spec = JobSpec::parse(text, base_dir).map_err(lines)?;
    let scanned = scan.decide(&spec);
    let admitted = admission::admit(&spec, scanned.is_ok_and(|s| s)).map_err(lines)?;
    let mut out = vec![
        format!("ok: {}", spec.job.name),
        format!("  {}", summary(&spec, base_dir)),
        format!("  {}", checked(&spec, &admitted, scanned)),
    ];
    if let Some(d) = &admitted.dataset {
        out.extend(per_source("source", d));
        if let Some(e) = &d.eval {
            out.extend(per_source("eval source", e));
        }
    }
    Ok(out)
}

/// `  source a: 48 documents, 5120 tokens (50 rows; 2 bad rows and 0
/// over-long documents skipped)`, one line per source.
fn per_source(what: &str, d: &accrue_coordinator::stream::data::Dataset) -> Vec<String> {
    d.sources
        .iter()
        .map(|(_, s)| {
            format!(
                "  {what} {}: {} documents, {} tokens ({} rows; {} bad rows and {} over-long documents skipped)",
                s.name, s.docs, s.tokens, s.rows, s.bad_lines_skipped, s.overlong_skipped
            )
        })
        .collect()
}

/// `model vocab 320 · data: 40 documents, 1234 tokens read`
fn checked(spec: &JobSpec, a: &Admitted, scanned: Result<bool, u64>) -> String {
    let data = match (&a.dataset, scanned) {
        (Some(d), _) => format!(
            "{} documents, {} tokens read",
            d.docs.len(),
            d.report.tokens
        ),
        _ if spec.data.is_generate() => "prompts (generated rollouts)".into(),
        _ if spec.data.is_stream() => "streamed".into(),
        (None, Err(bytes)) => format!(
            "not read ({} MiB, more than {} MiB: pass --data to read it)",
            bytes >> 20,
            AUTO_SCAN_BYTES >> 20
        ),
        (None, _) => "not read (--no-data)".into(),
    };
    format!("model vocab {} · data: {data}", a.model.vocab_size)
}

/// `sft · 64 docs per step · 100 steps · ddp, 1-8 workers · data: train.jsonl`
pub fn summary(spec: &JobSpec, base_dir: &Path) -> String {
    let step = match spec.step_size() {
        StepSize::Docs(n) => format!("{n} docs per step"),
        StepSize::Tokens(t) => format!("~{t} tokens per step"),
        StepSize::MicrobatchesPerRank(k) => format!("{k} microbatches per rank per step"),
    };
    let length = match (spec.job.steps, spec.job.epochs) {
        (Some(s), _) => format!("{s} steps"),
        (_, Some(e)) => format!("{e} epochs"),
        _ => "unbounded".into(),
    };
    let files: Vec<String> = spec
        .data
        .files()
        .iter()
        .map(|f| f.strip_prefix(base_dir).unwrap_or(f).display().to_string())
        .collect();
    let objective = spec.objective.kind.to_string();
    let sharding = spec.parallel.sharding.to_string();
    format!(
        "{objective} · {step} · {length} · {sharding}, {}-{} workers · data: {}",
        spec.parallel.min_workers,
        spec.parallel.max_workers,
        files.join(", ")
    )
}

/// Runs the command: reads `path`, resolves relative paths in the spec
/// against `base_dir`, writes the verdict to `out` (ok) or `err` (problems).
/// Exit 0 when valid, 1 when not; an unreadable file is an `Err`.
pub fn run(
    path: &Path,
    base_dir: &Path,
    scan: DataScan,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let text = input::read_spec(path, MAX_CONFIG_BYTES)?;
    match check(&path.display().to_string(), &text, base_dir, scan) {
        Ok(lines) => {
            for l in lines {
                writeln!(out, "{l}")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(lines) => {
            for l in lines {
                writeln!(err, "{l}")?;
            }
            Ok(ExitCode::FAILURE)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The issue's example spec (as in spec.rs's tests); needs `tiny.json`
    /// and `train.jsonl` next to it.
    pub(crate) const GOOD: &str = r#"
[job]
name = "sft-demo"
seed = 1234
steps = 100
output_dir = "runs/sft-demo"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["train.jsonl"]
format = "sft"
[batch]
docs_per_step = 64
[objective]
kind = "sft"
[optimizer]
lr = 1e-4
betas = [0.9, 0.95]
[parallel]
sharding = "ddp"
min_workers = 1
max_workers = 8
"#;

    /// 64 rows of one document each (GOOD takes 64 per step).
    fn rows() -> String {
        (0..64)
            .map(|i| {
                format!(
                    "{{\"prompt\": \"{i}+1=\", \"completion\": \"{}\"}}\n",
                    i + 1
                )
            })
            .collect()
    }

    fn fixture(spec: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tiny.json"),
            r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("train.jsonl"), rows()).unwrap();
        let path = dir.path().join("job.toml");
        std::fs::write(&path, spec).unwrap();
        (dir, path)
    }

    fn run_to_strings(path: &Path, base: &Path) -> (ExitCode, String, String) {
        run_scan(path, base, DataScan::Auto)
    }

    fn run_scan(path: &Path, base: &Path, scan: DataScan) -> (ExitCode, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(path, base, scan, &mut out, &mut err).unwrap();
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn good_spec_prints_ok_and_a_summary_and_exits_0() {
        let (dir, path) = fixture(GOOD);
        let (code, out, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::SUCCESS);
        assert_eq!(err, "");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "ok: sft-demo");
        assert_eq!(
            lines[1],
            "  sft · 64 docs per step · 100 steps · ddp, 1-8 workers · data: train.jsonl"
        );
        assert!(
            lines[2].starts_with("  model vocab 320 · data: 64 documents, "),
            "{out}"
        );
        let (code, out, _) = run_scan(&path, dir.path(), DataScan::Never);
        assert_eq!(code, ExitCode::SUCCESS);
        assert!(out.ends_with("data: not read (--no-data)\n"), "{out}");
    }

    /// Issue 14 item 1: a model whose vocab_size cannot hold the
    /// tokenizer's ids passed validate; the worker then crashed.
    #[test]
    fn a_model_vocab_below_the_tokenizer_fails_validate_naming_field_and_numbers() {
        let (dir, path) = fixture(GOOD);
        std::fs::write(
            dir.path().join("tiny.json"),
            r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}"#,
        )
        .unwrap();
        let (code, out, err) = run_scan(&path, dir.path(), DataScan::Never);
        assert_eq!(code, ExitCode::FAILURE, "{out}");
        let want = format!(
            "{}: model.config: vocab_size = 100 in {} cannot hold the byte tokenizer's 259 token ids",
            path.display(),
            dir.path().join("tiny.json").display()
        );
        assert!(err.starts_with(&want), "{err}");
    }

    /// Issue 14 items 1 and 2: the data is read by the job's own readers
    /// (bad rows by file:line), and a step larger than the dataset, or over
    /// the limits, is refused.
    #[test]
    fn validate_reads_the_data_and_checks_the_step_against_it() {
        let (dir, path) = fixture(GOOD);
        let train = dir.path().join("train.jsonl");
        std::fs::write(&train, format!("{}{{\"prompt\": 3}}\n", rows())).unwrap();
        let (code, _, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::FAILURE);
        assert!(
            err.contains(&format!("data.train[0]: {}:65: ", train.display())),
            "{err}"
        );
        let (code, _, err) = run_scan(&path, dir.path(), DataScan::Never);
        assert_eq!(code, ExitCode::SUCCESS, "{err}");

        std::fs::write(&train, rows()).unwrap();
        let big = GOOD.replace("docs_per_step = 64", "docs_per_step = 1000000000");
        std::fs::write(&path, big).unwrap();
        let (code, _, err) = run_scan(&path, dir.path(), DataScan::Never);
        assert_eq!(code, ExitCode::FAILURE);
        assert!(
            err.contains("batch.docs_per_step: 1000000000 is more than the limit of 1048576 documents per step"),
            "{err}"
        );
        std::fs::write(
            &path,
            GOOD.replace("docs_per_step = 64", "docs_per_step = 65"),
        )
        .unwrap();
        let (code, _, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::FAILURE);
        assert!(
            err.contains("batch.docs_per_step: 65 is more than the 64 documents in data.train"),
            "{err}"
        );
    }

    /// Issue 14 item 10: a directory, a FIFO or /dev/zero as the spec or a
    /// file it names says what it is (it was "file not found"; a FIFO spec
    /// blocked and a /dev/zero spec was read until memory ran out). The
    /// spec itself may be a pipe (`<(...)`), so a device there is read up
    /// to the spec's size limit.
    #[test]
    fn files_that_are_not_regular_files_are_named_without_blocking() {
        let (dir, path) = fixture(GOOD);
        let e = run(
            dir.path(),
            dir.path(),
            DataScan::Auto,
            &mut Vec::new(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("not a file: {} is a directory", dir.path().display())
        );
        let mut cases = vec![(dir.path().to_path_buf(), "is a directory")];
        let zero = Path::new("/dev/zero");
        if zero.exists() {
            let e = run(
                zero,
                dir.path(),
                DataScan::Auto,
                &mut Vec::new(),
                &mut Vec::new(),
            )
            .unwrap_err();
            assert_eq!(
                e.to_string(),
                "too large: /dev/zero gives more than the 16777216 bytes a job spec may have"
            );
            cases.push((zero.to_path_buf(), "is a character device"));
        }
        let fifo = dir.path().join("pipe");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            let e = run(
                &fifo,
                dir.path(),
                DataScan::Auto,
                &mut Vec::new(),
                &mut Vec::new(),
            )
            .unwrap_err();
            assert!(
                e.to_string()
                    .ends_with("is a named pipe (FIFO) that no process is writing to"),
                "{e}"
            );
            cases.push((fifo.clone(), "is a named pipe (FIFO)"));
        }
        for (bad, what) in cases {
            for (from, field) in [
                ("\"train.jsonl\"", "data.train[0]"),
                ("\"tiny.json\"", "model.config"),
            ] {
                // A directory in `data.train` is a dataset directory (its
                // data files are read, issue 33 (9)), not a mistake.
                if what == "is a directory" && field == "data.train[0]" {
                    continue;
                }
                let text = GOOD.replace(from, &format!("{:?}", bad.display().to_string()));
                std::fs::write(&path, text).unwrap();
                let (code, _, err) = run_to_strings(&path, dir.path());
                assert_eq!(code, ExitCode::FAILURE);
                let want = format!("{field}: not a file: {} {what}", bad.display());
                assert!(err.contains(&want), "{want}\n{err}");
            }
        }
    }

    #[test]
    fn spec_with_several_mistakes_prints_every_problem_and_exits_1() {
        let bad = GOOD
            .replace("steps = 100", "steps = 100\nepochs = 2")
            .replace("lr = 1e-4", "lr = -1.0")
            .replace("max_workers = 8", "max_workers = 0")
            .replace("train.jsonl", "missing.jsonl");
        let (dir, path) = fixture(&bad);
        let (code, out, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::FAILURE);
        assert_eq!(out, "");
        let label = path.display().to_string();
        let lines: Vec<&str> = err.lines().collect();
        for field in [
            "job.steps",
            "optimizer.lr",
            "parallel.max_workers",
            "data.train[0]",
        ] {
            let prefix = format!("{label}: {field}: ");
            assert!(
                lines.iter().any(|l| l.starts_with(&prefix)),
                "no line starting with {prefix:?} in:\n{err}"
            );
        }
        assert!(
            lines.iter().all(|l| l.starts_with(&format!("{label}: "))),
            "{err}"
        );
        assert!(err.contains("missing.jsonl"), "{err}");
    }

    #[test]
    fn parse_errors_in_several_sections_are_all_printed() {
        let bad = GOOD
            .replace("seed = 1234", "seed = 1234\nsede = 5")
            .replace("[parallel]", "[extra]\nx = 1\n[parallel]");
        let (dir, path) = fixture(&bad);
        let (code, _, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::FAILURE);
        let label = path.display().to_string();
        assert!(err.contains(&format!("{label}: job.sede: ")), "{err}");
        assert!(err.contains(&format!("{label}: extra: ")), "{err}");
    }

    #[test]
    fn relative_paths_resolve_against_base_dir_not_the_spec_dir() {
        // The spec lives in a subdirectory; its data files are in base.
        let (dir, _) = fixture(GOOD);
        let sub = dir.path().join("specs");
        std::fs::create_dir(&sub).unwrap();
        let path = sub.join("job.toml");
        std::fs::write(&path, GOOD).unwrap();
        let (code, _, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::SUCCESS, "{err}");
        let (code, _, err) = run_to_strings(&path, &sub);
        assert_eq!(code, ExitCode::FAILURE);
        assert!(err.contains("data.train[0]: file not found"), "{err}");
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.toml");
        let e = run(
            &path,
            dir.path(),
            DataScan::Auto,
            &mut Vec::new(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            format!("file not found: {}", path.display())
        );
    }

    #[test]
    fn summary_names_other_step_modes() {
        let text = GOOD
            .replace("steps = 100", "epochs = 3")
            .replace("docs_per_step = 64", "microbatches_per_rank = 2");
        let (dir, path) = fixture(&text);
        let (code, out, err) = run_to_strings(&path, dir.path());
        assert_eq!(code, ExitCode::SUCCESS, "{err}");
        assert!(
            out.contains("2 microbatches per rank per step · 3 epochs"),
            "{out}"
        );
    }

    /// Issue 16 item 6: a mixture is checked per source, eval sources too,
    /// with the same readers (a bad row and an over-long document counted).
    #[test]
    fn a_mixture_is_reported_per_source() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
        let row =
            |p: &str, c: &str| format!("{}\n", serde_json::json!({"prompt": p, "completion": c}));
        std::fs::write(
            d.join("a.jsonl"),
            row("1+1=", "2") + &row("2+2=", "4") + "not json\n",
        )
        .unwrap();
        let long = "x".repeat(200);
        std::fs::write(d.join("b.jsonl"), row("3+3=", "6") + &row(&long, "y")).unwrap();
        std::fs::write(d.join("held.jsonl"), row("5+5=", "10")).unwrap();
        let spec = format!(
            "[job]\nname = \"mix\"\nsteps = 3\noutput_dir = \"out\"\n\
             [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
             [data]\nformat = \"sft\"\nmax_tokens = 64\non_bad_line = \"skip\"\non_overlong = \"skip\"\ncache_dir = {:?}\n\
             [[data.sources]]\nname = \"a\"\npath = \"a.jsonl\"\nweight = 2.0\n\
             [[data.sources]]\npath = \"b.jsonl\"\nweight = 1.0\n\
             [batch]\ndocs_per_step = 2\n\
             [eval]\nevery_steps = 1\n[[eval.sources]]\npath = \"held.jsonl\"\n",
            d.join("cache").display().to_string()
        );
        let path = d.join("job.toml");
        std::fs::write(&path, spec).unwrap();
        let (code, out, err) = run_to_strings(&path, d);
        assert_eq!(code, ExitCode::SUCCESS, "{err}");
        assert!(out.contains("  source a: 2 documents, "), "{out}");
        assert!(
            out.contains("(3 rows; 1 bad rows and 0 over-long documents skipped)"),
            "{out}"
        );
        assert!(out.contains("  source b: 1 documents, "), "{out}");
        assert!(
            out.contains("(2 rows; 0 bad rows and 1 over-long documents skipped)"),
            "{out}"
        );
        assert!(out.contains("  eval source held: 1 documents"), "{out}");
    }
}
