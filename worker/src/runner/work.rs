//! What the runner is given and what it shares with the session: the
//! trainer factory and collective connector, the work it takes, and the
//! progress the heartbeat reads.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use tch::Device;
use tracing::info;

use crate::collective::join::{join, Join};
use crate::collective::{Collective, CollectiveError};
use crate::config::JobConfig;
use crate::train::Trainer;
use crate::wire;

/// Builds a trainer for a job and this rank's collective, restoring from
/// a checkpoint directory if given.
pub type Factory = Arc<
    dyn Fn(&JobConfig, Option<&Path>, Box<dyn Collective>) -> anyhow::Result<Box<dyn Trainer>>
        + Send
        + Sync,
>;

/// Joins the collective of a generation of more than one rank, from this
/// worker's listener and the configure message (rank, world, peers,
/// generation).
pub type Connector = Arc<
    dyn Fn(&TcpListener, &wire::Configure) -> Result<Box<dyn Collective>, CollectiveError>
        + Send
        + Sync,
>;

/// The libtorch trainers, by the job's sharding (`train::build`).
pub fn default_factory() -> Factory {
    Arc::new(crate::train::build)
}

/// How long one collective may wait for a peer before it is an error. A
/// killed peer is noticed at once (its sockets close); this bounds a
/// stalled one, and must exceed the longest compute imbalance between
/// ranks in a step. `ACCRUE_COLLECTIVE_TIMEOUT_S` overrides it.
pub fn collective_timeout() -> std::time::Duration {
    let secs = std::env::var("ACCRUE_COLLECTIVE_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(60.0);
    std::time::Duration::from_secs_f64(secs)
}

/// The collective addresses by rank, as the ring needs them: the ring
/// dials only rank + 1, so from a coordinator that sends just `next` the
/// other entries stay empty; an older one lists every peer.
pub(super) fn ring_addrs(c: &wire::Configure) -> Result<Vec<String>, CollectiveError> {
    let world = c.world_size as usize;
    if c.peers.is_empty() {
        let want = (c.rank as usize + 1) % world.max(1);
        return match &c.next {
            Some(p) if p.rank as usize == want => {
                let mut addrs = vec![String::new(); world];
                addrs[want] = p.collective_addr.clone();
                Ok(addrs)
            }
            Some(p) => Err(CollectiveError::Setup(format!(
                "configure: next peer is rank {}, rank {} of {world} dials rank {want}",
                p.rank, c.rank
            ))),
            None => Err(CollectiveError::Setup(format!(
                "configure: 0 peers and no next peer for world size {world}"
            ))),
        };
    }
    let mut peers: Vec<&wire::Peer> = c.peers.iter().collect();
    peers.sort_by_key(|p| p.rank);
    if peers.len() != world || peers.iter().enumerate().any(|(i, p)| p.rank as usize != i) {
        return Err(CollectiveError::Setup(format!(
            "configure: {} peers for world size {}, ranks must be 0..{}",
            peers.len(),
            c.world_size,
            c.world_size
        )));
    }
    Ok(peers.iter().map(|p| p.collective_addr.clone()).collect())
}

/// The generation's link key from its Configure (refused when missing:
/// rings admit only holders of the generation's key).
pub fn link_key(c: &wire::Configure) -> Result<accrue_collective::LinkKey, CollectiveError> {
    accrue_collective::LinkKey::new(&c.link_key, c.seal_links).map_err(|e| {
        CollectiveError::Setup(format!("configure of generation {}: {e}", c.generation))
    })
}

/// The collective between worker processes on `device`: the generation's
/// TCP ring (peers' addresses in rank order from the configure message),
/// and over it NCCL or host staging as `collective::select` decides.
pub fn default_connector(device: Device) -> Connector {
    Arc::new(move |listener, c| {
        let addrs = ring_addrs(c)?;
        let choice = c
            .job
            .as_ref()
            .map(crate::convert::collective_choice)
            .transpose()
            .map_err(|e| CollectiveError::Setup(format!("configure: {e}")))?
            .unwrap_or(crate::config::CollectiveChoice::Auto);
        let (coll, backend) = join(
            listener,
            &Join {
                rank: c.rank as usize,
                world: c.world_size as usize,
                peers: &addrs,
                generation: c.generation,
                timeout: collective_timeout(),
                device,
                choice,
                link: link_key(c)?,
            },
        )?;
        info!(
            generation = c.generation,
            rank = c.rank,
            ?backend,
            "joined the collective"
        );
        Ok(coll)
    })
}

/// What a [`Runner`](super::Runner) is built from.
pub struct RunnerConfig {
    pub factory: Factory,
    pub connector: Connector,
    /// This worker's collective endpoint (peers connect to it); needed for
    /// world sizes above 1.
    pub listener: Option<TcpListener>,
    /// Where the trainers are built (`--device`).
    pub device: Device,
}

impl RunnerConfig {
    /// `factory` on the CPU with the default connector and no listener
    /// (world 1 only).
    pub fn new(factory: Factory) -> RunnerConfig {
        RunnerConfig::on(factory, Device::Cpu)
    }

    /// `factory` on `device` with the default connector for it.
    pub fn on(factory: Factory, device: Device) -> RunnerConfig {
        RunnerConfig {
            factory,
            connector: default_connector(device),
            listener: None,
            device,
        }
    }
}

/// Work for the runner thread, in arrival order.
#[derive(Debug)]
pub enum Work {
    Configure(Box<wire::Configure>),
    Plan(Box<wire::StepPlan>),
    Checkpoint(wire::CheckpointRequest),
    Abort(wire::Abort),
    /// Write the policy for an external generator (`rl.publish_every`).
    Publish(wire::PublishPolicy),
    /// Complete prompts with the current weights (issue 17).
    Generate(Box<wire::GeneratePlan>),
    /// Disaggregated RL: a generator loads the policy trainer rank 0
    /// broadcasts (trainer rank 0's own goes to its weight server).
    Sync(wire::SyncWeights),
}

impl Work {
    /// What it is, for messages.
    pub fn name(&self) -> String {
        match self {
            Work::Configure(c) => {
                format!("configure of job {} generation {}", c.job_id, c.generation)
            }
            Work::Plan(p) => format!("the plan of step {}", p.step),
            Work::Checkpoint(c) => format!("the checkpoint of step {}", c.step),
            Work::Abort(a) => format!("the abort of step {}", a.step),
            Work::Publish(p) => format!("publishing the policy of step {}", p.step),
            Work::Generate(g) => format!("generation round {}", g.round),
            Work::Sync(s) => format!("the weight sync of step {}", s.version),
        }
    }
}

/// Where the worker stands, read by the heartbeat without touching the thread.
#[derive(Debug, Default)]
pub struct Progress {
    pub generation: AtomicU64,
    /// Last step whose update this worker holds.
    pub step: AtomicU64,
    /// The replica held, reported when re-registering after a coordinator
    /// restart (`RegisterRequest.held`).
    pub held: Mutex<Option<wire::HeldState>>,
}

impl Progress {
    /// The replica this process holds, if any.
    pub fn held(&self) -> Option<wire::HeldState> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(super) fn set_held(&self, held: Option<wire::HeldState>) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = held;
    }
}
