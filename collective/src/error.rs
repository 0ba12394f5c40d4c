//! The one error of every collective, the TCP ring's and the worker's
//! backends' alike (NCCL, the in-process groups). Each names the operation,
//! its sequence number and the peer rank it blames, so a worker can tell
//! the coordinator which peer looks dead.

/// A failed collective operation or group setup.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// No progress from `peer` before the operation's deadline.
    #[error("{op} #{seq}: timed out after {secs:.1}s waiting for rank {peer}")]
    Timeout {
        op: &'static str,
        seq: u64,
        peer: usize,
        secs: f64,
    },
    /// The connection to `peer` failed (closed, reset, refused).
    #[error("{op} #{seq}: rank {peer} closed the connection: {detail}")]
    PeerLost {
        op: &'static str,
        seq: u64,
        peer: usize,
        detail: String,
    },
    /// `peer` is at another generation, operation, sequence number or
    /// buffer length than this rank: the ranks diverged.
    #[error("{op}: ranks diverged: expected {expected}, rank {peer} sent {got}")]
    Mismatch {
        op: &'static str,
        peer: usize,
        expected: String,
        got: String,
    },
    /// An argument the operation cannot take: a tensor that is not flat
    /// float32 on the backend's device, a root outside the world, a length
    /// that does not fit.
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
    /// Forming the group failed (configuration, connecting, the backend's
    /// own setup); no peer is blamed.
    #[error("collective setup: {0}")]
    Setup(String),
    /// Aborted from another thread ([`crate::RingAbort`], a worker's abort
    /// handle): the generation is over (a peer was declared lost); no peer
    /// is blamed.
    #[error("{op} #{seq}: aborted")]
    Aborted { op: &'static str, seq: u64 },
    /// An earlier operation failed; the group cannot be used again (form a
    /// new generation).
    #[error("{op} #{seq}: unusable after an earlier error: {first}")]
    Broken {
        op: &'static str,
        seq: u64,
        first: Box<CollectiveError>,
    },
}

impl CollectiveError {
    /// The peer this error blames, if any (a broken group blames whom its
    /// first error blamed).
    pub fn peer(&self) -> Option<usize> {
        match self {
            CollectiveError::Timeout { peer, .. }
            | CollectiveError::PeerLost { peer, .. }
            | CollectiveError::Mismatch { peer, .. } => Some(*peer),
            CollectiveError::Invalid { .. }
            | CollectiveError::Setup(_)
            | CollectiveError::Aborted { .. } => None,
            CollectiveError::Broken { first, .. } => first.peer(),
        }
    }
}

/// Result of collective operations.
pub type CollectiveResult<T> = std::result::Result<T, CollectiveError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_group_blames_whom_its_first_error_blamed() {
        let timeout = CollectiveError::Timeout {
            op: "all_reduce",
            seq: 8,
            peer: 2,
            secs: 1.0,
        };
        let broken = |first| CollectiveError::Broken {
            op: "all_gather",
            seq: 9,
            first: Box::new(first),
        };
        assert_eq!(broken(timeout).peer(), Some(2));
        let aborted = CollectiveError::Aborted {
            op: "barrier",
            seq: 3,
        };
        assert_eq!(broken(aborted).peer(), None);
    }
}
