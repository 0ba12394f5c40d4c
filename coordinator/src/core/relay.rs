//! Which generations relay their messages and how (issue 19; the worker
//! side is the `accrue-relay` crate). A generation of at least
//! `relay_min_world` ranks whose every member can relay is cut into groups
//! of ⌈√W⌉ consecutive ranks; a group's first rank is its hub.
//! `super::routing::route` then rewrites one call's effects: every
//! message to a group's member (its hub included) but its Configure, Abort
//! and Release goes to the hub instead, in one `ToWorker::Relay` per hub,
//! which the hub forwards in order (its own it handles). At W = 1024 the coordinator sends 32
//! messages a step instead of 1024.
//!
//! Order: a follower's relayed messages keep their order among themselves
//! (one hub, one connection). A direct message can overtake a relayed one:
//! an Abort overtaking its plan is handled by the worker (it keeps the
//! aborted key; the late plan aborts at once), and a Configure ends the
//! generation the relayed messages belonged to.

use std::sync::Arc;

use super::types::{JobId, WorkerId};

/// A relayed generation's layout, decided when it forms.
#[derive(Debug, Clone, PartialEq)]
pub struct Relaying {
    /// Proves a follower's connection to its hub (random per generation).
    pub token: Arc<[u8]>,
    /// Ranks per group (its hub and ⌈√W⌉ − 1 followers).
    pub group: u32,
}

/// What one member's Configure says about the relay.
#[derive(Debug, Clone, PartialEq)]
pub enum RelayRole {
    /// It relays for `followers` (ranks), who dial it with `token`.
    Hub {
        token: Arc<[u8]>,
        followers: Vec<u32>,
    },
    /// Its messages come through its hub, rank `hub` at `hub_addr`.
    Follower {
        token: Arc<[u8]>,
        hub: u32,
        hub_addr: String,
    },
}

/// Where a group member's messages go while its generation runs (set with
/// its Configure, replaced by the next; a hub follows itself).
#[derive(Debug, Clone, PartialEq)]
pub struct Follows {
    pub job: JobId,
    pub generation: u64,
    pub hub: WorkerId,
    pub rank: u32,
}

impl Relaying {
    /// The layout of a generation of `relay_addrs.len()` ranks, each with
    /// its worker's relay address: None below `min_world` ranks (0: never),
    /// or when a member cannot relay (an empty address).
    pub fn decide(relay_addrs: &[&str], min_world: u32) -> Option<Relaying> {
        let world = relay_addrs.len() as u32;
        if min_world == 0 || world < min_world.max(2) || relay_addrs.iter().any(|a| a.is_empty()) {
            return None;
        }
        Some(Relaying {
            token: rand::random::<[u8; 16]>().to_vec().into(),
            group: (world as f64).sqrt().ceil() as u32,
        })
    }

    /// The hub of `rank`.
    pub fn hub_of(&self, rank: u32) -> u32 {
        rank - rank % self.group
    }

    /// `rank`'s role among `world` ranks whose relay addresses are `addr`;
    /// None for a hub with no followers (the last group of one).
    pub fn role(&self, rank: u32, world: u32, addr: impl Fn(u32) -> String) -> Option<RelayRole> {
        let hub = self.hub_of(rank);
        if hub != rank {
            return Some(RelayRole::Follower {
                token: self.token.clone(),
                hub,
                hub_addr: addr(hub),
            });
        }
        let followers: Vec<u32> = (rank + 1..(rank + self.group).min(world)).collect();
        (!followers.is_empty()).then(|| RelayRole::Hub {
            token: self.token.clone(),
            followers,
        })
    }
}
