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
    #[error("invalid update of job {job}: {}", .problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    InvalidUpdate {
        job: String,
        problems: Vec<crate::spec::SpecProblem>,
    },
}

pub type Result<T> = std::result::Result<T, CoreError>;
