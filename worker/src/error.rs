//! What went wrong on a worker, by kind (issue 13): the runner sends the
//! kind on the wire (`accrue.v1.ErrorKind`) and the coordinator decides on
//! it alone; the message is for people. Typed errors travel inside
//! `anyhow` chains (context added on the way up keeps them), and
//! [`classify`] finds the first typed cause. Nothing is classified by
//! searching a message for words, except at the one boundary where
//! libtorch gives nothing else (see [`is_out_of_memory`]).

use crate::collective::CollectiveError;
use crate::model::loss::NonFiniteLoss;
use crate::wire;

/// A typed failure of a step, a plan or a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// A loss, log-prob or gradient norm was NaN/inf: the step failed and
    /// the parameters were left untouched.
    #[error("non-finite {0}")]
    NonFinite(String),
    /// A document of the plan cannot be trained as sent (a token outside
    /// the vocabulary, a missing reference log-prob, a split pair).
    #[error("{0}")]
    Data(String),
    /// The plan or configuration is malformed (missing normalisers,
    /// sequences that do not match the row, an unknown field value).
    #[error("{0}")]
    InvalidPlan(String),
    /// The device ran out of memory.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
}

impl StepError {
    pub fn data(msg: impl Into<String>) -> anyhow::Error {
        StepError::Data(msg.into()).into()
    }

    pub fn invalid(msg: impl Into<String>) -> anyhow::Error {
        StepError::InvalidPlan(msg.into()).into()
    }

    pub fn non_finite(msg: impl Into<String>) -> anyhow::Error {
        StepError::NonFinite(msg.into()).into()
    }
}

/// The kind of a failure on the wire, and the peer a failed collective
/// blames.
pub fn classify(e: &anyhow::Error) -> (wire::ErrorKind, Option<u32>) {
    for cause in e.chain() {
        if let Some(c) = cause.downcast_ref::<CollectiveError>() {
            return (
                wire::ErrorKind::CollectiveTimeout,
                c.peer().map(|p| p as u32),
            );
        }
        if let Some(s) = cause.downcast_ref::<StepError>() {
            let kind = match s {
                StepError::NonFinite(_) => wire::ErrorKind::NonFinite,
                StepError::Data(_) => wire::ErrorKind::Data,
                StepError::InvalidPlan(_) => wire::ErrorKind::InvalidPlan,
                StepError::OutOfMemory(_) => wire::ErrorKind::OutOfMemory,
            };
            return (kind, None);
        }
        if cause.downcast_ref::<NonFiniteLoss>().is_some() {
            return (wire::ErrorKind::NonFinite, None);
        }
        if let Some(t) = cause.downcast_ref::<tch::TchError>() {
            if is_out_of_memory(&t.to_string()) {
                return (wire::ErrorKind::OutOfMemory, None);
            }
        }
    }
    (wire::ErrorKind::Internal, None)
}

/// Whether a libtorch failure is an allocation failure. libtorch raises
/// `c10::OutOfMemoryError` (CUDA) or a `c10::Error` from its CPU allocator,
/// and only their messages cross its C API into `tch`: this is the one
/// place the worker reads an error's text.
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("out of memory")
        || m.contains("not enough memory")
        || m.contains("can't allocate memory")
        || m.contains("cannot allocate memory")
}

/// The error a panic on the runner thread becomes (libtorch's non-`f_`
/// calls panic on a C++ exception): out of memory when the panic says so,
/// else internal, naming the panic.
pub fn from_panic(payload: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let text = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    if is_out_of_memory(text) {
        StepError::OutOfMemory(text.to_string()).into()
    } else {
        anyhow::anyhow!("the trainer panicked: {text}")
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    #[test]
    fn kinds_survive_context_and_are_found_by_type() {
        let kind = |e: anyhow::Error| classify(&e).0;
        let wrapped = Err::<(), _>(StepError::data("token 9000 outside the vocabulary"))
            .context("microbatch 3")
            .unwrap_err();
        assert_eq!(kind(wrapped), wire::ErrorKind::Data);
        let nf = anyhow::Error::from(NonFiniteLoss {
            value: f64::NAN,
            chunk: 0,
            start: 0,
            end: 4,
        })
        .context("microbatch 0");
        assert_eq!(kind(nf), wire::ErrorKind::NonFinite);
        let coll = anyhow::Error::from(CollectiveError::Timeout {
            op: "all_reduce",
            seq: 4,
            peer: 2,
            secs: 60.0,
        })
        .context("optimizer step");
        assert_eq!(
            classify(&coll),
            (wire::ErrorKind::CollectiveTimeout, Some(2))
        );
        // Words alone classify nothing.
        assert_eq!(
            kind(anyhow::anyhow!("a non-finite value, not finite")),
            wire::ErrorKind::Internal
        );
    }

    #[test]
    fn a_panic_becomes_an_error_and_allocation_failures_are_out_of_memory() {
        let p: Box<dyn std::any::Any + Send> =
            Box::new("CUDA out of memory. Tried to allocate 2.00 GiB".to_string());
        assert_eq!(
            classify(&from_panic(p.as_ref())).0,
            wire::ErrorKind::OutOfMemory
        );
        let p: Box<dyn std::any::Any + Send> = Box::new("index out of range");
        let e = from_panic(p.as_ref());
        assert_eq!(classify(&e).0, wire::ErrorKind::Internal);
        assert!(e.to_string().contains("index out of range"), "{e}");
    }
}
