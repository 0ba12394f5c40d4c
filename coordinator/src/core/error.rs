//! Errors of admin requests against the state machine.

/// Why the coordinator refused a request. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("job {0} not found")]
    JobNotFound(String),
    #[error("worker {0} not found")]
    WorkerNotFound(String),
    /// A registration under an id a live registration holds.
    #[error("worker id {0} is held by a live registration")]
    WorkerIdInUse(String),
    #[error("job {job} is {state}: {action} is not possible")]
    BadJobState {
        job: String,
        state: String,
        action: &'static str,
    },
    #[error("job id {0} already exists")]
    DuplicateJob(String),
    #[error("job {0} does not take streamed rollouts (its spec has no data.source = \"stream\")")]
    NotStreamed(String),
    /// The job's rollout queue has no room; the pusher waits for a commit.
    #[error("the rollout queue of job {job} is full ({buffered} of {capacity} rollouts)")]
    QueueFull {
        job: String,
        buffered: u64,
        capacity: u64,
    },
    /// A pushed rollout longer than the `data.max_tokens` its step will
    /// be planned with (the live setting): it would fail the plan.
    #[error("job {job}: rollouts[{index}] has {tokens} tokens, more than data.max_tokens = {max_tokens} (it is never truncated)")]
    RolloutTooLong {
        job: String,
        index: usize,
        tokens: u64,
        max_tokens: u32,
    },
    /// Two live jobs would write the same checkpoints and metrics.
    #[error("job.output_dir {dir} belongs to job {owner} ({name}), which is {state}: give this job another output_dir, or cancel {owner} first")]
    OutputInUse {
        dir: std::path::PathBuf,
        owner: String,
        name: String,
        state: String,
    },
    /// A job named by a name or id prefix that fits several.
    #[error("{arg:?} names {} jobs ({}): give the id or a longer prefix", .candidates.len(), .candidates.join(", "))]
    AmbiguousJob {
        arg: String,
        candidates: Vec<String>,
    },
    #[error("document {doc} is not quarantined in job {job}")]
    NotQuarantined {
        job: String,
        doc: crate::stream::doc::DocId,
    },
    #[error("invalid update of job {job}: {}", .problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    InvalidUpdate {
        job: String,
        problems: Vec<crate::job::section::SpecProblem>,
    },
}

impl CoreError {
    /// Refusal of `action` on a job in `state`.
    pub fn bad_state(job: &str, state: super::types::JobState, action: &'static str) -> Self {
        CoreError::BadJobState {
            job: job.to_string(),
            state: state.name().to_string(),
            action,
        }
    }
}

pub type Result<T> = std::result::Result<T, CoreError>;
