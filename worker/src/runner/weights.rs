//! Disaggregated RL on the worker (issue 17, `rl.generators`): the weight
//! ring, trainer rank 0's weight server and the generators' side.
//!
//! The weight ring is a second TCP ring (NCCL over it on GPUs, as for
//! training) of trainer rank 0 and the generators, formed at configure
//! after trainer rank 0's training ring, on the same listener: its
//! handshakes carry the generation with [`WEIGHT_RING_TAG`] set, so a
//! generator dialling early is refused as "a newer generation, wait" by
//! the training ring's accept and retries until the weight ring's turn.
//!
//! ReplicatedTrainer rank 0 keeps the newest policy snapshot (`PublishPolicy` with
//! the generators as target, taken on the runner thread in step order)
//! in its weight server (`super::weight_server`): a thread of its own that
//! broadcasts it when the coordinator says so (`SyncWeights`), so a sync
//! never waits behind the training steps queued on the runner thread, and
//! training never waits for the generators.

use tracing::info;

use super::thread::{lock, ConfigureError, Held, Peer, PlanKey, Thread};
use super::weight_server::WeightServer;
use crate::collective::{AbortHandle, Collective, CollectiveError};
use crate::config::JobConfig;
use crate::error::classify;
use crate::train::policy_sync;
use crate::train::Generator;
use crate::wire;
use crate::wire::worker_message::Msg;

/// Set in the generation of the weight ring's handshakes (a training
/// ring's generation never has it).
pub const WEIGHT_RING_TAG: u64 = 1 << 63;

/// The in-flight key of a generator's sync: no step plan has this number.
const SYNC_KEY_STEP: u64 = u64::MAX - 1;

/// The configure message that joins the weight ring `c.weights` names
/// (what the connector reads: rank, world, next, tagged generation).
fn weight_ring_configure(c: &wire::Configure) -> Option<wire::Configure> {
    let w = c.weights.as_ref()?;
    Some(wire::Configure {
        job_id: c.job_id.clone(),
        generation: c.generation | WEIGHT_RING_TAG,
        rank: w.rank,
        world_size: w.world_size,
        next: w.next.clone(),
        job: c.job.clone(),
        link_key: c.link_key.clone(),
        seal_links: c.seal_links,
        ..Default::default()
    })
}

impl Thread {
    /// Joins the weight ring of `c` (it must name one); the abort handle
    /// is returned, not kept for the runner's steps.
    pub(super) fn connect_weight_ring(
        &self,
        c: &wire::Configure,
    ) -> Result<(Box<dyn Collective>, Option<AbortHandle>), ConfigureError> {
        let failed = |e: CollectiveError| {
            let msg = format!(
                "configure: joining the weight ring of generation {}: {e}",
                c.generation
            );
            // The ring's peer is a weight-ring rank: the coordinator maps
            // it to trainer rank 0 or a generator.
            let peer = e.peer().map(|p| Peer::WeightRing(p as u32));
            (wire::ErrorKind::CollectiveTimeout, msg, peer)
        };
        let Some(ring) = weight_ring_configure(c) else {
            return Err(failed(CollectiveError::Setup("no weight ring".into())));
        };
        let coll = self.join_ring(&ring).map_err(failed)?;
        let abort = coll.abort_handle();
        Ok((Box::new(crate::collective::timed::Timed(coll)), abort))
    }

    /// ReplicatedTrainer rank 0 of a disaggregated generation: starts its weight
    /// server on the ring joined at configure; any other member ends the
    /// one it had.
    pub(super) fn serve_weights(&mut self, c: &wire::Configure) {
        self.weights = None;
        let Some(ring) = self.weight_ring.take() else {
            return;
        };
        let shared = self.weight_tx.clone();
        let server = WeightServer::start(
            c.job_id.clone(),
            c.generation,
            ring,
            self.out.clone(),
            shared,
        );
        self.weights = Some(server);
    }

    /// `Configure` of a generator: the model in the compute dtype, no
    /// training state, the weight ring as its only collective.
    pub(super) fn configure_generator(&mut self, c: &wire::Configure, cfg: &JobConfig) {
        self.weights = None;
        // A generator holds no training state: whatever replica this
        // worker had (it trained before) is dropped.
        self.job = None;
        self.progress.set_held(None);
        lock(&self.in_flight).collective = None;
        let built = self.connect_weight_ring(c).and_then(|(ring, abort)| {
            if let Some(abort) = abort {
                // A newer generation's configure interrupts a blocked sync.
                lock(&self.in_flight).collective = Some((c.generation, abort));
            }
            Generator::new(cfg, ring).map_err(|e| {
                let msg = format!("configure: building the generator's model: {e:#}");
                (wire::ErrorKind::Internal, msg, None)
            })
        });
        let generator = match built {
            Ok(g) => g,
            Err((kind, msg, peer)) => {
                return self.error_blaming(&c.job_id, c.generation, c.step, kind, msg, peer)
            }
        };
        self.job = Some(Held {
            job: c.job_id.clone(),
            generation: c.generation,
            rank: c.rank,
            world_size: c.world_size,
            // A generator runs no train steps.
            gather_results: false,
            step: c.step,
            name: cfg.name.clone(),
            exec: Box::new(generator),
        });
        self.progress
            .generation
            .store(c.generation, std::sync::atomic::Ordering::Relaxed);
        self.last_done = std::time::Instant::now();
        info!(job = %c.job_id, generation = c.generation, rank = c.rank, generators = c.world_size, "configured as a generator");
        self.send(Msg::Ready(wire::Ready {
            job_id: c.job_id.clone(),
            generation: c.generation,
            step: c.step,
        }));
    }

    /// `SyncWeights` on a generator: load the policy trainer rank 0
    /// broadcasts, then `WeightsSynced` (or an error naming why).
    pub(super) fn sync_weights(&mut self, s: &wire::SyncWeights) {
        let refuse = |held: Option<&Held>| {
            let at = held.map_or("no job".to_string(), |h| {
                format!("job {} generation {}", h.job, h.generation)
            });
            format!(
                "weight sync of step {} for job {} generation {}: this worker is a generator of {at}",
                s.version, s.job_id, s.generation
            )
        };
        let Some(h) = self
            .job
            .as_mut()
            .filter(|h| h.job == s.job_id && h.generation == s.generation)
        else {
            let msg = refuse(self.job.as_ref());
            let kind = wire::ErrorKind::InvalidPlan;
            return self.error(&s.job_id, s.generation, s.version, kind, msg, None);
        };
        lock(&self.in_flight).running = Some(PlanKey {
            job: s.job_id.clone(),
            generation: s.generation,
            step: SYNC_KEY_STEP,
        });
        let start = std::time::Instant::now();
        let got =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.exec.receive_policy()))
                .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref())));
        let seconds = start.elapsed().as_secs_f64();
        lock(&self.in_flight).running = None;
        match got {
            Ok(policy_sync::Received { version, bytes }) => {
                h.step = version;
                let rank = h.rank;
                self.progress
                    .step
                    .store(version, std::sync::atomic::Ordering::Relaxed);
                info!(
                    step = version,
                    asked = s.version,
                    bytes,
                    seconds,
                    "policy received from trainer rank 0"
                );
                self.send(Msg::WeightsSynced(wire::WeightsSynced {
                    job_id: s.job_id.clone(),
                    generation: s.generation,
                    version,
                    rank,
                    bytes,
                    seconds,
                }));
            }
            Err(e) => {
                let (kind, peer) = classify(&e);
                let msg = format!("weight sync of step {}: {e:#}", s.version);
                let peer = peer.map(Peer::WeightRing);
                self.error_blaming(&s.job_id, s.generation, s.version, kind, msg, peer);
            }
        }
    }

    /// `PublishPolicy` to the generators: every rank takes the policy (a
    /// collective under fsdp, which gathers it), rank 0 hands a copy to
    /// its weight server; then `PolicyPublished`.
    pub(super) fn publish_for_generators(&mut self, p: &wire::PublishPolicy) {
        let Some(h) = self.replica(&p.job_id, p.step, "policy") else {
            return;
        };
        let (rank, generation, step) = (h.rank, h.generation, h.step);
        let taken = if step != p.step {
            Err(crate::error::StepError::invalid(format!(
                "policy of step {} for the generators: this replica holds step {step}",
                p.step
            )))
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let policy = h.exec.policy(true)?;
                (rank == 0)
                    .then(|| policy_sync::snapshot(&policy, p.step))
                    .transpose()
            }))
            .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref())))
        };
        let payload = match taken {
            Ok(payload) => payload,
            Err(e) => {
                let msg = format!("policy of step {} for the generators: {e:#}", p.step);
                let (kind, peer) = classify(&e);
                return self.error(&p.job_id, generation, p.step, kind, msg, peer);
            }
        };
        if let Some(payload) = payload {
            match self.weights.as_ref() {
                Some(server) => server.offer(payload),
                None => {
                    let msg = format!(
                        "policy of step {} for the generators: this rank 0 has no weight ring (not a disaggregated generation)",
                        p.step
                    );
                    let kind = wire::ErrorKind::InvalidPlan;
                    return self.error(&p.job_id, generation, p.step, kind, msg, None);
                }
            }
        }
        info!(step = p.step, rank, "policy taken for the generators");
        self.send(Msg::PolicyPublished(wire::PolicyPublished {
            job_id: p.job_id.clone(),
            step: p.step,
            rank,
            path: String::new(),
            generation,
        }));
    }
}
