//! This worker's part in relayed generations (issue 19, `accrue-relay`):
//! it always runs a hub listener (its address goes out at registration, so
//! the coordinator may relay its generations), opens or closes the hub at
//! each Configure, and as a follower dials its hub and reads the messages
//! it forwards. A connection that fails is reported as a collective
//! failure blaming the peer, so the generation re-forms without it.

use std::time::Duration;

use accrue_proto::v1 as wire;
use accrue_relay::{Fault, Hub, HubOptions, LinkError};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// How long a follower may take to reach its hub, and a hub waits for it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Relay {
    hub: Hub,
    faults: mpsc::UnboundedReceiver<Fault>,
    addr: String,
    max_frame: usize,
    /// As a follower: the connection to its hub, and whom to blame.
    link: Option<Link>,
    /// Its rank in the generation it was last configured for.
    rank: u32,
}

struct Link {
    rx: mpsc::UnboundedReceiver<Result<wire::CoordinatorMessage, LinkError>>,
    job: String,
    generation: u64,
    hub_rank: u32,
}

/// What the relay has for the session.
pub enum RelayEvent {
    /// A message from the coordinator, through this worker's hub.
    Message(Box<wire::CoordinatorMessage>),
    /// A connection with `peer_rank` failed: reported as a collective
    /// failure blaming it (the coordinator ignores it once the generation
    /// is over, e.g. when the hub moved on to the next one).
    Failed {
        job: String,
        generation: u64,
        peer_rank: u32,
        message: String,
    },
}

impl Relay {
    /// Serves `listener` (advertised as `addr`) on this runtime; relayed
    /// frames are at most `max_frame` bytes (the session's message limit).
    pub fn start(
        listener: std::net::TcpListener,
        addr: String,
        max_frame: usize,
    ) -> std::io::Result<Relay> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let opts = HubOptions {
            connect_timeout: CONNECT_TIMEOUT,
            max_frame,
        };
        let (hub, faults) = Hub::start(listener, opts);
        Ok(Relay {
            hub,
            faults,
            addr,
            max_frame,
            link: None,
            rank: 0,
        })
    }

    /// The address registration advertises.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A Configure: this worker's role in its new generation.
    pub fn configure(&mut self, c: &wire::Configure) {
        self.link = None;
        self.hub.close();
        self.rank = c.rank;
        let Some(r) = &c.relay else {
            return;
        };
        if !r.followers.is_empty() {
            info!(
                generation = c.generation,
                followers = r.followers.len(),
                "relay hub"
            );
            self.hub
                .open(&c.job_id, c.generation, &r.token, &r.followers);
        } else if !r.hub_addr.is_empty() {
            let me = accrue_relay::Follower {
                job: c.job_id.clone(),
                generation: c.generation,
                rank: c.rank,
                key: r.token.clone(),
            };
            let rx = accrue_relay::dial(r.hub_addr.clone(), me, CONNECT_TIMEOUT, self.max_frame);
            self.link = Some(Link {
                rx,
                job: c.job_id.clone(),
                generation: c.generation,
                hub_rank: r.hub_rank,
            });
        }
    }

    /// A relay from the coordinator: forwards the followers' messages and
    /// returns this hub's own, in order.
    pub fn forward(&self, r: wire::Relay) -> Vec<wire::CoordinatorMessage> {
        self.hub.forward(r, self.rank)
    }

    /// The next relayed message or failure. Cancel-safe (channel reads).
    pub async fn next(&mut self) -> RelayEvent {
        loop {
            let linked = async {
                match self.link.as_mut() {
                    Some(l) => l.rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                Some(f) = self.faults.recv() => {
                    warn!(rank = f.rank, generation = f.generation, why = %f.why, "relay: a follower failed");
                    return RelayEvent::Failed {
                        job: f.job,
                        generation: f.generation,
                        peer_rank: f.rank,
                        message: format!("relay to rank {}: {}", f.rank, f.why),
                    };
                }
                item = linked => match item {
                    Some(Ok(m)) => return RelayEvent::Message(Box::new(m)),
                    Some(Err(e)) => {
                        let l = self.link.take().expect("read from it");
                        warn!(hub = l.hub_rank, generation = l.generation, error = %e, "relay: the hub connection failed");
                        return RelayEvent::Failed {
                            job: l.job,
                            generation: l.generation,
                            peer_rank: l.hub_rank,
                            message: format!("relay from rank {}: {e}", l.hub_rank),
                        };
                    }
                    None => self.link = None,
                },
            }
        }
    }
}
