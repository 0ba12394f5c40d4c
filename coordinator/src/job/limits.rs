//! Upper bounds on a job's size-like settings, and the checks that apply
//! them. One owner: spec validation ([`crate::job::spec::JobSpec::validate`]),
//! live changes (`accrue set`, [`crate::job::settings::Settings::check`]) and
//! admission against the loaded dataset ([`crate::shell::admission`]) all ask here,
//! so a value refused at submit is refused by `set` too.
//!
//! Why bounds at all: the coordinator plans a step in memory before any
//! worker runs it, so a step's size is the coordinator's memory. A job
//! whose step holds a billion documents used to be admitted and then grew
//! the coordinator until the kernel killed it, and the persisted job killed
//! the next one too. The bounds are far above what training runs use
//! (Llama 3 405B: 16M tokens per step), and a step may never hold more than
//! the dataset (it would train a document twice in one step).

/// Documents (examples, pairs, rollouts) in one step.
pub const MAX_DOCS_PER_STEP: u64 = 1 << 20;
/// Tokens in one step, whatever the step mode: the plan's payloads hold
/// every token (≥ 8 bytes each), so this is ~1 GiB of plan.
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 27;
/// Tokens in one microbatch (`data.max_tokens`, and the loss chunk, which
/// never spans more than a microbatch).
pub const MAX_MICROBATCH_TOKENS: u32 = 1 << 20;
/// Static steps: microbatches per rank (each rank runs every one, empty
/// padding ones included).
pub const MAX_MICROBATCHES_PER_RANK: u32 = 4096;
/// `job.steps` and `optimizer.warmup_steps`.
pub const MAX_STEPS: u64 = 100_000_000;
/// `job.epochs`: the stream and its step-count estimate walk every epoch.
pub const MAX_EPOCHS: u64 = 10_000;
/// Ranks of one generation (`parallel.min_workers`, `max_workers`).
pub const MAX_WORKERS: u32 = 65_536;
/// Rollouts of one streamed group (a group is never split across steps).
pub const MAX_GROUP_SIZE: u32 = 1 << 16;
/// Rollouts a streamed job buffers (`rl.queue_capacity`): four of the
/// largest steps.
pub const MAX_QUEUE_ROLLOUTS: u64 = 4 * MAX_DOCS_PER_STEP;

/// Any timeout of the spec (`*_timeout_s`, `timeout_s`), in seconds: one
/// day. Far above any real wait, and small enough that every clock sum and
/// `Duration` built from it is exact (1e300 used to panic the thread that
/// turned it into a `Duration`).
pub const MAX_TIMEOUT_S: f64 = 86_400.0;
/// `rl.engine.retries`: attempts after the first. Backoff doubles per
/// attempt, so more would only keep a dead engine's job waiting.
pub const MAX_ENGINE_RETRIES: u32 = 10;

/// The step-size settings of one step, as far as the bounds care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepShape {
    pub docs_per_step: Option<u64>,
    pub tokens_per_step: Option<u64>,
    pub microbatches_per_rank: Option<u32>,
    pub max_tokens: u32,
    /// `parallel.max_workers`: a static step fills `k` microbatches on
    /// every rank, so its size grows with the world.
    pub max_workers: u32,
}

/// What a loaded dataset holds (files only; a streamed job's queue is
/// bounded by `rl.queue_capacity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DatasetSize {
    /// Documents; for policy gradient, rollouts (what `docs_per_step` counts).
    pub docs: u64,
    pub tokens: u64,
}

/// `value` over `max`: the message naming both.
pub fn over(value: u64, max: u64, what: &str) -> Option<String> {
    (value > max).then(|| format!("{value} is more than the limit of {max} {what}"))
}

/// Every bound `shape` breaks, as (field, message). Zeros are the spec's
/// own "must be at least 1" rules, not checked here.
pub fn check_step(shape: &StepShape, bad: &mut impl FnMut(&str, String)) {
    let mut field = |field: &str, problem: Option<String>| {
        if let Some(message) = problem {
            bad(field, message);
        }
    };
    if let Some(n) = shape.docs_per_step {
        field(
            "batch.docs_per_step",
            over(n, MAX_DOCS_PER_STEP, "documents per step"),
        );
    }
    if let Some(t) = shape.tokens_per_step {
        field(
            "batch.tokens_per_step",
            over(t, MAX_TOKENS_PER_STEP, "tokens per step"),
        );
    }
    field(
        "data.max_tokens",
        over(
            u64::from(shape.max_tokens),
            u64::from(MAX_MICROBATCH_TOKENS),
            "tokens per microbatch",
        ),
    );
    if let Some(k) = shape.microbatches_per_rank {
        let per_rank = over(
            u64::from(k),
            u64::from(MAX_MICROBATCHES_PER_RANK),
            "microbatches per rank",
        );
        let step = u64::from(k) * u64::from(shape.max_workers) * u64::from(shape.max_tokens);
        let tokens = (per_rank.is_none() && step > MAX_TOKENS_PER_STEP).then(|| {
            format!(
                "{k} microbatches per rank × {} workers (parallel.max_workers) × {} tokens \
                 (data.max_tokens) is {step} tokens per step, more than the limit of \
                 {MAX_TOKENS_PER_STEP}",
                shape.max_workers, shape.max_tokens
            )
        });
        field("batch.microbatches_per_rank", per_rank.or(tokens));
    }
}

/// Problems of `shape` against the dataset it would read: a step holding
/// more documents or tokens than the dataset would train some document
/// twice in one step, and its plan would grow without bound.
pub fn check_against_dataset(
    shape: &StepShape,
    data: DatasetSize,
    bad: &mut impl FnMut(&str, String),
) {
    if let Some(n) = shape.docs_per_step.filter(|&n| n > data.docs) {
        bad(
            "batch.docs_per_step",
            format!(
                "{n} is more than the {} documents in data.train (a step would hold a document twice)",
                data.docs
            ),
        );
    }
    if let Some(t) = shape.tokens_per_step.filter(|&t| t > data.tokens) {
        bad(
            "batch.tokens_per_step",
            format!(
                "{t} is more than the {} tokens in data.train (a step would hold a document twice)",
                data.tokens
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(shape: StepShape, data: Option<DatasetSize>) -> Vec<(String, String)> {
        let mut p = Vec::new();
        let mut bad = |f: &str, m: String| p.push((f.to_string(), m));
        check_step(&shape, &mut bad);
        if let Some(d) = data {
            check_against_dataset(&shape, d, &mut bad);
        }
        p
    }

    fn shape() -> StepShape {
        StepShape {
            docs_per_step: Some(64),
            max_tokens: 4096,
            max_workers: 8,
            ..Default::default()
        }
    }

    #[test]
    fn ordinary_steps_pass() {
        let data = DatasetSize {
            docs: 1000,
            tokens: 1 << 20,
        };
        assert_eq!(problems(shape(), Some(data)), vec![]);
        let static_step = StepShape {
            docs_per_step: None,
            microbatches_per_rank: Some(4),
            ..shape()
        };
        assert_eq!(problems(static_step, Some(data)), vec![]);
    }

    #[test]
    fn a_billion_documents_per_step_is_refused_naming_the_field_and_the_limit() {
        let p = problems(
            StepShape {
                docs_per_step: Some(1_000_000_000),
                ..shape()
            },
            None,
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].0, "batch.docs_per_step");
        assert_eq!(
            p[0].1,
            "1000000000 is more than the limit of 1048576 documents per step"
        );
    }

    #[test]
    fn a_static_step_is_bounded_by_its_tokens_across_the_world() {
        let p = problems(
            StepShape {
                docs_per_step: None,
                microbatches_per_rank: Some(4096),
                max_tokens: 1 << 20,
                ..shape()
            },
            None,
        );
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].0, "batch.microbatches_per_rank");
        assert!(p[0].1.contains("parallel.max_workers"), "{}", p[0].1);
        let p = problems(
            StepShape {
                docs_per_step: None,
                microbatches_per_rank: Some(u32::MAX),
                ..shape()
            },
            None,
        );
        assert_eq!(
            p[0].1,
            format!(
                "{} is more than the limit of 4096 microbatches per rank",
                u32::MAX
            )
        );
    }

    #[test]
    fn a_step_larger_than_the_dataset_is_refused() {
        let data = DatasetSize {
            docs: 40,
            tokens: 900,
        };
        let p = problems(
            StepShape {
                docs_per_step: Some(41),
                ..shape()
            },
            Some(data),
        );
        assert_eq!(p[0].0, "batch.docs_per_step");
        assert!(
            p[0].1.starts_with("41 is more than the 40 documents"),
            "{}",
            p[0].1
        );
        let p = problems(
            StepShape {
                docs_per_step: None,
                tokens_per_step: Some(901),
                ..shape()
            },
            Some(data),
        );
        assert_eq!(p[0].0, "batch.tokens_per_step");
    }
}
