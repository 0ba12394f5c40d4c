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
                        let peer_rank = blamed(&e, l.hub_rank, self.rank);
                        return RelayEvent::Failed {
                            job: l.job,
                            generation: l.generation,
                            peer_rank,
                            message: format!("relay from rank {}: {e}", l.hub_rank),
                        };
                    }
                    None => self.link = None,
                },
            }
        }
    }
}

/// Whom a follower's link failure blames (issue 33): a hub that cannot be
/// reached, or whose handshake does not complete, may be healthy (the
/// follower's own network, a partition, a stale address): the follower
/// blames itself, as the hub does when the follower never connects, so a
/// generation re-forms without the follower rather than evicting a hub
/// every other member reaches. A link that was up and then broke, or
/// carried what a hub must not send, blames the hub.
fn blamed(e: &LinkError, hub: u32, own: u32) -> u32 {
    match e {
        LinkError::Connect { .. } => own,
        LinkError::Closed
        | LinkError::Read(_)
        | LinkError::Unauthenticated { .. }
        | LinkError::Refused(_) => hub,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_follower_that_cannot_reach_its_hub_blames_itself_not_the_hub() {
        let connect = LinkError::Connect {
            addr: "10.0.0.1:7072".into(),
            why: "connection refused".into(),
        };
        assert_eq!(blamed(&connect, 0, 5), 5);
        assert_eq!(blamed(&LinkError::Closed, 0, 5), 0);
        assert_eq!(blamed(&LinkError::Refused("a Release".into()), 0, 5), 0);
    }

    /// With a real hub address nobody listens on: the failure reaches the
    /// session blaming the follower's own rank.
    #[tokio::test]
    async fn an_unreachable_hub_is_reported_against_the_follower() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let mut relay = Relay::start(l, "127.0.0.1:1".into(), 1 << 20).unwrap();
        relay.configure(&wire::Configure {
            job_id: "j".into(),
            generation: 3,
            rank: 5,
            relay: Some(wire::RelayRoute {
                token: vec![1; 32],
                hub_addr: dead_addr,
                followers: Vec::new(),
                hub_rank: 4,
            }),
            ..Default::default()
        });
        match tokio::time::timeout(std::time::Duration::from_secs(20), relay.next()).await {
            Ok(RelayEvent::Failed { peer_rank, .. }) => assert_eq!(peer_rank, 5),
            Ok(RelayEvent::Message(m)) => panic!("{m:?}"),
            Err(_) => panic!("no failure reported"),
        }
    }
}
