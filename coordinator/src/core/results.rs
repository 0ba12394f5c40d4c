//! The ranks' answers to a plan: each result checked against the rank's
//! plan, gathered results taken from rank 0 whole, a worker's error turned
//! into what it costs (a lost peer, a re-formed generation, a failed
//! job). Once every rank answered, the step is committed (`commit`).

use tracing::warn;

use super::ctx::JobCtx;
use super::events::RankResult;
use super::job::RELAY_FAILURES_BEFORE_DIRECT;
use super::phase::Work;
use super::types::{AbortReason, End, Peer, PlanKind, Why, WorkerErrorKind};

impl JobCtx<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_result(
        &mut self,
        worker: &str,
        generation: u64,
        step: u64,
        result: RankResult,
    ) {
        let context = self.job.spec.parallel.context.max(1);
        let Some(active) = self.job.active_mut() else {
            return;
        };
        let gen = &active.gen;
        let Work::InFlight(flight) = &mut active.work else {
            return;
        };
        if gen.id != generation || flight.planned.step != step {
            warn!(
                worker,
                job = %self.id,
                generation,
                step,
                "result for a stale step, ignored"
            );
            return;
        }
        let Some(rank) = gen.rank_of(worker) else {
            return;
        };
        let train = flight.planned.kind == PlanKind::Train && !flight.planned.replay;
        if train && !result.sums.is_finite() {
            // Workers refuse a non-finite loss or norm themselves; a result
            // that carries one anyway fails the step the same way.
            let message = format!(
                "rank {rank} reported a non-finite result (loss sum {}, gradient norm {})",
                result.sums.loss_sum, result.sums.grad_norm
            );
            let kind = WorkerErrorKind::NonFinite;
            return self.on_worker_error(worker, generation, step, kind, message);
        }
        // Every rank of a context-parallel group ran its group's plan rank
        // and reports the group's whole result (`Trainer` sums its ranks'
        // shares): each is checked against it, and the group's first
        // rank's is the one counted.
        let group = rank / context;
        let disagreement =
            flight
                .planned
                .disagreement(group, &result.sums, &result.logps, &result.nonfinite);
        if let Some(field) = disagreement {
            // A confused (or hostile) worker would skew every metric (or
            // fail the job on a malformed eval or reference chunk): it is
            // dropped like a failed one and the plan made again.
            let why = Why::new(
                AbortReason::WorkerError,
                format!(
                    "worker {worker} (rank {rank}) sent a result for {} {step} that disagrees with its plan: {field}",
                    flight.planned.kind.noun()
                ),
            );
            return self.refuse(worker, why);
        }
        flight.results.insert(rank, result.sums);
        if rank % context == 0 {
            flight.logps.extend(result.logps);
            flight.nonfinite.insert(group, result.nonfinite);
        }
        if flight.results.len() < gen.members.len() {
            return;
        }
        let Work::InFlight(flight) = std::mem::replace(&mut active.work, Work::Idle) else {
            unreachable!("matched above")
        };
        self.progressed();
        let job = &mut *self.job;
        job.faults.pace.observe(
            self.now - flight.started_ms,
            flight.planned.busiest_rank_tokens(),
        );
        match (flight.planned.kind, flight.planned.replay) {
            (PlanKind::Probe, _) => self.probed(flight),
            (PlanKind::Reference, _) => self.commit_reference(flight),
            (PlanKind::Eval, _) => self.commit_eval(flight),
            (PlanKind::Train, true) => self.replayed(step),
            (PlanKind::Train, false) => self.commit(flight),
        }
    }

    /// Rank 0's gathered results of a step: each entry is taken as its
    /// rank's own result (checked against that rank's plan; a disagreeing
    /// one is blamed on that rank's worker). A batch from any other member,
    /// or one that does not hold exactly one result per rank, is a protocol
    /// error: its sender is dropped like a failed worker.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_gathered(
        &mut self,
        worker: &str,
        generation: u64,
        step: u64,
        results: Vec<(u32, RankResult)>,
    ) {
        let Some(gen) = self.job.gen() else {
            return;
        };
        if gen.id != generation {
            warn!(
                worker,
                job = %self.id,
                generation,
                step,
                "gathered results for a stale generation, ignored"
            );
            return;
        }
        let world = gen.members.len();
        let refused = if gen.rank_of(worker) != Some(0) {
            Some("it is not the generation's rank 0".to_string())
        } else if results.len() != world || results.iter().any(|(r, _)| *r as usize >= world) {
            let ranks: Vec<u32> = results.iter().map(|(r, _)| *r).collect();
            Some(format!(
                "it holds ranks {ranks:?}, not one result for each of {world} ranks"
            ))
        } else {
            None
        };
        if let Some(why) = refused {
            let why = Why::new(
                AbortReason::WorkerError,
                format!("worker {worker} sent gathered results for step {step} of generation {generation}, refused: {why}"),
            );
            return self.refuse(worker, why);
        }
        let members: Vec<(String, RankResult)> = results
            .into_iter()
            .map(|(r, result)| (gen.members[r as usize].clone(), result))
            .collect();
        for (member, result) in members {
            self.note_result(&member, generation, step);
            self.on_result(&member, generation, step, result);
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_worker_error(
        &mut self,
        worker: &str,
        generation: u64,
        step: u64,
        kind: WorkerErrorKind,
        message: String,
    ) {
        let job = &*self.job;
        if kind == WorkerErrorKind::CheckpointWrite {
            // Whatever generation asked for it, a checkpoint that cannot be
            // written means the job's output is not durable: never dropped
            // as stale, never a "completed" without its model.
            if !job.rec.state.is_terminal() {
                let why = Why::new(
                    AbortReason::OutputFailed,
                    format!("checkpoint of step {step} not written on worker {worker}: {message}"),
                );
                self.finish(End::Failed(why));
            }
            return;
        }
        let Some(gen) = job.gen().filter(|g| g.id == generation) else {
            warn!(
                worker,
                job = %self.id,
                generation,
                "error from a stale generation, ignored"
            );
            return;
        };
        match kind {
            WorkerErrorKind::CollectiveTimeout { peer: Some(peer) }
                if gen.member_of(peer).is_some() =>
            {
                // The silent peer is the suspect, not the reporter: in the
                // training ring or the weight ring (a join or weight sync
                // that fails names its peer, so the same membership is
                // not formed again and again).
                let peer_id = gen.member_of(peer).expect("checked above").clone();
                let why = format!("collective timeout reported by {worker}: {message}");
                self.lose_member_for(&peer_id, &why);
            }
            // No peer, or one outside the generation's rings: nobody to
            // blame, the generation ends.
            WorkerErrorKind::CollectiveTimeout { .. } => {
                let why = Why::new(
                    AbortReason::CollectiveTimeout,
                    format!("collective timeout at step {step} on {worker}: {message}"),
                );
                self.end_generation(why, false);
            }
            WorkerErrorKind::RelayLink { peer_rank } => {
                self.on_relay_failed(worker, peer_rank, &message)
            }
            WorkerErrorKind::RestoreFailed => self.on_restore_failed(worker, &message),
            WorkerErrorKind::StateSync => {
                let why = Why::new(
                    AbortReason::StateSyncFailed,
                    format!(
                        "state sync failed on {worker}: {message}; restoring from a checkpoint"
                    ),
                );
                warn!(worker, job = %self.id, generation, %message, "state sync failed");
                if let Some(w) = self.workers.get_mut(worker) {
                    w.held = None;
                }
                self.end_generation(why, true);
            }
            WorkerErrorKind::NonFinite if self.bisects(step) => {
                self.start_bisection(worker, &message)
            }
            WorkerErrorKind::NonFinite
            | WorkerErrorKind::InvalidPlan
            | WorkerErrorKind::Internal
            | WorkerErrorKind::OutOfMemory
            | WorkerErrorKind::Data
            | WorkerErrorKind::CheckpointWrite => {
                let why = Why::new(
                    AbortReason::WorkerError,
                    format!(
                        "step {step} failed on worker {worker} ({}): {message}",
                        kind.name()
                    ),
                );
                self.finish(End::Failed(why));
            }
        }
    }

    /// A relay link of the current generation failed: the blamed rank is
    /// dropped (the hub, or a follower that could not reach its hub), and
    /// after [`RELAY_FAILURES_BEFORE_DIRECT`] such failures the job stops
    /// relaying: its next generations send every message directly, so a
    /// link that keeps failing (a network policy between pods, a hub that
    /// keeps being chosen) costs a few re-formations, not the job.
    fn on_relay_failed(&mut self, worker: &str, peer_rank: Option<u32>, message: &str) {
        let job = &mut *self.job;
        job.faults.relay_failures += 1;
        let n = job.faults.relay_failures;
        if n == RELAY_FAILURES_BEFORE_DIRECT {
            let msg = format!(
                "relaying stopped after {n} relay link failures (the last: {message}): the job's messages now go directly to each worker"
            );
            warn!(job = %self.id, "{msg}");
            self.fx
                .push(job.event(super::types::EventKind::Generation, msg, self.now));
        }
        let peer = job
            .gen()
            .zip(peer_rank)
            .and_then(|(g, r)| g.member_of(Peer::Rank(r)))
            .cloned();
        match peer {
            Some(p) => {
                let why = format!("relay link failure reported by {worker}: {message}");
                self.lose_member_for(&p, &why);
            }
            None => {
                let why = Why::new(
                    AbortReason::CollectiveTimeout,
                    format!("relay link failure on {worker}: {message}"),
                );
                self.end_generation(why, false);
            }
        }
    }
}
