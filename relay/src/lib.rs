//! The plan relay (issue 19). At W = 1024 the coordinator's send path (one
//! HTTP/2 message, one task wake-up and one `writev` per worker per step)
//! was half its CPU. A relayed generation is cut into groups of consecutive
//! ranks (`wire::RelayRoute`): the coordinator sends each group's first rank,
//! its hub, one `wire::Relay` per flush holding the messages of the group's
//! other ranks, its followers, and the hub forwards each over a plain TCP
//! connection the follower opened to it. So the coordinator sends about
//! √W messages a step, and each hub √W.
//!
//! - [`Hub`]: the hub's side: a listener every worker that can relay runs,
//!   the followers' connections of its current generation, and messages
//!   queued for a follower that has not connected yet.
//! - [`dial`]: the follower's side: one connection to its hub, read into a
//!   channel the session merges with its stream.
//!
//! Frames are length-delimited (`tokio_util`'s codec: a 4-byte big-endian
//! length): the hub's challenge, the follower's `wire::RelayHello` MAC'd
//! with its group's key, the hub's proof, then `wire::CoordinatorMessage`s
//! hub to follower, each sealed (`secure`, issue 33). A follower takes
//! only the kinds the coordinator relays, of its own job and generation.
//! Nothing here decides what is relayed or when; the coordinator does
//! (Configure, Abort and Release never are). A failure is a [`Fault`]
//! naming the rank to blame, which the worker reports like a collective's.

mod codec;
mod hub;
mod link;
mod secure;

pub use hub::{Fault, Hub, HubOptions, MAX_PENDING};
pub use link::{dial, Follower, LinkError};

#[cfg(test)]
mod tests;
