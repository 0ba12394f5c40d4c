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
#[derive(Clone, PartialEq)]
pub struct Relaying {
    /// The secret each group's key derives from (random per generation,
    /// never sent: a member gets its own group's key only).
    secret: Arc<[u8]>,
    /// Ranks per group (its hub and ⌈√W⌉ − 1 followers).
    pub group: u32,
}

impl std::fmt::Debug for Relaying {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Relaying {{ group: {} }}", self.group)
    }
}

/// What one member's Configure says about the relay. `key` is its
/// group's key (`super::links::group_key`): the hub and its followers
/// authenticate each other and seal their frames with it.
#[derive(Clone, PartialEq)]
pub enum RelayRole {
    /// It relays for `followers` (ranks).
    Hub { key: Arc<[u8]>, followers: Vec<u32> },
    /// Its messages come through its hub, rank `hub` at `hub_addr`.
    Follower {
        key: Arc<[u8]>,
        hub: u32,
        hub_addr: String,
    },
}

impl std::fmt::Debug for RelayRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayRole::Hub { followers, .. } => write!(f, "Hub {{ followers: {followers:?} }}"),
            RelayRole::Follower { hub, hub_addr, .. } => {
                write!(f, "Follower {{ hub: {hub}, hub_addr: {hub_addr:?} }}")
            }
        }
    }
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
            secret: super::links::random_secret(),
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
        let key = super::links::group_key(&self.secret, hub);
        if hub != rank {
            return Some(RelayRole::Follower {
                key,
                hub,
                hub_addr: addr(hub),
            });
        }
        let followers: Vec<u32> = (rank + 1..(rank + self.group).min(world)).collect();
        (!followers.is_empty()).then_some(RelayRole::Hub { key, followers })
    }
}
