//! ReplicatedTrainer rank 0's weight server (disaggregated RL, issue 17; see
//! `super::weights`): a thread of its own that keeps the newest policy
//! snapshot and broadcasts it over the weight ring when told, so a sync
//! never waits behind the steps queued on the runner thread.

use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use crate::collective::{AbortHandle, Collective};
use crate::error::classify;
use crate::train::policy_sync::{self, PolicyPayload};
use crate::wire;
use crate::wire::worker_message::Msg;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What trainer rank 0's weight server is told.
#[derive(Debug)]
pub enum Cmd {
    /// The newest snapshot (replaces the one held).
    Offer(PolicyPayload),
    /// Broadcast the snapshot held (at least this version) to the
    /// generators.
    Sync(wire::SyncWeights),
}

/// ReplicatedTrainer rank 0's sender of published policies over the weight ring.
pub struct WeightServer {
    tx: mpsc::Sender<Cmd>,
    /// The inbox as the runner's handle sees it: set while this server
    /// runs, cleared when it ends (its last sender goes with it).
    shared: Arc<Mutex<Option<mpsc::Sender<Cmd>>>>,
    abort: Option<AbortHandle>,
    thread: Option<JoinHandle<()>>,
}

impl WeightServer {
    pub fn start(
        job: String,
        generation: u64,
        mut ring: Box<dyn Collective>,
        out: UnboundedSender<wire::WorkerMessage>,
        shared: Arc<Mutex<Option<mpsc::Sender<Cmd>>>>,
    ) -> WeightServer {
        let (tx, rx) = mpsc::channel::<Cmd>();
        let abort = ring.abort_handle();
        let thread = std::thread::Builder::new()
            .name("accrue-weights".into())
            .spawn(move || {
                let mut held: Option<PolicyPayload> = None;
                while let Ok(cmd) = rx.recv() {
                    let s = match cmd {
                        Cmd::Offer(p) => {
                            held = Some(p);
                            continue;
                        }
                        Cmd::Sync(s) if s.job_id != job || s.generation != generation => {
                            warn!(job = %s.job_id, generation = s.generation, "weight sync for another generation, ignored");
                            continue;
                        }
                        Cmd::Sync(s) => s,
                    };
                    let sent = match held.as_ref().filter(|p| p.version >= s.version) {
                        None => Err(crate::error::StepError::invalid(format!(
                            "weight sync of step {}: trainer rank 0 holds no snapshot of it (newest: {:?})",
                            s.version,
                            held.as_ref().map(|p| p.version)
                        ))),
                        Some(p) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            policy_sync::send(ring.as_mut(), p).map(|()| p.version)
                        }))
                        .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref()))),
                    };
                    match sent {
                        Ok(v) => info!(step = v, bytes = held.as_ref().map_or(0, |p| p.len()), "policy sent to the generators"),
                        Err(e) => {
                            // The peer is a rank of the weight ring.
                            let (kind, peer) = classify(&e);
                            let message = format!("weight sync of step {}: {e:#}", s.version);
                            warn!(%message, "weight sync failed");
                            let _ = out.send(wire::WorkerMessage {
                                msg: Some(Msg::Error(wire::WorkerError {
                                    job_id: s.job_id.clone(),
                                    generation: s.generation,
                                    step: s.version,
                                    kind: kind as i32,
                                    message,
                                    peer_rank: peer,
                                    weight_ring: peer.is_some(),
                                })),
                            });
                        }
                    }
                }
            })
            .expect("spawning the weight server thread");
        *lock(&shared) = Some(tx.clone());
        WeightServer {
            tx,
            shared,
            abort,
            thread: Some(thread),
        }
    }

    pub fn offer(&self, payload: PolicyPayload) {
        // The thread ends only with this server.
        let _ = self.tx.send(Cmd::Offer(payload));
    }
}

impl Drop for WeightServer {
    /// Ends the server: a broadcast blocked on a generator that left is
    /// interrupted, then the thread ends with its channel.
    fn drop(&mut self) {
        if let Some(abort) = &self.abort {
            abort();
        }
        *lock(&self.shared) = None;
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
