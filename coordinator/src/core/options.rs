//! Tunables of the state machine.

/// Tunables of the state machine.
#[derive(Debug, Clone)]
pub struct CoordinatorOptions {
    /// A worker silent for this long is declared lost.
    pub heartbeat_timeout_ms: i64,
    /// After a restart, how long a job waits for the members of its last
    /// generation to re-register (they may still hold its state in memory)
    /// before forming a generation without them.
    pub rejoin_grace_ms: i64,
    /// Generations of at least this many ranks relay their messages
    /// through hubs (`super::relay`) when every member can; 0: never.
    pub relay_min_world: u32,
    /// Workers seal their ring links' bytes (`super::links`): set when
    /// the coordinator serves TLS, so the link secrets reach them privately.
    pub seal_links: bool,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        Self {
            heartbeat_timeout_ms: 2_000,
            rejoin_grace_ms: 10_000,
            relay_min_world: RELAY_MIN_WORLD,
            seal_links: false,
        }
    }
}

/// The default [`CoordinatorOptions::relay_min_world`]: below it the
/// messages saved do not pay for the extra hop.
pub const RELAY_MIN_WORLD: u32 = 64;
