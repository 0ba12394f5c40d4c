//! Who forms a job's next generation, and where its state comes from: a
//! pure decision over the job and the registry ([`compose`]), apart from
//! the messages that carry it out (`super::generations`). torchft's
//! `quorum_compute` is the model.

use std::collections::BTreeMap;

use super::job::Job;
use super::phase::Phase;
use super::recovery::{self, Decision, NoSource, Situation};
use super::types::{HeldState, WorkerId};
use super::workers::Worker;

/// The outcome of [`compose`].
#[derive(Debug, Clone, PartialEq)]
pub enum Composition {
    /// Form a generation of `members` (rank order) from `decision`.
    Form {
        members: Vec<WorkerId>,
        /// A disaggregated job's generators (`rl.generators`): the last
        /// of the chosen workers (those without training state come
        /// last), outside the training ranks.
        generators: Vec<WorkerId>,
        decision: Decision,
        /// Formed under "restore from disk" (see `Generation::disk_only`).
        disk_only: bool,
    },
    /// Not yet; the job's status reason says why.
    Wait(String),
    /// No source of state can reach the committed step: the job fails.
    Fail(NoSource),
}

/// The generation `job` (waiting, at `now_ms`) would form from the
/// available workers: holders of its state first, at most `max_workers`,
/// at least `min_workers`. After a coordinator restart it waits, until its
/// rejoin deadline, for every member of its last generation.
pub fn compose(now_ms: i64, job: &Job, workers: &BTreeMap<WorkerId, Worker>) -> Composition {
    let (rejoin_until_ms, disk_only) = match &job.phase {
        Phase::Waiting {
            rejoin_until_ms,
            disk_only,
        } => (*rejoin_until_ms, *disk_only),
        _ => (None, false),
    };
    let id = job.rec.id.as_str();
    let (min, max) = (job.spec.parallel.min_workers, job.spec.parallel.max_workers);
    let available = |w: &WorkerId| workers.get(w).is_some_and(Worker::available);
    let missing = job.rec.members.iter().filter(|m| !available(m)).count();
    if let Some(deadline) = rejoin_until_ms.filter(|&d| missing > 0 && now_ms < d) {
        return Composition::Wait(format!(
            "coordinator restarted; waiting up to {} ms for {missing} member(s) of generation {} to re-register",
            deadline - now_ms,
            job.rec.generation
        ));
    }
    // Counted before anything is cloned: a waiting job is composed after
    // every registration.
    let available_now = workers.values().filter(|w| w.available()).count();
    if (available_now as u32) < min {
        return Composition::Wait(format!(
            "waiting for workers: {available_now} available, min_workers = {min}"
        ));
    }
    let mut free: Vec<(WorkerId, u64, Option<HeldState>)> = workers
        .values()
        .filter(|w| w.available())
        .map(|w| (w.id.clone(), w.seq, w.held_for(id).cloned()))
        .collect();
    recovery::member_order(id, &mut free);
    free.truncate(max as usize);
    // Disaggregated: up to rl.generators workers generate, at least one
    // trains; fewer workers than two cannot form such a generation.
    let generators = match job.spec.rl.generators {
        Some(_) if free.len() < 2 => {
            return Composition::Wait(format!(
                "waiting for workers: {} available, rl.generators needs at least 2 (one trains, one generates)",
                free.len()
            ))
        }
        Some(g) => {
            let n = (g as usize).min(free.len() - 1);
            free.split_off(free.len() - n)
                .into_iter()
                .map(|(id, _, _)| id)
                .collect()
        }
        None => Vec::new(),
    };
    // Whole context-parallel groups train: the trainers beyond the last
    // whole group wait as spares (the last in member order: those
    // holding no state of the job).
    let context = job.spec.parallel.context.max(1) as usize;
    if context > 1 {
        if free.len() < context {
            return Composition::Wait(format!(
                "waiting for workers: {} could train, parallel.context = {context} needs a whole group",
                free.len()
            ));
        }
        free.truncate(free.len() / context * context);
    }
    let (members, held): (Vec<WorkerId>, Vec<Option<HeldState>>) =
        free.into_iter().map(|(id, _, h)| (id, h)).unzip();
    let history_from = replayable_from(job);
    match recovery::decide(&Situation {
        sharding: job.spec.parallel.sharding,
        committed: job.rec.step,
        members: &held,
        checkpoints: &job.rec.checkpoints,
        history_from,
        init_allowed: job.rec.init_allowed() && history_from == 0,
        memory_allowed: !disk_only,
    }) {
        Ok(decision) => Composition::Form {
            members,
            generators,
            decision,
            disk_only,
        },
        Err(e) => Composition::Fail(e),
    }
}

/// The lowest step `k` such that every committed step after it is in the
/// job's history, in memory or in the store (so a source at `k` can be
/// replayed up to the committed step).
fn replayable_from(job: &Job) -> u64 {
    let mut k = job.rec.step;
    // Steps dropped from memory are in the store: a replay loads them.
    let stored = |k: u64| k <= job.data.history_stored_through;
    while k > job.rec.history_from && (stored(k) || job.data.history.contains_key(&k)) {
        k -= 1;
    }
    k
}
