//! Errors of admin requests against the state machine.

/// Why the coordinator refused a request. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error("job {0} not found")]
    JobNotFound(String),
    #[error("worker {0} not found")]
    WorkerNotFound(String),
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
}

pub type Result<T> = std::result::Result<T, CoreError>;
