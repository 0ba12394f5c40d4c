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
    #[error("job {0} has no endpoint (its spec has no [rl.serve])")]
    NotServed(String),
    /// Too many of a served job's calls wait for generation; the caller
    /// retries (HTTP 429).
    #[error("job {job}: {full}")]
    ServeFull {
        job: String,
        full: crate::rl::serve::ServeFull,
    },
    /// The job's rollout queue has no room; the pusher waits for a commit.
    #[error("the rollout queue of job {job} is full ({buffered} of {capacity} rollouts)")]
    QueueFull {
        job: String,
        buffered: u64,
        capacity: u64,
    },
    /// A pushed rollout longer than the row its step will be planned with
    /// (the live `data.max_tokens`, times `parallel.context`): it would
    /// fail the plan.
    #[error("job {job}: rollouts[{index}] has {tokens} tokens, more than {limit} (it is never truncated)")]
    RolloutTooLong {
        job: String,
        index: usize,
        tokens: u64,
        limit: crate::job::parallel::RowBudget,
    },
    /// Two live jobs would mix their checkpoints and metrics (and one's
    /// pruning delete the other's files).
    #[error("{0}")]
    OutputInUse(Box<OutputOverlap>),
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

/// A job's output directory that is, lies inside or contains a live job's,
/// wherever links and `..` lead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job.output_dir {} of job {job:?} is {nesting} {}, the output_dir of job {owner} ({name}), which is {state}: give this job another output_dir, or cancel {owner} first", .dir.display(), .owner_dir.display())]
pub struct OutputOverlap {
    /// The name of the job asking.
    pub job: String,
    pub dir: std::path::PathBuf,
    pub nesting: super::types::Nesting,
    pub owner_dir: std::path::PathBuf,
    /// The live job's id.
    pub owner: String,
    pub name: String,
    pub state: String,
}
