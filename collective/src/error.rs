//! Errors of the TCP ring. Each names the operation, its sequence number and
//! the peer rank it blames, so a worker can tell the coordinator which peer
//! looks dead.

/// A failed ring operation or ring setup.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RingError {
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
    /// A bad argument (configuration, root rank).
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
    /// Aborted from another thread ([`crate::RingAbort`]): the generation
    /// is over (a peer was declared lost); no peer is blamed.
    #[error("{op} #{seq}: aborted")]
    Aborted { op: &'static str, seq: u64 },
    /// An earlier operation failed; the ring cannot be used again (form a new
    /// generation).
    #[error("{op} #{seq}: ring unusable after an earlier error: {first}")]
    Broken {
        op: &'static str,
        seq: u64,
        first: Box<RingError>,
    },
}

impl RingError {
    /// The peer this error blames, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            RingError::Timeout { peer, .. }
            | RingError::PeerLost { peer, .. }
            | RingError::Mismatch { peer, .. } => Some(*peer),
            RingError::Invalid { .. } | RingError::Aborted { .. } => None,
            RingError::Broken { first, .. } => first.peer(),
        }
    }
}

/// Result of ring operations.
pub type RingResult<T> = std::result::Result<T, RingError>;
