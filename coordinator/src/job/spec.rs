//! The job spec: the TOML a user submits, as [`JobSpec`], one field per
//! section. Parsed section by section so one broken section does not hide
//! the problems of another, its relative paths resolved against the
//! submitter's directory, then checked by [`JobSpec::validate`], which
//! returns every problem with its field path: each section checks itself
//! (in its own file: [`crate::job::data`], [`crate::job::batch`], ...),
//! and [`rules`] checks how the sections fit together.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::limits::{self, StepShape};
use crate::job::locate;
use crate::job::lora::LoraSection;
use crate::job::rules;
use crate::job::section::is_default;
use crate::job::sources::{self, EvalSection, SourceSpec};

use crate::job::batch::{BatchSection, StepSize};
use crate::job::checkpoint::CheckpointSection;
use crate::job::data::DataSection;
use crate::job::faults::FaultsSection;
use crate::job::header::JobSection;
use crate::job::model::{Dtype, ModelSection};
use crate::job::objective::ObjectiveSection;
use crate::job::optimizer::OptimizerSection;
use crate::job::parallel::ParallelSection;
use crate::job::rl::RlSection;
use crate::job::runtime::{PrecisionSection, RuntimeSection};
use crate::job::section::SpecProblem;
use crate::job::tracking::TrackingSection;

/// A whole job spec, one field per section of the TOML (`[job]` is
/// [`JobSection`]); what the coordinator stores and workers receive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub job: JobSection,
    pub model: ModelSection,
    pub data: DataSection,
    pub batch: BatchSection,
    #[serde(default)]
    pub objective: ObjectiveSection,
    #[serde(default)]
    pub optimizer: OptimizerSection,
    #[serde(default)]
    pub parallel: ParallelSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    #[serde(default)]
    pub runtime: RuntimeSection,
    #[serde(default, skip_serializing_if = "is_default")]
    pub precision: PrecisionSection,
    #[serde(default, skip_serializing_if = "is_default")]
    pub faults: FaultsSection,
    #[serde(default, skip_serializing_if = "is_default")]
    pub rl: RlSection,
    /// `[eval]`: forward-only passes over held-out sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalSection>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub tracking: TrackingSection,
    /// `[lora]`: train low-rank adapters over a frozen base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSection>,
}

const SECTIONS: &[&str] = &[
    "job",
    "model",
    "data",
    "batch",
    "objective",
    "optimizer",
    "parallel",
    "checkpoint",
    "rl",
    "runtime",
    "precision",
    "faults",
    "eval",
    "tracking",
    "lora",
];

impl JobSpec {
    /// Parses and validates a spec. Relative paths are resolved against
    /// `base_dir` (the submitter's working directory). Returns every problem
    /// found: unknown sections, per-section parse errors and semantic checks.
    pub fn parse(text: &str, base_dir: &Path) -> Result<JobSpec, Vec<SpecProblem>> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            vec![SpecProblem::new("<toml>", one_line(&e.to_string()))]
        })?;
        let mut problems = Vec::new();
        for key in table.keys() {
            if !SECTIONS.contains(&key.as_str()) {
                problems.push(SpecProblem::new(
                    key.as_str(),
                    format!("unknown section, expected one of: {}", SECTIONS.join(", ")),
                ));
            }
        }
        // Each section on its own, so one bad section does not hide another.
        for &section in SECTIONS {
            if let Some(value) = table.get(section) {
                if let Err(e) = check_section(section, value.clone()) {
                    problems.push(e);
                }
            } else if matches!(section, "job" | "model" | "data" | "batch") {
                problems.push(SpecProblem::new(section, "missing section"));
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        let mut spec: JobSpec =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| {
                    vec![SpecProblem::new("<toml>", one_line(&e.to_string()))]
                })?;
        let mut problems = spec.locate(base_dir);
        spec.resolve_paths(base_dir);
        problems.extend(spec.expand_entries());
        if !problems.is_empty() {
            return Err(problems);
        }
        let problems = spec.validate();
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(problems)
        }
    }

    /// Resolves a `model.init` or `data.tokenizer` that is no path under
    /// `base` but a Hugging Face model id, offline in the hub cache.
    fn locate(&mut self, base: &Path) -> Vec<SpecProblem> {
        let mut p = Vec::new();
        let missing = |s: &str| !s.is_empty() && !base.join(s).exists();
        let init = self.model.init.clone();
        if !self.model.is_random() && missing(&init) && locate::looks_like_model_id(&init) {
            match locate::model_snapshot(&init, "model.init") {
                Ok(dir) => self.model.init = dir.display().to_string(),
                Err(e) => p.push(SpecProblem::new("model.init", e.to_string())),
            }
        }
        let tok = self.data.tokenizer.clone();
        if !self.data.is_byte_tokenizer() && missing(&tok) && locate::looks_like_model_id(&tok) {
            match locate::model_snapshot(&tok, "data.tokenizer") {
                Ok(dir) => self.data.tokenizer = dir.join("tokenizer.json").display().to_string(),
                Err(e) => p.push(SpecProblem::new("data.tokenizer", e.to_string())),
            }
        }
        p
    }

    /// Expands directory and glob entries of `data.train`, the sources and
    /// the eval sources into their files (sorted), so the stored spec names
    /// files only.
    pub fn expand_entries(&mut self) -> Vec<SpecProblem> {
        let mut p = Vec::new();
        // A directory is read whether or not a '/' ends its name (issue
        // 33: `["ds"]` was refused as "not a file" while `["ds/"]` was
        // read); a file stays itself.
        let mut expand_list = |list: &mut Vec<PathBuf>, field: &str, split: &str| {
            let mut out = Vec::new();
            for (i, e) in list.iter().enumerate() {
                match locate::expand(e, split) {
                    Ok(files) => out.extend(files),
                    Err(err) => p.push(SpecProblem::new(format!("{field}[{i}]"), err.to_string())),
                }
            }
            *list = out;
        };
        expand_list(&mut self.data.train, "data.train", "train");
        let mut expand_sources = |specs: &mut Vec<SourceSpec>, field: &str, split: &str| {
            for (i, s) in specs.iter_mut().enumerate() {
                let split = s.split.clone().unwrap_or_else(|| split.to_string());
                let mut list: Vec<PathBuf> = s.entries().cloned().collect();
                expand_list(&mut list, &format!("{field}[{i}].paths"), &split);
                if s.name.is_none() {
                    s.name = Some(sources::name_of(s, i));
                }
                s.path = None;
                s.paths = list;
            }
        };
        expand_sources(&mut self.data.sources, "data.sources", "train");
        if let Some(e) = self.eval.as_mut() {
            expand_sources(&mut e.sources, "eval.sources", "test");
        }
        p
    }

    /// Makes every relative path absolute against `base`. An empty path
    /// stays empty, so that [`Self::validate`] refuses it rather than the
    /// job writing into (or reading) `base` itself.
    pub fn resolve_paths(&mut self, base: &Path) {
        let abs = |p: &mut PathBuf| {
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = base.join(&*p);
            }
        };
        abs(&mut self.job.output_dir);
        if let Some(c) = self.model.config.as_mut() {
            abs(c);
        }
        if !self.model.is_random()
            && !self.model.init.is_empty()
            && Path::new(&self.model.init).is_relative()
        {
            self.model.init = base.join(&self.model.init).display().to_string();
        }
        for f in &mut self.data.train {
            abs(f);
        }
        for s in &mut self.data.sources {
            s.entries_mut().for_each(&abs);
            if let Some(t) = s.chat_template.as_mut() {
                abs(t);
            }
        }
        if let Some(e) = self.eval.as_mut() {
            for s in &mut e.sources {
                s.entries_mut().for_each(&abs);
                if let Some(t) = s.chat_template.as_mut() {
                    abs(t);
                }
            }
        }
        if let Some(c) = self.data.cache_dir.as_mut() {
            abs(c);
        }
        for f in &mut self.rl.eval_prompts {
            abs(f);
        }
        if let Some(e) = self.rl.env.as_mut() {
            e.resolve_paths(base);
        }
        if !self.data.is_byte_tokenizer()
            && !self.data.tokenizer.is_empty()
            && Path::new(&self.data.tokenizer).is_relative()
        {
            self.data.tokenizer = base.join(&self.data.tokenizer).display().to_string();
        }
        if let Some(t) = self.data.chat_template.as_mut() {
            abs(t);
        }
        if let Some(l) = self.lora.as_mut() {
            l.resolve_paths(base);
        }
    }

    /// The submitted step size mode (a running job's changes: see
    /// `crate::job::settings`). Valid only on a validated spec.
    pub fn step_size(&self) -> StepSize {
        self.batch.step_size()
    }

    /// The step-size settings as submitted, for [`crate::job::limits`].
    pub fn step_shape(&self) -> StepShape {
        let b = &self.batch;
        StepShape {
            docs_per_step: b.docs_per_step,
            tokens_per_step: b.tokens_per_step,
            microbatches_per_rank: b.microbatches_per_rank,
            max_tokens: self.data.max_tokens,
            max_workers: self.parallel.max_workers,
        }
    }

    /// The forward/backward dtype (`precision.compute`, else `model.dtype`).
    pub fn compute_dtype(&self) -> Dtype {
        self.precision.compute_dtype(self.model.dtype)
    }

    /// Serialises back to TOML (what workers receive in Configure).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a JobSpec always serialises")
    }

    /// Every semantic problem, with field paths. Checks that referenced
    /// files exist (paths must already be resolved). Each section checks
    /// itself; each rule between sections ([`rules`]) runs after the
    /// sections it reads.
    pub fn validate(&self) -> Vec<SpecProblem> {
        let mut p = Vec::new();
        let bad = &mut |field: &str, msg: String| p.push(SpecProblem::new(field, msg));
        let (job, data, batch) = (&self.job, &self.data, &self.batch);
        let (objective, rl, parallel) = (&self.objective, &self.rl, &self.parallel);
        job.validate(bad);
        rules::length_given(job, data, bad);
        self.model.validate(bad);
        data.validate(bad);
        rules::one_source_for_pg(data, objective, bad);
        rules::source_docs_fill_step(data, batch, bad);
        if let Some(eval) = &self.eval {
            eval.validate(bad);
            rules::eval_fits_training(eval, data, objective, bad);
        }
        limits::check_step(&self.step_shape(), bad);
        batch.validate(bad);
        rules::pg_steps_take_groups(batch, objective, bad);
        rules::format_fits_objective(data, objective, bad);
        objective.validate(bad);
        rules::rl_needs_pg(rl, objective, bad);
        rl.validate(bad);
        rules::rl_loop_fields_need_generate(data, rl, bad);
        rules::serve_fits(data, rl, bad);
        rules::rl_loop_fits(data, rl, parallel, bad);
        rules::stream_fields_need_stream(data, objective, rl, bad);
        rules::stream_fits(job, data, batch, objective, bad);
        rules::stream_groups_fit_queue(data, batch, rl, bad);
        rules::fsdp_takes_cached_reference(parallel, objective, self.lora.is_some(), bad);
        if let Some(lora) = &self.lora {
            lora.validate(bad);
            rules::lora_fits(rl, bad);
        }
        self.optimizer.validate(bad);
        rules::warmup_within_steps(&self.optimizer, job, bad);
        parallel.validate(bad);
        rules::context_fits(parallel, self.lora.as_ref(), bad);
        self.runtime.validate(bad);
        rules::compute_no_wider_than_params(&self.model, &self.precision, bad);
        self.faults.validate(bad);
        p
    }
}

/// Deserialises one section alone and turns a serde error into a problem
/// whose field path starts with the section name.
fn check_section(section: &str, value: toml::Value) -> Result<(), SpecProblem> {
    let result = match section {
        "job" => value.try_into::<JobSection>().map(drop),
        "model" => value.try_into::<ModelSection>().map(drop),
        "data" => value.try_into::<DataSection>().map(drop),
        "batch" => value.try_into::<BatchSection>().map(drop),
        "objective" => value.try_into::<ObjectiveSection>().map(drop),
        "optimizer" => value.try_into::<OptimizerSection>().map(drop),
        "parallel" => value.try_into::<ParallelSection>().map(drop),
        "checkpoint" => value.try_into::<CheckpointSection>().map(drop),
        "rl" => value.try_into::<RlSection>().map(drop),
        "runtime" => value.try_into::<RuntimeSection>().map(drop),
        "precision" => value.try_into::<PrecisionSection>().map(drop),
        "faults" => value.try_into::<FaultsSection>().map(drop),
        "eval" => value.try_into::<EvalSection>().map(drop),
        "tracking" => value.try_into::<TrackingSection>().map(drop),
        "lora" => value.try_into::<LoraSection>().map(drop),
        _ => Ok(()),
    };
    result.map_err(|e| {
        let msg = one_line(&e.to_string());
        // serde names the field in the message; make the path explicit too.
        // A nested table's field: toml ends the message with " in `rl.env`"-
        // like paths below the section.
        let table =
            nested_table(&msg).map_or_else(|| section.to_string(), |t| format!("{section}.{t}"));
        let field =
            field_in_message(&msg).map_or_else(|| table.clone(), |f| format!("{table}.{f}"));
        SpecProblem::new(field, msg)
    })
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The table below the section a toml error names at its end (`… in
/// \`env\``), if any.
fn nested_table(msg: &str) -> Option<&str> {
    let rest = msg.strip_suffix('`')?;
    let start = rest.rfind(" in `")?;
    Some(&rest[start + " in `".len()..]).filter(|t| !t.is_empty() && !t.contains('`'))
}

/// Pulls the field name out of serde messages such as
/// "unknown field `foo`, expected ..." or "missing field `name`".
fn field_in_message(msg: &str) -> Option<&str> {
    for marker in ["unknown field `", "missing field `"] {
        if let Some(start) = msg.find(marker) {
            let rest = &msg[start + marker.len()..];
            return rest.find('`').map(|end| &rest[..end]);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiny.json"), "{}").unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "").unwrap();
        let base = dir.path().to_path_buf();
        (dir, base)
    }

    const GOOD: &str = r#"
[job]
name = "sft-demo"
seed = 1234
steps = 100
output_dir = "runs/sft-demo"
[model]
init = "random"
config = "tiny.json"
dtype = "float32"
[data]
train = ["train.jsonl"]
format = "sft"
tokenizer = "bytes"
max_tokens = 4096
on_overlong = "error"
shuffle = true
[batch]
docs_per_step = 64
[objective]
kind = "sft"
[optimizer]
kind = "adamw"
lr = 1e-4
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.0
grad_clip = 1.0
warmup_steps = 0
schedule = "constant"
[parallel]
sharding = "ddp"
min_workers = 1
max_workers = 8
[checkpoint]
every_steps = 50
[runtime]
loss_chunk_tokens = 512
"#;

    #[test]
    fn issue_example_spec_is_valid() {
        let (_d, base) = fixture();
        let spec = JobSpec::parse(GOOD, &base).unwrap();
        assert_eq!(spec.step_size(), StepSize::Docs(64));
        assert_eq!(spec.job.output_dir, base.join("runs/sft-demo"));
        assert_eq!(spec.optimizer.betas, [0.9, 0.95]);
        assert_eq!(spec.runtime.loss_chunk_tokens, 512);
        // Round-trips through TOML unchanged.
        let again: JobSpec = toml::from_str(&spec.to_toml()).unwrap();
        assert_eq!(again, spec);
    }

    #[test]
    fn reports_every_semantic_problem_with_its_field() {
        let (_d, base) = fixture();
        let text = GOOD
            .replace("steps = 100", "steps = 100\nepochs = 2")
            .replace("lr = 1e-4", "lr = -1.0")
            .replace(
                "docs_per_step = 64",
                "docs_per_step = 64\ntokens_per_step = 10",
            )
            .replace("max_workers = 8", "max_workers = 0")
            .replace("train.jsonl", "missing.jsonl")
            .replace("kind = \"sft\"", "kind = \"dpo\"");
        let problems = JobSpec::parse(&text, &base).unwrap_err();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        for f in [
            "job.steps",
            "optimizer.lr",
            "batch",
            "parallel.max_workers",
            "data.train[0]",
            "objective.kind",
        ] {
            assert!(fields.contains(&f), "missing {f} in {problems:?}");
        }
    }

    /// A nested table's unknown field is named with its whole path.
    #[test]
    fn an_unknown_field_of_a_nested_table_is_named_with_its_path() {
        let (_d, base) = fixture();
        let text = format!("{GOOD}[rl.env]\nmax_turns = 2\nroutng = 1\n");
        let problems = JobSpec::parse(&text, &base).unwrap_err();
        assert!(
            problems.iter().any(|p| p.field == "rl.env.routng"),
            "{problems:?}"
        );
    }

    #[test]
    fn parse_errors_of_several_sections_are_all_reported() {
        let (_d, base) = fixture();
        let text = GOOD
            .replace("seed = 1234", "seed = 1234\nsede = 5")
            .replace("dtype = \"float32\"", "dtype = \"float16\"")
            .replace("[checkpoint]", "[extra]\nx = 1\n[checkpoint]");
        let problems = JobSpec::parse(&text, &base).unwrap_err();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert!(fields.contains(&"job.sede"), "{problems:?}");
        assert!(
            fields.iter().any(|f| f.starts_with("model")),
            "{problems:?}"
        );
        assert!(fields.contains(&"extra"), "{problems:?}");
    }

    /// Issue 14 item 6: `output_dir = ""` was made absolute before the
    /// emptiness check and became the submit directory.
    #[test]
    fn an_empty_output_dir_is_refused_not_made_the_submit_directory() {
        let (_d, base) = fixture();
        let text = GOOD.replace("output_dir = \"runs/sft-demo\"", "output_dir = \"\"");
        let problems = JobSpec::parse(&text, &base).unwrap_err();
        assert_eq!(
            problems,
            vec![SpecProblem::new("job.output_dir", "must not be empty")]
        );
        for (from, to, field) in [
            ("config = \"tiny.json\"", "config = \"\"", "model.config"),
            (
                "train = [\"train.jsonl\"]",
                "train = [\"\"]",
                "data.train[0]",
            ),
            ("init = \"random\"", "init = \"\"", "model.init"),
        ] {
            let problems = JobSpec::parse(&GOOD.replace(from, to), &base).unwrap_err();
            assert!(
                problems
                    .iter()
                    .any(|p| p.field == field && p.message.starts_with("must not be empty")),
                "{to}: {problems:?}"
            );
        }
    }

    /// Issue 14 item 2: size-like fields have upper bounds (a billion
    /// documents per step was admitted and the coordinator ran out of
    /// memory).
    #[test]
    fn size_like_fields_have_upper_bounds() {
        let (_d, base) = fixture();
        for (from, to, field) in [
            (
                "docs_per_step = 64",
                "docs_per_step = 1000000000",
                "batch.docs_per_step",
            ),
            (
                "docs_per_step = 64",
                "tokens_per_step = 1000000000000",
                "batch.tokens_per_step",
            ),
            (
                "docs_per_step = 64",
                "microbatches_per_rank = 100000",
                "batch.microbatches_per_rank",
            ),
            (
                "max_tokens = 4096",
                "max_tokens = 4000000000",
                "data.max_tokens",
            ),
            ("steps = 100", "steps = 1000000000000", "job.steps"),
            ("steps = 100", "epochs = 1000000000", "job.epochs"),
            (
                "warmup_steps = 0",
                "warmup_steps = 1000000000000",
                "optimizer.warmup_steps",
            ),
            (
                "loss_chunk_tokens = 512",
                "loss_chunk_tokens = 1000000000000",
                "runtime.loss_chunk_tokens",
            ),
            (
                "max_workers = 8",
                "max_workers = 4000000000",
                "parallel.max_workers",
            ),
        ] {
            let problems = JobSpec::parse(&GOOD.replace(from, to), &base).unwrap_err();
            let p = problems
                .iter()
                .find(|p| p.field == field)
                .unwrap_or_else(|| panic!("{to}: {problems:?}"));
            assert!(p.message.contains("is more than the limit of"), "{p}");
        }
        let problems = JobSpec::parse(
            &GOOD.replace("docs_per_step = 64", "docs_per_step = 1000000000"),
            &base,
        )
        .unwrap_err();
        assert_eq!(
            problems[0].to_string(),
            "batch.docs_per_step: 1000000000 is more than the limit of 1048576 documents per step"
        );
    }

    /// Issue 14 item 10: a directory as a named file was "file not found";
    /// since issue 33 a directory is read, and one holding no dataset file
    /// says so.
    #[test]
    fn a_directory_without_dataset_files_says_what_it_is() {
        let (d, base) = fixture();
        std::fs::create_dir(d.path().join("dir.jsonl")).unwrap();
        let problems =
            JobSpec::parse(&GOOD.replace("train.jsonl", "dir.jsonl"), &base).unwrap_err();
        assert_eq!(
            problems[0].to_string(),
            format!(
                "data.train[0]: directory {} holds no dataset file (*.jsonl, *.json, *.gz, *.parquet) of split \"train\"",
                base.join("dir.jsonl").display()
            )
        );
    }

    /// Issue 33 (9): `data.train = ["ds"]` was refused as "not a file"
    /// while `["ds/"]` was read; the README promises directories. Both
    /// read the same files, each once (a `latest` link to a version read
    /// beside it does not read it twice).
    #[test]
    fn a_data_directory_with_or_without_a_trailing_slash_reads_the_same_files() {
        let (d, base) = fixture();
        for f in ["ds/v1/a.jsonl", "ds/v2/b.jsonl"] {
            std::fs::create_dir_all(d.path().join(f).parent().unwrap()).unwrap();
            std::fs::write(d.path().join(f), "").unwrap();
        }
        std::os::unix::fs::symlink("v2", d.path().join("ds/latest")).unwrap();
        let train = |entry: &str| {
            JobSpec::parse(
                &GOOD.replace("\"train.jsonl\"", &format!("\"{entry}\"")),
                &base,
            )
            .unwrap()
            .data
            .train
        };
        let files = vec![base.join("ds/v1/a.jsonl"), base.join("ds/v2/b.jsonl")];
        assert_eq!(train("ds/"), files);
        assert_eq!(train("ds"), files);
    }

    #[test]
    fn runtime_section_defaults_and_validation() {
        let (_d, base) = fixture();
        let start = GOOD.find("[runtime]").unwrap();
        let spec = JobSpec::parse(&GOOD[..start], &base).unwrap();
        assert_eq!(spec.runtime, RuntimeSection::default());
        assert_eq!(spec.runtime.loss_chunk_tokens, 1024);

        let zero = GOOD.replace("loss_chunk_tokens = 512", "loss_chunk_tokens = 0");
        let problems = JobSpec::parse(&zero, &base).unwrap_err();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].field, "runtime.loss_chunk_tokens");

        for (bad, field) in [
            ("loss_chunk_tokens = -3", "runtime"),
            ("loss_chunk_tokens = \"big\"", "runtime"),
            ("loss_chunk_tokenz = 5", "runtime.loss_chunk_tokenz"),
        ] {
            let text = GOOD.replace("loss_chunk_tokens = 512", bad);
            let problems = JobSpec::parse(&text, &base).unwrap_err();
            assert!(
                problems.iter().any(|p| p.field.starts_with(field)),
                "{bad}: {problems:?}"
            );
        }
    }
}
