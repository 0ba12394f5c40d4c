//! A hub: forwards its followers' messages, in the order the coordinator
//! sent them, on the connections they opened to it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accrue_collective::link::{rand_bytes, LinkKey, NONCE_LEN};
use accrue_proto::v1 as wire;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::codec::{FramedRead, FramedWrite};
use tracing::{debug, warn};

use crate::secure;

/// Connections not yet admitted (authenticated and matched to an open
/// generation's follower) that a hub holds at once; more are closed at
/// accept. Each holds at most a 4 KiB hello.
pub const MAX_PENDING: usize = 1024;

/// A follower the hub could not serve: the rank to blame and why. The
/// worker reports it as a step error naming that rank (the generation
/// re-forms, as after a collective's failure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub job: String,
    pub generation: u64,
    pub rank: u32,
    pub why: String,
}

#[derive(Debug, Clone)]
pub struct HubOptions {
    /// A follower must have connected this long after its generation
    /// opened; after that, messages queued for it are a [`Fault`].
    pub connect_timeout: Duration,
    /// The largest frame accepted (a hello) or sent.
    pub max_frame: usize,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions {
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
        }
    }
}

/// The relay listener of one worker process and the generation it is a
/// hub of, if any. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    state: Arc<Mutex<State>>,
    /// Wakes connections that came before their generation opened here.
    opened: Arc<Notify>,
    faults: mpsc::UnboundedSender<Fault>,
    opts: HubOptions,
    /// Permits of connections not yet admitted ([`MAX_PENDING`]).
    pending: Arc<Semaphore>,
}

#[derive(Default)]
struct State {
    /// The generation this worker is a hub of (at most one: a worker is in
    /// one generation at a time).
    open: Option<Generation>,
}

impl State {
    /// The open generation, if it is `generation` of `job`.
    fn open(&mut self, job: &str, generation: u64) -> Option<&mut Generation> {
        self.open
            .as_mut()
            .filter(|g| g.job == job && g.generation == generation)
    }
}

enum Admit {
    Yes(LinkKey),
    No(String),
    NotYet,
}

struct Generation {
    job: String,
    generation: u64,
    /// Each follower's group key (hubs sharing a listener have their own).
    keys: HashMap<u32, LinkKey>,
    followers: HashMap<u32, Follower>,
}

enum Follower {
    /// Not connected yet: what arrived for it meanwhile, in order.
    Waiting(Vec<Bytes>),
    Connected(mpsc::UnboundedSender<Bytes>),
    /// Reported once; later messages for it are dropped (the generation
    /// is re-forming).
    Failed,
}

impl Hub {
    /// Serves `listener` until the runtime stops; faults arrive on the
    /// receiver.
    pub fn start(listener: TcpListener, opts: HubOptions) -> (Hub, mpsc::UnboundedReceiver<Fault>) {
        let (faults, rx) = mpsc::unbounded_channel();
        let hub = Hub {
            state: Arc::default(),
            opened: Arc::default(),
            faults,
            opts,
            pending: Arc::new(Semaphore::new(MAX_PENDING)),
        };
        let accepting = hub.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((sock, peer)) => {
                        let hub = accepting.clone();
                        let Ok(permit) = hub.pending.clone().try_acquire_owned() else {
                            warn!(%peer, "relay listener: {MAX_PENDING} connections pending; closed");
                            continue;
                        };
                        tokio::spawn(async move {
                            if let Err(why) = hub.serve(sock, permit).await {
                                debug!(%peer, %why, "relay connection refused");
                            }
                        });
                    }
                    Err(e) => {
                        // Out of descriptors and the like: wait, go on.
                        warn!(error = %e, "relay listener: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        (hub, rx)
    }

    /// Makes this listener the hub of `followers` in `generation` of
    /// `job`, who prove themselves with their group's `key`
    /// (`RelayRoute.token`). Ends whatever it relayed for another
    /// generation (those connections close); for the same one it adds them
    /// (several hubs of a generation may share a listener: the benchmark's
    /// simulated workers do). A key that is no key relays nothing: its
    /// followers' connections are refused and they report the hub.
    pub fn open(&self, job: &str, generation: u64, key: &[u8], followers: &[u32]) {
        let key = match secure::group_key(key) {
            Ok(k) => Some(k),
            Err(why) => {
                warn!(job, generation, %why, "relay hub opened without a key");
                None
            }
        };
        {
            let mut state = self.lock();
            let open = match state.open.take() {
                Some(g) if g.job == job && g.generation == generation => g,
                _ => Generation {
                    job: job.to_string(),
                    generation,
                    keys: HashMap::new(),
                    followers: HashMap::new(),
                },
            };
            let open = state.open.insert(open);
            for &r in followers {
                if let Some(k) = &key {
                    open.keys.insert(r, k.clone());
                }
                open.followers
                    .entry(r)
                    .or_insert_with(|| Follower::Waiting(Vec::new()));
            }
        }
        self.opened.notify_waiters();
        let (hub, job) = (self.clone(), job.to_string());
        let wait = self.opts.connect_timeout;
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            hub.expire(&job, generation);
        });
    }

    /// Relays nothing (this worker's generation is not relayed, or it is
    /// not its hub): the followers' connections close.
    pub fn close(&self) {
        self.lock().open = None;
    }

    /// Queues each of `relay`'s messages to its follower, and returns those
    /// of the hub itself, rank `own_rank`, in order. A relay for another
    /// generation than the open one is dropped: the one that replaced it
    /// is newer (Configure comes on the session, in order).
    pub fn forward(&self, relay: wire::Relay, own_rank: u32) -> Vec<wire::CoordinatorMessage> {
        let mut own = Vec::new();
        let mut state = self.lock();
        let Some(open) = state.open(&relay.job_id, relay.generation) else {
            debug!(job = %relay.job_id, generation = relay.generation, "relay for a generation this worker is no hub of: dropped");
            return own;
        };
        for m in relay.messages {
            if m.rank == own_rank {
                match wire::CoordinatorMessage::decode(m.message.as_slice()) {
                    Ok(msg) => own.push(msg),
                    Err(e) => {
                        let _ = self.faults.send(Fault {
                            job: open.job.clone(),
                            generation: open.generation,
                            rank: m.rank,
                            why: format!("its own relayed message does not decode: {e}"),
                        });
                    }
                }
                continue;
            }
            let fault = match open.followers.get_mut(&m.rank) {
                Some(Follower::Waiting(queue)) => {
                    queue.push(Bytes::from(m.message));
                    None
                }
                Some(Follower::Connected(tx)) => {
                    // An error: its writer ended, and reported why.
                    let _ = tx.send(Bytes::from(m.message));
                    None
                }
                Some(Follower::Failed) => None,
                None => Some(format!("rank {} is not a follower of this hub", m.rank)),
            };
            if let Some(why) = fault {
                let _ = self.faults.send(Fault {
                    job: open.job.clone(),
                    generation: open.generation,
                    rank: m.rank,
                    why,
                });
            }
        }
        own
    }

    /// The followers of `generation` still not connected are faults.
    fn expire(&self, job: &str, generation: u64) {
        let mut state = self.lock();
        let Some(open) = state.open(job, generation) else {
            return;
        };
        for (&rank, f) in open.followers.iter_mut() {
            if matches!(f, Follower::Waiting(_)) {
                *f = Follower::Failed;
                let _ = self.faults.send(Fault {
                    job: job.to_string(),
                    generation,
                    rank,
                    why: format!(
                        "did not connect to its relay hub within {:?}",
                        self.opts.connect_timeout
                    ),
                });
            }
        }
    }

    /// One follower's connection: the challenge, its hello (bounded,
    /// within [`secure::HELLO_TIMEOUT`]), admission once its generation
    /// is open here and its MAC verifies, the answer, then its messages,
    /// sealed, until the generation ends or writing fails.
    async fn serve(
        &self,
        sock: TcpStream,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(), String> {
        let _ = sock.set_nodelay(true);
        let (read, write) = sock.into_split();
        let mut out = FramedWrite::new(write, crate::codec::codec(self.opts.max_frame + 16));
        let challenge = rand_bytes::<NONCE_LEN>();
        out.send(Bytes::copy_from_slice(&challenge))
            .await
            .map_err(|e| format!("challenge: {e}"))?;
        // A hello is small: a stranger's length prefix cannot make this
        // reserve more than 4 KiB.
        let mut frames = FramedRead::new(read, crate::codec::codec(secure::HELLO_MAX));
        let hello = match tokio::time::timeout(secure::HELLO_TIMEOUT, frames.next()).await {
            Ok(Some(Ok(b))) => wire::RelayHello::decode(b).map_err(|e| format!("hello: {e}"))?,
            Ok(Some(Err(e))) => return Err(format!("hello: {e}")),
            Ok(None) => return Err("closed before its hello".into()),
            Err(_) => return Err("no hello in time".into()),
        };
        drop(frames);
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        // A follower may dial before its hub read the Configure that opens
        // their generation: it waits for that, as long as a follower may
        // take to connect.
        let deadline = tokio::time::Instant::now() + self.opts.connect_timeout;
        let key = loop {
            let opened = self.opened.notified();
            tokio::pin!(opened);
            opened.as_mut().enable();
            match self.admit(&hello, &challenge, &tx) {
                Admit::Yes(key) => break key,
                Admit::No(why) => return Err(why),
                Admit::NotYet => {}
            }
            if tokio::time::timeout_at(deadline, opened).await.is_err() {
                return Err(format!(
                    "rank {} of generation {} of job {}: not a generation this worker is hub of",
                    hello.rank, hello.generation, hello.job_id
                ));
            }
        };
        drop((tx, permit));
        let answer = secure::accept(&key, &challenge, &hello);
        let mut sealing = secure::sealing(&key, &challenge, &hello);
        let mut sent = out.send(Bytes::copy_from_slice(&answer)).await;
        // Ends when the generation's state (the last sender) is dropped.
        while sent.is_ok() {
            let Some(first) = rx.recv().await else { break };
            // Everything queued goes in one flush.
            sent = out
                .feed(Bytes::copy_from_slice(sealing.seal(&[], &first)))
                .await;
            while sent.is_ok() {
                match rx.try_recv() {
                    Ok(b) => {
                        sent = out
                            .feed(Bytes::copy_from_slice(sealing.seal(&[], &b)))
                            .await
                    }
                    Err(_) => break,
                }
            }
            sent = sent.and(SinkExt::<Bytes>::flush(&mut out).await);
        }
        if let Err(e) = sent {
            self.failed(&hello, format!("writing to it: {e}"));
        }
        Ok(())
    }

    /// Whether `hello`'s connection joins the open generation (its queued
    /// messages go to `tx`; the follower's key returned), is refused (not
    /// authentic, or its generation is over), or may belong to one not
    /// open yet.
    fn admit(
        &self,
        hello: &wire::RelayHello,
        challenge: &[u8],
        tx: &mpsc::UnboundedSender<Bytes>,
    ) -> Admit {
        let mut state = self.lock();
        let open = match state.open.as_mut() {
            Some(g) if g.job == hello.job_id && g.generation == hello.generation => g,
            Some(g) if g.job == hello.job_id && g.generation > hello.generation => {
                return Admit::No(format!(
                    "rank {}: generation {} is over (this hub is in {})",
                    hello.rank, hello.generation, g.generation
                ));
            }
            _ => return Admit::NotYet,
        };
        // Not (yet) a follower: another hub sharing this listener may still
        // open it (the benchmark's simulated workers share listeners).
        let Some(key) = open.keys.get(&hello.rank).cloned() else {
            return Admit::NotYet;
        };
        if !secure::hello_is_authentic(&key, challenge, hello) {
            return Admit::No(format!(
                "rank {}: its hello is not authenticated with the group's key",
                hello.rank
            ));
        }
        let Some(f) = open.followers.get_mut(&hello.rank) else {
            return Admit::NotYet;
        };
        match std::mem::replace(f, Follower::Connected(tx.clone())) {
            Follower::Waiting(queued) => {
                for b in queued {
                    let _ = tx.send(b);
                }
                Admit::Yes(key)
            }
            other => {
                *f = other;
                Admit::No(format!("rank {}: connected already", hello.rank))
            }
        }
    }

    /// `hello`'s connection broke: a fault if its generation is still open.
    fn failed(&self, hello: &wire::RelayHello, why: String) {
        let mut state = self.lock();
        let Some(open) = state.open(&hello.job_id, hello.generation) else {
            return;
        };
        if let Some(f) = open.followers.get_mut(&hello.rank) {
            *f = Follower::Failed;
        }
        let _ = self.faults.send(Fault {
            job: hello.job_id.clone(),
            generation: hello.generation,
            rank: hello.rank,
            why,
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
