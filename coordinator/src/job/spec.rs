//! The job spec: the TOML a user submits. Parsed section by section so one
//! broken section does not hide the problems of another, then checked by
//! [`JobSpec::validate`], which returns every problem with its field path.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::input;
use crate::job::limits::{self, StepShape};
use crate::job::locate;
use crate::job::objective::{step_rollouts, Reference};
pub use crate::job::objective::{ObjectiveKind, ObjectiveSection, RlSection};
use crate::job::sources::{self, EvalSection, Source, SourceSpec};

/// One thing wrong with a spec, with the dotted path of the field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecProblem {
    pub field: String,
    pub message: String,
}

impl SpecProblem {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for SpecProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

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
}

/// `[tracking]`: where metrics go besides `metrics.jsonl` and Prometheus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrackingSection {
    /// TensorBoard event files in `OUTPUT_DIR/tb/`, written by the
    /// coordinator: every step and eval metric of metrics.jsonl as a scalar.
    #[serde(default)]
    pub tensorboard: bool,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    /// Train for this many steps ...
    #[serde(default)]
    pub steps: Option<u64>,
    /// ... or for this many passes over the data (exactly one of the two).
    #[serde(default)]
    pub epochs: Option<u64>,
    /// checkpoints/ and metrics.jsonl go under it.
    pub output_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    Float32,
    Bfloat16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// "random" or a Hugging Face checkpoint directory.
    pub init: String,
    /// HF config.json; required when init = "random".
    #[serde(default)]
    pub config: Option<PathBuf>,
    #[serde(default)]
    pub dtype: Dtype,
    /// When `init` is a checkpoint of ours: `true` (default) resumes it
    /// (step, data cursor, optimizer state); `false` takes only its weights
    /// (e.g. DPO starting from an SFT checkpoint).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub resume: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

impl ModelSection {
    pub fn is_random(&self) -> bool {
        self.init == "random"
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    Sft,
    Dpo,
    Rollouts,
    /// Prompts and reference answers for the RL loop (`data.source =
    /// "generate"`; see `data::prompts`).
    Prompts,
}

/// Where a job's documents come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The files of `data.train`, read and tokenized at submit.
    #[default]
    Files,
    /// Rollouts pushed through the `Rollouts.PushRollouts` RPC while the
    /// job runs (policy gradient only; see `core::stream`).
    Stream,
    /// The RL loop: the coordinator reads prompts from `data.train`, has
    /// the job's workers sample `rl.group_size` completions of each,
    /// scores them with `[rl.verifier]` and trains on them as a stream
    /// (see `core::generate`).
    Generate,
}

/// What to do with a document longer than `max_tokens`, or a malformed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnBad {
    #[default]
    Error,
    Skip,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// JSONL, JSON array or gzipped files (none when `source = "stream"`).
    #[serde(default)]
    pub train: Vec<PathBuf>,
    #[serde(default, skip_serializing_if = "is_default")]
    pub source: DataSource,
    pub format: DataFormat,
    /// "bytes" (built in) or a path to a HF tokenizer.json.
    #[serde(default = "default_tokenizer")]
    pub tokenizer: String,
    /// A Jinja chat template file, overriding the one found next to the
    /// tokenizer (tokenizer_config.json) and the built-in template.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Tokens per microbatch.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default)]
    pub on_overlong: OnBad,
    #[serde(default)]
    pub on_bad_line: OnBad,
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// `[[data.sources]]`: a mixture, instead of `train`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceSpec>,
    /// Where token stores are kept (see `locate::default_cache_root`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}

impl DataSection {
    pub fn is_byte_tokenizer(&self) -> bool {
        self.tokenizer == "bytes"
    }

    /// True when the job trains on a rollout queue rather than on file
    /// documents: pushed rollouts, or the RL loop's own.
    pub fn is_stream(&self) -> bool {
        matches!(self.source, DataSource::Stream | DataSource::Generate)
    }

    /// True when the coordinator generates the job's rollouts (RL loop).
    pub fn is_generate(&self) -> bool {
        self.source == DataSource::Generate
    }

    /// The training sources: `[[data.sources]]`, or `train` as one source
    /// named `train`. `job_epochs` is every source's default.
    pub fn train_sources(&self, job_epochs: Option<u64>) -> Vec<Source> {
        if self.sources.is_empty() {
            let one = SourceSpec {
                name: Some("train".into()),
                paths: self.train.clone(),
                ..Default::default()
            };
            return sources::resolve(&[one], 0, job_epochs);
        }
        sources::resolve(&self.sources, 0, job_epochs)
    }

    /// Every training file, in source order (`DocId::file` indexes it).
    pub fn files(&self) -> Vec<PathBuf> {
        if self.sources.is_empty() {
            return self.train.clone();
        }
        self.sources
            .iter()
            .flat_map(|s| s.entries().cloned())
            .collect()
    }

    /// Whether the job mixes several sources.
    pub fn is_mixture(&self) -> bool {
        self.sources.len() > 1
    }

    /// Where this job's token stores are kept.
    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(locate::default_cache_root)
    }
}

fn default_tokenizer() -> String {
    "bytes".into()
}
fn default_max_tokens() -> u32 {
    4096
}
fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BatchSection {
    /// Exactly this many documents per step (dynamic accumulation).
    #[serde(default)]
    pub docs_per_step: Option<u64>,
    /// About this many tokens per step.
    #[serde(default)]
    pub tokens_per_step: Option<u64>,
    /// Static: fill this many microbatches per rank, carry the rest over.
    #[serde(default)]
    pub microbatches_per_rank: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    #[default]
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    #[default]
    Constant,
    Linear,
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    #[serde(default)]
    pub kind: OptimizerKind,
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
    /// Global L2 norm; 0 disables.
    #[serde(default = "default_grad_clip")]
    pub grad_clip: f64,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub schedule: Schedule,
    /// Parameters whose HF name contains one of these substrings take no
    /// weight decay (HF Trainer and open-instruct exclude biases and norm
    /// weights); `[]` decays every parameter.
    #[serde(default = "default_no_decay")]
    pub no_decay: Vec<String>,
}

fn default_no_decay() -> Vec<String> {
    vec!["bias".into(), "norm".into()]
}

fn default_lr() -> f64 {
    1e-4
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}
fn default_grad_clip() -> f64 {
    1.0
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adamw,
            lr: default_lr(),
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: 0.0,
            grad_clip: default_grad_clip(),
            warmup_steps: 0,
            schedule: Schedule::Constant,
            no_decay: default_no_decay(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    #[default]
    Ddp,
    Zero2,
    Fsdp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelSection {
    #[serde(default)]
    pub sharding: Sharding,
    #[serde(default = "default_min_workers")]
    pub min_workers: u32,
    #[serde(default = "default_max_workers")]
    pub max_workers: u32,
    /// Which backend carries the collectives (see [`CollectiveChoice`]).
    #[serde(default, skip_serializing_if = "is_default")]
    pub collective: CollectiveChoice,
}

/// `parallel.collective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveChoice {
    /// NCCL when every member of a generation is a CUDA worker that can
    /// load it, else the TCP ring.
    #[default]
    Auto,
    /// Always the TCP ring (GPU tensors staged through host memory).
    Ring,
}

fn default_min_workers() -> u32 {
    1
}
fn default_max_workers() -> u32 {
    8
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self {
            sharding: Sharding::Ddp,
            min_workers: default_min_workers(),
            max_workers: default_max_workers(),
            collective: CollectiveChoice::Auto,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Write a checkpoint every this many committed steps (0 = only at the end).
    #[serde(default)]
    pub every_steps: u64,
    /// Complete checkpoints the job keeps in its index for recovery (the
    /// newest; 0 = all). Steps since the oldest kept one stay replayable.
    #[serde(default = "default_checkpoint_keep")]
    pub keep: u64,
}

fn default_checkpoint_keep() -> u64 {
    3
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self {
            every_steps: 0,
            keep: default_checkpoint_keep(),
        }
    }
}

/// Worker-side execution knobs: they change speed and memory, never the
/// math (the loss and gradients are the same for any value).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSection {
    /// Tokens per chunk of the LM head + cross-entropy: at most
    /// `loss_chunk_tokens × vocab` logits exist at once.
    #[serde(default = "default_loss_chunk_tokens")]
    pub loss_chunk_tokens: u64,
    /// Keep only each decoder layer's input from the forward and recompute
    /// the layer during the backward (less activation memory, one more
    /// forward). fsdp always does.
    #[serde(default, skip_serializing_if = "is_false")]
    pub activation_checkpointing: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `[precision]`: mixed precision as FSDP's `MixedPrecision` and DeepSpeed's
/// bf16 mode define it. The parameters and AdamW state stay in
/// `model.dtype` (float32 for mixed precision); forward and backward run in
/// `compute`; gradients are reduced across ranks in `reduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PrecisionSection {
    /// Forward/backward dtype; unset: `model.dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<Dtype>,
    /// Gradient reduction dtype (default float32).
    #[serde(default)]
    pub reduce: Dtype,
}

impl JobSpec {
    /// The forward/backward dtype (`precision.compute`, else `model.dtype`).
    pub fn compute_dtype(&self) -> Dtype {
        self.precision.compute.unwrap_or(self.model.dtype)
    }
}

fn default_loss_chunk_tokens() -> u64 {
    1024
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self {
            loss_chunk_tokens: default_loss_chunk_tokens(),
            activation_checkpointing: false,
        }
    }
}

/// What a non-finite step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// The job fails, naming the step.
    #[default]
    Fail,
    /// The step's documents are bisected with forward/backward probes to
    /// find the ones that make it non-finite; those are quarantined and the
    /// step re-planned without them.
    Bisect,
}

/// `[faults]`: how the job reacts to failures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsSection {
    #[serde(default)]
    pub on_nonfinite: OnNonFinite,
    /// Probe rounds a bisection may take before the job fails instead.
    #[serde(default = "default_max_bisect_rounds")]
    pub max_bisect_rounds: u32,
    /// Seconds a dispatched step may take before its silent members are
    /// treated as lost. Unset: derived from the job's observed step times
    /// (see `core`'s step deadline), never below 10 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_timeout_s: Option<f64>,
    /// Dispatches of one step (1 + aborts) before the job fails as unable
    /// to make progress.
    #[serde(default = "default_max_step_attempts")]
    pub max_step_attempts: u32,
}

fn default_max_bisect_rounds() -> u32 {
    24
}
fn default_max_step_attempts() -> u32 {
    10
}

impl Default for FaultsSection {
    fn default() -> Self {
        Self {
            on_nonfinite: OnNonFinite::Fail,
            max_bisect_rounds: default_max_bisect_rounds(),
            step_timeout_s: None,
            max_step_attempts: default_max_step_attempts(),
        }
    }
}

/// How a step's size is defined (exactly one per job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSize {
    Docs(u64),
    Tokens(u64),
    MicrobatchesPerRank(u32),
}

impl StepSize {
    /// The mode the `[batch]` fields select (the first one set; a
    /// validated spec sets exactly one).
    pub fn of(docs: Option<u64>, tokens: Option<u64>, microbatches: Option<u32>) -> StepSize {
        match (docs, tokens, microbatches) {
            (Some(n), _, _) => StepSize::Docs(n),
            (_, Some(t), _) => StepSize::Tokens(t),
            (_, _, Some(k)) => StepSize::MicrobatchesPerRank(k),
            _ => StepSize::Docs(1),
        }
    }
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
        // In data.train a directory is read only when written with a
        // trailing '/' (a directory named where a file was meant is an
        // error); a source's entries may always be directories.
        let mut expand_list = |list: &mut Vec<PathBuf>, field: &str, split: &str, dirs: bool| {
            let mut out = Vec::new();
            for (i, e) in list.iter().enumerate() {
                let text = e.to_string_lossy();
                let wanted = dirs || text.ends_with('/') || text.contains(['*', '?', '[']);
                if !wanted {
                    out.push(e.clone());
                    continue;
                }
                match locate::expand(e, split) {
                    Ok(files) => out.extend(files),
                    Err(err) => p.push(SpecProblem::new(format!("{field}[{i}]"), err.to_string())),
                }
            }
            *list = out;
        };
        expand_list(&mut self.data.train, "data.train", "train", false);
        let mut expand_sources = |specs: &mut Vec<SourceSpec>, field: &str, split: &str| {
            for (i, s) in specs.iter_mut().enumerate() {
                let split = s.split.clone().unwrap_or_else(|| split.to_string());
                let mut list: Vec<PathBuf> = s.entries().cloned().collect();
                expand_list(&mut list, &format!("{field}[{i}].paths"), &split, true);
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
        if !self.data.is_byte_tokenizer()
            && !self.data.tokenizer.is_empty()
            && Path::new(&self.data.tokenizer).is_relative()
        {
            self.data.tokenizer = base.join(&self.data.tokenizer).display().to_string();
        }
        if let Some(t) = self.data.chat_template.as_mut() {
            abs(t);
        }
    }

    /// The submitted step size mode (a running job's changes: see
    /// `crate::job::settings`). Valid only on a validated spec.
    pub fn step_size(&self) -> StepSize {
        let b = &self.batch;
        StepSize::of(b.docs_per_step, b.tokens_per_step, b.microbatches_per_rank)
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

    /// Serialises back to TOML (what workers receive in Configure).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a JobSpec always serialises")
    }

    /// Every semantic problem, with field paths. Checks that referenced
    /// files exist (paths must already be resolved).
    pub fn validate(&self) -> Vec<SpecProblem> {
        let mut p = Vec::new();
        let mut bad = |field: &str, msg: String| p.push(SpecProblem::new(field, msg));

        let name = &self.job.name;
        if name.is_empty() {
            bad("job.name", "must not be empty".into());
        } else if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bad(
                "job.name",
                format!("{name:?} may contain only ASCII letters, digits, '-', '_' and '.'"),
            );
        }
        match (self.job.steps, self.job.epochs) {
            (Some(_), Some(_)) => bad(
                "job.steps",
                "give exactly one of job.steps and job.epochs, not both".into(),
            ),
            // A streamed job may run until cancelled.
            (None, None) if !self.data.is_stream() || self.data.is_generate() => bad(
                "job.steps",
                "give exactly one of job.steps and job.epochs".into(),
            ),
            (Some(0), _) => bad("job.steps", "must be at least 1".into()),
            (_, Some(0)) => bad("job.epochs", "must be at least 1".into()),
            (Some(s), _) => bound(&mut bad, "job.steps", s, limits::MAX_STEPS, "steps"),
            (_, Some(e)) => bound(&mut bad, "job.epochs", e, limits::MAX_EPOCHS, "epochs"),
            _ => {}
        }
        if self.job.output_dir.as_os_str().is_empty() {
            bad("job.output_dir", "must not be empty".into());
        }

        if self.model.is_random() {
            match &self.model.config {
                None => bad(
                    "model.config",
                    "required when model.init = \"random\"".into(),
                ),
                Some(c) => check_file(&mut bad, "model.config", c),
            }
        } else if self.model.init.is_empty() {
            bad(
                "model.init",
                "must not be empty: \"random\" or a checkpoint directory".into(),
            );
        } else {
            let dir = Path::new(&self.model.init);
            if !dir.is_dir() {
                bad(
                    "model.init",
                    format!(
                        "expected \"random\" or a checkpoint directory; {} is not a directory",
                        dir.display()
                    ),
                );
            } else if let Err(e) = input::check(&dir.join("config.json")) {
                bad("model.init", format!("no config.json: {e}"));
            }
            if let Some(c) = &self.model.config {
                check_file(&mut bad, "model.config", c);
            }
        }

        let needs_files = !self.data.is_stream() || self.data.is_generate();
        if self.data.train.is_empty() && self.data.sources.is_empty() && needs_files {
            bad(
                "data.train",
                "list at least one dataset file (or give [[data.sources]])".into(),
            );
        }
        if !self.data.train.is_empty() && !self.data.sources.is_empty() {
            bad(
                "data.sources",
                "give data.train or [[data.sources]], not both".into(),
            );
        }
        if self.data.is_stream() && !self.data.sources.is_empty() {
            bad("data.sources", "a streamed job reads no files".into());
        }
        if self.data.sources.len() > 1 && self.objective.kind == ObjectiveKind::Pg {
            bad(
                "data.sources",
                "a policy-gradient job reads one source (its stream's unit is a group of rollouts); mix prompts upstream".into(),
            );
        }
        for (i, f) in self.data.train.iter().enumerate() {
            check_file(&mut bad, &format!("data.train[{i}]"), f);
        }
        sources::validate(
            &self.data.sources,
            "data.sources",
            false,
            self.batch.docs_per_step,
            &mut bad,
        );
        for (i, s) in self.data.sources.iter().enumerate() {
            for (j, f) in s.entries().enumerate() {
                check_file(&mut bad, &format!("data.sources[{i}].paths[{j}]"), f);
            }
            if let Some(t) = &s.chat_template {
                check_file(&mut bad, &format!("data.sources[{i}].chat_template"), t);
            }
        }
        if let Some(e) = &self.eval {
            if e.every_steps == 0 {
                bad("eval.every_steps", "must be at least 1".into());
            }
            if e.sources.is_empty() {
                bad("eval.sources", "list at least one eval source".into());
            }
            if self.data.is_stream() {
                bad("eval", "a streamed job has no eval sources".into());
            }
            sources::validate(&e.sources, "eval.sources", true, None, &mut bad);
            for (i, s) in e.sources.iter().enumerate() {
                for (j, f) in s.entries().enumerate() {
                    check_file(&mut bad, &format!("eval.sources[{i}].paths[{j}]"), f);
                }
                if s.epochs.is_some() {
                    bad(
                        &format!("eval.sources[{i}].epochs"),
                        "an eval source is read once per evaluation".into(),
                    );
                }
            }
            if self
                .objective
                .dpo()
                .is_some_and(|d| d.reference != Reference::Cached)
            {
                bad(
                    "eval",
                    "evaluating a DPO job needs objective.reference = \"cached\" (the eval pairs' reference log-probs come from the cached pass)".into(),
                );
            }
            let train: std::collections::BTreeSet<String> = self
                .data
                .train_sources(None)
                .into_iter()
                .map(|s| s.name)
                .collect();
            for (i, s) in e.sources.iter().enumerate() {
                let n = sources::name_of(s, i);
                if train.contains(&n) && !self.data.sources.is_empty() {
                    bad(
                        &format!("eval.sources[{i}].name"),
                        format!("{n:?} also names a training source"),
                    );
                }
            }
        }
        if !self.data.is_byte_tokenizer() {
            check_file(&mut bad, "data.tokenizer", Path::new(&self.data.tokenizer));
        }
        if let Some(t) = &self.data.chat_template {
            check_file(&mut bad, "data.chat_template", t);
        }
        if self.data.max_tokens == 0 {
            bad("data.max_tokens", "must be at least 1".into());
        }
        limits::check_step(&self.step_shape(), &mut bad);

        let b = &self.batch;
        let set = [
            b.docs_per_step.is_some(),
            b.tokens_per_step.is_some(),
            b.microbatches_per_rank.is_some(),
        ]
        .iter()
        .filter(|&&x| x)
        .count();
        if set != 1 {
            bad(
                "batch",
                format!("give exactly one of docs_per_step, tokens_per_step, microbatches_per_rank ({set} given)"),
            );
        }
        if b.docs_per_step == Some(0) {
            bad("batch.docs_per_step", "must be at least 1".into());
        }
        if b.tokens_per_step == Some(0) {
            bad("batch.tokens_per_step", "must be at least 1".into());
        }
        if b.microbatches_per_rank.is_some() && self.objective.kind == ObjectiveKind::Pg {
            bad(
                "batch.microbatches_per_rank",
                "policy-gradient steps take whole groups of rollouts; use docs_per_step or tokens_per_step".into(),
            );
        }
        if b.microbatches_per_rank == Some(0) {
            bad("batch.microbatches_per_rank", "must be at least 1".into());
        }

        let expected = match self.objective.kind {
            ObjectiveKind::Sft => DataFormat::Sft,
            ObjectiveKind::Dpo => DataFormat::Dpo,
            ObjectiveKind::Pg if self.data.is_generate() => DataFormat::Prompts,
            ObjectiveKind::Pg => DataFormat::Rollouts,
        };
        if self.data.format != expected {
            bad(
                "objective.kind",
                format!(
                    "{:?} needs data.format = {:?}, got {:?}",
                    self.objective.kind, expected, self.data.format
                )
                .to_lowercase(),
            );
        }

        self.objective.validate(&mut bad);
        self.rl.validate(self.objective.kind, &mut bad);
        validate_source(self, &mut bad);
        validate_sharding(self, &mut bad);

        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            bad(
                "optimizer.lr",
                format!("must be a positive number, got {}", o.lr),
            );
        }
        for (i, beta) in o.betas.iter().enumerate() {
            if !(0.0..1.0).contains(beta) {
                bad(
                    &format!("optimizer.betas[{i}]"),
                    format!("must be in [0, 1), got {beta}"),
                );
            }
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            bad(
                "optimizer.eps",
                format!("must be a positive number, got {}", o.eps),
            );
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            bad(
                "optimizer.weight_decay",
                format!("must be ≥ 0, got {}", o.weight_decay),
            );
        }
        if !(o.grad_clip.is_finite() && o.grad_clip >= 0.0) {
            bad(
                "optimizer.grad_clip",
                format!("must be ≥ 0 (0 disables), got {}", o.grad_clip),
            );
        }
        bound(
            &mut bad,
            "optimizer.warmup_steps",
            o.warmup_steps,
            limits::MAX_STEPS,
            "steps",
        );
        if let Some(steps) = self.job.steps {
            if o.warmup_steps > steps {
                bad(
                    "optimizer.warmup_steps",
                    format!("{} is more than job.steps = {steps}", o.warmup_steps),
                );
            }
        }

        let par = &self.parallel;
        if par.min_workers == 0 {
            bad("parallel.min_workers", "must be at least 1".into());
        }
        bound(
            &mut bad,
            "parallel.max_workers",
            u64::from(par.max_workers),
            u64::from(limits::MAX_WORKERS),
            "workers",
        );
        if par.max_workers < par.min_workers {
            bad(
                "parallel.max_workers",
                format!(
                    "{} is less than parallel.min_workers = {}",
                    par.max_workers, par.min_workers
                ),
            );
        }

        if self.runtime.loss_chunk_tokens == 0 {
            bad("runtime.loss_chunk_tokens", "must be at least 1".into());
        }
        bound(
            &mut bad,
            "runtime.loss_chunk_tokens",
            self.runtime.loss_chunk_tokens,
            u64::from(limits::MAX_MICROBATCH_TOKENS),
            "tokens per chunk",
        );
        if self.model.dtype == Dtype::Bfloat16 && self.compute_dtype() == Dtype::Float32 {
            bad(
                "precision.compute",
                "float32 compute with bfloat16 parameters would only widen rounded weights; \
                 use model.dtype = \"float32\" with precision.compute = \"bfloat16\" for mixed precision"
                    .into(),
            );
        }
        if let Some(i) = self.optimizer.no_decay.iter().position(String::is_empty) {
            bad(
                &format!("optimizer.no_decay[{i}]"),
                "an empty pattern would match every parameter; use weight_decay = 0".into(),
            );
        }
        let f = &self.faults;
        if f.max_bisect_rounds == 0 {
            bad("faults.max_bisect_rounds", "must be at least 1".into());
        }
        if f.max_step_attempts == 0 {
            bad("faults.max_step_attempts", "must be at least 1".into());
        }
        if let Some(t) = f.step_timeout_s {
            if !(t.is_finite() && t >= 1.0) {
                bad(
                    "faults.step_timeout_s",
                    format!("must be at least 1 second, got {t}"),
                );
            }
        }
        p
    }
}

/// fsdp shards the model so that no rank holds it whole: a live reference
/// (a frozen full copy on every rank) would undo that, so fsdp jobs take
/// the cached reference pass.
fn validate_sharding(spec: &JobSpec, bad: &mut impl FnMut(&str, String)) {
    if spec.parallel.sharding != Sharding::Fsdp {
        return;
    }
    let live = spec.objective.dpo().map(|d| d.reference) == Some(Reference::Live)
        || spec
            .objective
            .pg()
            .is_some_and(|p| p.kl_coef > 0.0 && p.reference == Reference::Live);
    if live {
        bad(
            "objective.reference",
            "parallel.sharding = \"fsdp\" needs reference = \"cached\" (a live reference keeps a full frozen copy of the model on every rank)".into(),
        );
    }
}

/// Checks of the RL loop (`data.source = "generate"`): prompt files, a
/// verifier, and no loop settings on a job that does not generate.
fn validate_generate(spec: &JobSpec, bad: &mut impl FnMut(&str, String)) {
    let rl = &spec.rl;
    if !spec.data.is_generate() {
        for (field, given) in [
            ("rl.sampling", rl.sampling.is_some()),
            ("rl.verifier", rl.verifier.is_some()),
            ("rl.prompts_per_round", rl.prompts_per_round.is_some()),
            ("rl.eval_prompts", !rl.eval_prompts.is_empty()),
            ("rl.eval_every", rl.eval_every.is_some()),
            ("rl.engine", rl.engine.is_some()),
            ("rl.generators", rl.generators.is_some()),
        ] {
            if given {
                bad(field, "only applies to data.source = \"generate\"".into());
            }
        }
        return;
    }
    if spec.data.format != DataFormat::Prompts {
        bad(
            "data.format",
            "data.source = \"generate\" reads prompts: it needs data.format = \"prompts\"".into(),
        );
    }
    for (i, f) in rl.eval_prompts.iter().enumerate() {
        check_file(bad, &format!("rl.eval_prompts[{i}]"), f);
    }
    if rl.eval_every.is_some() && rl.eval_prompts.is_empty() {
        bad("rl.eval_every", "needs rl.eval_prompts".into());
    }
    if let Some(g) = rl.generators.filter(|&g| g >= spec.parallel.max_workers) {
        bad(
            "rl.generators",
            format!(
                "must be below parallel.max_workers = {} (got {g}): at least one worker trains",
                spec.parallel.max_workers
            ),
        );
    }
    if rl.verifier.is_none() {
        bad(
            "rl.verifier",
            "required for data.source = \"generate\": how completions are scored ([rl.verifier] kind = \"exact\" | \"gsm8k\" | \"regex\" | \"command\")".into(),
        );
    }
}

/// Checks tying `data.source` to the rest of the spec. A streamed job
/// (`data.source = "stream"`) trains policy gradient on pushed rollouts: no
/// files, no epochs (`job.steps` or until cancelled), steps counted by
/// `batch.docs_per_step` in whole groups of `rl.group_size`, and a queue
/// that holds at least one step.
fn validate_source(spec: &JobSpec, bad: &mut impl FnMut(&str, String)) {
    validate_generate(spec, bad);
    let rl = &spec.rl;
    if !spec.data.is_stream() {
        for (field, given) in [
            ("rl.group_size", rl.group_size.is_some()),
            ("rl.queue_capacity", rl.queue_capacity.is_some()),
        ] {
            if given && spec.objective.kind == ObjectiveKind::Pg {
                bad(
                    field,
                    "only applies to data.source = \"stream\" (file rollouts group by their \"group\" field)".into(),
                );
            }
        }
        return;
    }
    if spec.objective.kind != ObjectiveKind::Pg {
        bad(
            "data.source",
            "\"stream\" takes pushed rollouts: it needs objective.kind = \"pg\"".into(),
        );
    }
    // The cached pass runs before step 1 over the job's documents; pushed
    // rollouts arrive later, so they need the live reference.
    if spec
        .objective
        .pg()
        .is_some_and(|p| p.kl_coef > 0.0 && p.reference == Reference::Cached)
    {
        bad(
            "objective.reference",
            "a streamed job's KL penalty needs reference = \"live\" (the cached pass runs before step 1, over file rollouts only)".into(),
        );
    }
    if !spec.data.train.is_empty() && !spec.data.is_generate() {
        bad(
            "data.train",
            "a streamed job reads no files: leave data.train out, or use data.source = \"files\""
                .into(),
        );
    }
    if spec.job.epochs.is_some() {
        bad(
            "job.epochs",
            "a streamed job has no epochs: give job.steps, or neither to run until cancelled"
                .into(),
        );
    }
    if spec.batch.docs_per_step.is_none() {
        bad(
            "batch.docs_per_step",
            "required for a streamed job (a step takes whole groups until it holds this many rollouts)".into(),
        );
    }
    match rl.group_size {
        None => bad(
            "rl.group_size",
            "required for a streamed job: rollouts per group (a group is trained once complete)"
                .into(),
        ),
        Some(g) if g < 2 => bad(
            "rl.group_size",
            format!("must be at least 2 (a group of one has no reward variance), got {g}"),
        ),
        Some(g) if g > limits::MAX_GROUP_SIZE => bound(
            bad,
            "rl.group_size",
            u64::from(g),
            u64::from(limits::MAX_GROUP_SIZE),
            "rollouts per group",
        ),
        Some(g) => {
            if let Some(docs) = spec.batch.docs_per_step {
                let step = step_rollouts(docs, g);
                let cap = rl.queue_capacity_or_default(docs);
                if let Some(q) = rl.queue_capacity {
                    bound(
                        bad,
                        "rl.queue_capacity",
                        q,
                        limits::MAX_QUEUE_ROLLOUTS,
                        "rollouts",
                    );
                }
                if cap < step {
                    bad(
                        "rl.queue_capacity",
                        format!("{cap} cannot hold one step: {step} rollouts (docs_per_step = {docs} in whole groups of {g})"),
                    );
                }
            }
        }
    }
}

/// A named input file: not empty, and a regular file (not a directory, a
/// FIFO or a device; see [`crate::job::input`]).
fn check_file(bad: &mut impl FnMut(&str, String), field: &str, path: &Path) {
    if path.as_os_str().is_empty() {
        bad(field, "must not be empty".into());
    } else if let Err(e) = input::check(path) {
        bad(field, e.to_string());
    }
}

/// `value` must not exceed `max` (see [`crate::job::limits`]).
fn bound(bad: &mut impl FnMut(&str, String), field: &str, value: u64, max: u64, what: &str) {
    if let Some(message) = limits::over(value, max, what) {
        bad(field, message);
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
        _ => Ok(()),
    };
    result.map_err(|e| {
        let msg = one_line(&e.to_string());
        // serde names the field in the message; make the path explicit too.
        let field = field_in_message(&msg)
            .map_or_else(|| section.to_string(), |f| format!("{section}.{f}"));
        SpecProblem::new(field, msg)
    })
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
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

    /// Issue 14 item 10: a directory as a named file was "file not found".
    #[test]
    fn a_directory_as_a_file_says_what_it_is() {
        let (d, base) = fixture();
        std::fs::create_dir(d.path().join("dir.jsonl")).unwrap();
        let problems =
            JobSpec::parse(&GOOD.replace("train.jsonl", "dir.jsonl"), &base).unwrap_err();
        assert_eq!(
            problems[0].to_string(),
            format!(
                "data.train[0]: not a file: {} is a directory",
                base.join("dir.jsonl").display()
            )
        );
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
