//! `accrue validate JOB.toml`: checks a job spec offline, with the same
//! [`JobSpec::parse`] the coordinator runs on submit, and prints every problem
//! as `JOB.toml: <field>: <message>`, like a compiler.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;

use crate::spec::{JobSpec, StepSize};

/// Validates the spec text; `label` prefixes every problem line (usually the
/// path the user typed). Ok: the `ok: <name>` line and a one-line summary.
/// Err: one line per problem.
pub fn check(label: &str, text: &str, base_dir: &Path) -> Result<Vec<String>, Vec<String>> {
    match JobSpec::parse(text, base_dir) {
        Ok(spec) => Ok(vec![
            format!("ok: {}", spec.job.name),
            format!("  {}", summary(&spec, base_dir)),
        ]),
        Err(problems) => Err(problems
            .iter()
            .map(|p| format!("{label}: {}: {}", p.field, p.message))
            .collect()),
    }
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
        .train
        .iter()
        .map(|f| f.strip_prefix(base_dir).unwrap_or(f).display().to_string())
        .collect();
    let objective = format!("{:?}", spec.objective.kind).to_lowercase();
    let sharding = format!("{:?}", spec.parallel.sharding).to_lowercase();
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
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    match check(&path.display().to_string(), &text, base_dir) {
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

    fn fixture(spec: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiny.json"), "{}").unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "").unwrap();
        let path = dir.path().join("job.toml");
        std::fs::write(&path, spec).unwrap();
        (dir, path)
    }

    fn run_to_strings(path: &Path, base: &Path) -> (ExitCode, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(path, base, &mut out, &mut err).unwrap();
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
        let e = run(&path, dir.path(), &mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert!(
            format!("{e:#}").starts_with(&format!("cannot read {}", path.display())),
            "{e:#}"
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
}
