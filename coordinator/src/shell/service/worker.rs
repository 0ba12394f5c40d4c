//! `accrue.v1.WorkerService`: registration and the session stream.

use std::pin::Pin;
use std::sync::Arc;

use accrue_proto::v1 as wire;
use accrue_proto::v1::worker_message::Msg;
use accrue_proto::v1::worker_service_server::WorkerService;
use futures::{Stream, StreamExt};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, warn};

use super::convert;
use super::shared::Shared;
use crate::core::{Event, RankResult, Registration};

pub struct WorkerServiceImpl {
    shared: Arc<Shared>,
    heartbeat_interval_ms: u32,
    /// The largest message a session sends (the gRPC encoding limit).
    max_message_bytes: usize,
}

impl WorkerServiceImpl {
    pub fn new(shared: Arc<Shared>, heartbeat_interval_ms: u32, max_message_bytes: usize) -> Self {
        Self {
            shared,
            heartbeat_interval_ms,
            max_message_bytes,
        }
    }
}

type SessionStream = Pin<Box<dyn Stream<Item = Result<wire::CoordinatorMessage, Status>> + Send>>;

/// How late a session's heartbeats are read: each one's delay from the
/// worker's send time to our read, less the least delay seen on the
/// session (the two clocks' offset is unknown; the quickest heartbeat
/// stands for no delay). Measured in the shell because the read time is
/// the shell's; the state machine judges the backlog from it.
#[derive(Debug)]
struct InboundDelay {
    opened: std::time::Instant,
    least: Option<i64>,
}

impl InboundDelay {
    fn new() -> Self {
        Self {
            opened: std::time::Instant::now(),
            least: None,
        }
    }

    /// The delay of a heartbeat sent at the worker's `sent_ms` and read
    /// `read_ms` after the session opened (None: the worker sent no time).
    fn lag(&mut self, read_ms: i64, sent_ms: u64) -> Option<i64> {
        if sent_ms == 0 {
            return None;
        }
        let offset = read_ms.saturating_sub(i64::try_from(sent_ms).unwrap_or(i64::MAX));
        let least = self.least.map_or(offset, |l| l.min(offset));
        self.least = Some(least);
        // Saturating: a send time far off (a broken or hostile clock) makes
        // a huge delay, which the backlog caps, never an overflow.
        Some(offset.saturating_sub(least))
    }

    fn read_now(&mut self, sent_ms: u64) -> Option<i64> {
        let read_ms = self.opened.elapsed().as_millis() as i64;
        self.lag(read_ms, sent_ms)
    }
}

/// A `StepResult` as its rank and the core's result.
fn rank_result(r: wire::StepResult) -> Result<(u32, RankResult), Status> {
    let sums = r
        .sums
        .ok_or_else(|| Status::invalid_argument("step_result.sums: missing"))?;
    Ok((
        r.rank,
        RankResult {
            sums: convert::metric_sums(sums),
            logps: r
                .logps
                .into_iter()
                .enumerate()
                .map(|(i, l)| convert::seq_logp(i, l))
                .collect::<Result<_, _>>()?,
            nonfinite: r.nonfinite_microbatches,
        },
    ))
}

/// A worker message as a state-machine event (None: nothing to do).
fn event_of(worker: &str, msg: Msg, delay: &mut InboundDelay) -> Result<Option<Event>, Status> {
    super::validate::session_message(&msg)?;
    let worker = worker.to_string();
    Ok(Some(match msg {
        Msg::Hello(_) => return Err(Status::invalid_argument("hello: sent twice on one session")),
        Msg::Heartbeat(h) => Event::Heartbeat {
            worker,
            lag_ms: delay.read_now(h.sent_ms),
        },
        Msg::Ready(r) => Event::Ready {
            worker,
            job: r.job_id,
            generation: r.generation,
            step: r.step,
        },
        Msg::StepResult(mut r) => {
            let (job, generation, step) = (std::mem::take(&mut r.job_id), r.generation, r.step);
            let (_, result) = rank_result(r)?;
            Event::StepResult {
                worker,
                job,
                generation,
                step,
                sums: result.sums,
                logps: result.logps,
                nonfinite: result.nonfinite,
            }
        }
        Msg::StepResults(b) => Event::StepResults {
            worker,
            job: b.job_id,
            generation: b.generation,
            step: b.step,
            results: b
                .results
                .into_iter()
                .map(rank_result)
                .collect::<Result<_, _>>()?,
        },
        Msg::Error(e) => Event::WorkerError {
            worker,
            job: e.job_id,
            generation: e.generation,
            step: e.step,
            kind: convert::error_kind(e.kind, e.peer_rank, e.weight_ring),
            message: e.message,
        },
        Msg::CheckpointDone(c) => Event::CheckpointDone {
            worker,
            job: c.job_id,
            step: c.step,
        },
        Msg::PolicyPublished(p) => Event::PolicyPublished {
            worker,
            job: p.job_id,
            generation: p.generation,
            step: p.step,
        },
        // A worker that got SIGTERM leaves like an admin drain.
        Msg::Leave(_) => Event::DrainWorker { worker },
        Msg::GenerateResult(g) => super::generate::generate_result(&worker, g)?,
        Msg::WeightsSynced(w) => Event::WeightsSynced {
            worker,
            job: w.job_id,
            generation: w.generation,
            version: w.version,
            bytes: w.bytes,
            seconds: w.seconds,
        },
    }))
}

#[tonic::async_trait]
impl WorkerService for WorkerServiceImpl {
    async fn register(
        &self,
        req: Request<wire::RegisterRequest>,
    ) -> Result<Response<wire::RegisterResponse>, Status> {
        let r = req.into_inner();
        if r.hostname.is_empty() {
            return Err(Status::invalid_argument("hostname must not be empty"));
        }
        super::validate::register(&r)?;
        let held = r.held.clone().map(convert::held_from_wire).transpose()?;
        let reg = Registration {
            hostname: r.hostname,
            device: r.device,
            memory_bytes: r.memory_bytes,
            gpu_name: r.gpu_name,
            gpu_memory_bytes: r.gpu_memory_bytes,
            collective_addr: r.collective_addr,
            relay_addr: r.relay_addr,
            peak_flops: if r.peak_flops.is_finite() && r.peak_flops > 0.0 {
                r.peak_flops.round() as u64
            } else {
                0
            },
            held,
        };
        // Which id, and the registration under it, under one lock: two
        // registrations claiming one previous id cannot both take it.
        let id = {
            let mut inner = self.shared.lock();
            let id = inner
                .core
                .reusable_id(&r.previous_worker_id)
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let event = Event::RegisterWorker {
                id: id.clone(),
                reg,
            };
            self.shared.apply_locked(&mut inner, event)?;
            id
        };
        Ok(Response::new(wire::RegisterResponse {
            worker_id: id,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
        }))
    }

    type SessionStream = SessionStream;

    async fn session(
        &self,
        req: Request<Streaming<wire::WorkerMessage>>,
    ) -> Result<Response<SessionStream>, Status> {
        let mut incoming = req.into_inner();
        let worker = match incoming.next().await {
            Some(Ok(wire::WorkerMessage {
                msg: Some(Msg::Hello(h)),
            })) => super::validate::hello(&h).map(|()| h.worker_id)?,
            Some(Ok(_)) => {
                return Err(Status::invalid_argument(
                    "the first session message must be hello",
                ))
            }
            Some(Err(e)) => return Err(e),
            None => return Err(Status::invalid_argument("session closed before hello")),
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let serial = self.shared.open_session(&worker, tx.clone())?;
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut delay = InboundDelay::new();
            while let Some(item) = incoming.next().await {
                let msg = match item {
                    Ok(wire::WorkerMessage { msg: Some(m) }) => m,
                    Ok(_) => continue,
                    Err(e) => {
                        debug!(worker, %e, "session stream error");
                        break;
                    }
                };
                let result = event_of(&worker, msg, &mut delay).and_then(|ev| match ev {
                    // Queued for the tick: never the state lock.
                    Some(Event::Heartbeat { worker, lag_ms }) => {
                        shared.heartbeat(worker, lag_ms);
                        Ok(())
                    }
                    Some(ev) => shared.apply(ev),
                    None => Ok(()),
                });
                if let Err(status) = result {
                    warn!(worker, %status, "bad session message");
                    let _ = tx.send(Err(status));
                    break;
                }
            }
            shared.close_session(&worker, serial);
        });
        // Encoded here, per session: the lock only queues Arc-shared
        // messages. A hub's Relay is cut to fit the message limit.
        let limit = self.max_message_bytes;
        let encoded = UnboundedReceiverStream::new(rx).flat_map(move |m| {
            let each: Vec<Result<wire::CoordinatorMessage, Status>> = match m {
                Ok(m) => convert::to_worker_within(&m, limit)
                    .into_iter()
                    .map(Ok)
                    .collect(),
                Err(e) => vec![Err(e)],
            };
            futures::stream::iter(each)
        });
        Ok(Response::new(Box::pin(encoded)))
    }
}

#[cfg(test)]
mod tests {
    use super::InboundDelay;

    #[test]
    fn a_heartbeat_delay_is_measured_against_the_sessions_quickest() {
        let mut d = InboundDelay::new();
        // The worker's clock runs 10 s behind ours; the first arrives in 3 ms.
        assert_eq!(d.lag(10_003, 0), None);
        assert_eq!(d.lag(10_003, 1), Some(0));
        assert_eq!(d.lag(10_503, 500), Some(1));
        // Read 1.5 s after it was sent.
        assert_eq!(d.lag(12_501, 1_000), Some(1_499));
        // A quicker one lowers the baseline: no delay is negative.
        assert_eq!(d.lag(11_501, 1_500), Some(0));
        assert_eq!(d.lag(12_003, 2_000), Some(2));
    }

    #[test]
    fn a_send_time_far_off_is_a_huge_delay_not_an_overflow() {
        let mut d = InboundDelay::new();
        assert_eq!(d.lag(10_000, u64::MAX), Some(0));
        assert_eq!(d.lag(10_501, 500), Some(i64::MAX));
    }
}
