//! Where a rank sits in a generation's ring: what `TcpRing::connect`
//! needs, checked before any socket opens.

use std::time::Duration;

use crate::error::{CollectiveError, CollectiveResult};
use crate::link::LinkKey;

/// Where this rank sits in a generation's ring.
#[derive(Debug, Clone)]
pub struct RingConfig {
    pub rank: usize,
    pub world: usize,
    /// The collective address (`host:port`) of every rank, by rank. Only
    /// rank + 1 is dialled, so the others may be empty.
    pub peers: Vec<String>,
    /// Membership generation; connections and messages of any other
    /// generation are refused.
    pub generation: u64,
    /// Deadline of `connect` and of every operation.
    pub timeout: Duration,
    /// The generation's link secret: only peers holding it connect.
    pub link: LinkKey,
}

impl RingConfig {
    /// Every problem with the configuration, if any.
    pub fn validate(&self) -> CollectiveResult<()> {
        let mut problems = Vec::new();
        if self.world == 0 {
            problems.push("world size is 0".to_string());
        } else if self.rank >= self.world {
            problems.push(format!("rank {} outside world {}", self.rank, self.world));
        }
        if self.peers.len() != self.world {
            problems.push(format!(
                "{} peer addresses for world {}",
                self.peers.len(),
                self.world
            ));
        }
        if self.timeout.is_zero() {
            problems.push("timeout is 0".to_string());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(CollectiveError::Setup(problems.join("; ")))
        }
    }
}
