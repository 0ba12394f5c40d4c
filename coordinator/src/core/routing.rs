//! Sending a relayed generation's messages through its hubs (see
//! `super::relay`, which holds the layout; this rewrites the effects).

use std::collections::{BTreeMap, HashMap};

use super::effects::{Effect, ToWorker};
use super::relay::Follows;
use super::types::WorkerId;
use super::workers::Worker;

/// The job and generation a message to a worker belongs to, when it may be
/// relayed (None: it always goes on the session).
fn relayable(msg: &ToWorker) -> Option<(&str, Option<u64>)> {
    match msg {
        ToWorker::Configure { .. } | ToWorker::Abort { .. } | ToWorker::Release { .. } => None,
        ToWorker::Relay { .. } => None,
        ToWorker::Plan {
            job, generation, ..
        } => Some((job, Some(*generation))),
        ToWorker::SyncWeights {
            job, generation, ..
        }
        | ToWorker::Generate {
            job, generation, ..
        } => Some((job, Some(*generation))),
        ToWorker::Checkpoint { job, .. } | ToWorker::PublishPolicy { job, .. } => Some((job, None)),
    }
}

/// Rewrites `fx` (one call's effects, in order): each message to a
/// follower that may be relayed goes into its hub's `ToWorker::Relay`,
/// appended after everything else, hubs in the order their first message
/// came. A message is relayed only when it belongs to the generation the
/// worker follows a hub in, that generation is still its job's current
/// one (`current`, after this call), and no Configure to that worker comes
/// after it in `fx` (then it was meant for the generation before: it goes
/// direct, ahead of that Configure).
pub fn route(
    fx: &mut Vec<Effect>,
    workers: &BTreeMap<WorkerId, Worker>,
    current: impl Fn(&str) -> Option<u64>,
) {
    let follows = |w: &WorkerId| workers.get(w).and_then(|w| w.follows.as_ref());
    // Nothing to do for most calls (heartbeats, results): one pass to see.
    let any = fx.iter().any(|e| match e {
        Effect::Send { worker, msg } => relayable(msg).is_some() && follows(worker).is_some(),
        _ => false,
    });
    if !any {
        return;
    }
    let mut last_configure: HashMap<&WorkerId, usize> = HashMap::new();
    for (i, e) in fx.iter().enumerate() {
        if let Effect::Send {
            worker,
            msg: ToWorker::Configure { .. },
        } = e
        {
            last_configure.insert(worker, i);
        }
    }
    // Per effect, the hub its message goes through (one lookup each).
    let via: Vec<Option<&Follows>> = fx
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let Effect::Send { worker, msg } = e else {
                return None;
            };
            let (job, generation) = relayable(msg)?;
            let f = follows(worker)?;
            let relay = f.job == job
                && generation.is_none_or(|g| g == f.generation)
                && current(job) == Some(f.generation)
                && last_configure.get(worker).is_none_or(|&c| c < i);
            relay.then_some(f)
        })
        .collect();
    // Per hub: the index of its Relay in `relays`.
    let mut hubs: HashMap<&WorkerId, usize> = HashMap::new();
    let mut relays: Vec<Effect> = Vec::new();
    let mut kept = Vec::with_capacity(fx.len());
    for (e, via) in std::mem::take(fx).into_iter().zip(via) {
        let Some(f) = via else {
            kept.push(e);
            continue;
        };
        let Effect::Send { msg, .. } = e else {
            unreachable!("matched above")
        };
        let at = *hubs.entry(&f.hub).or_insert_with(|| {
            relays.push(Effect::Send {
                worker: f.hub.clone(),
                msg: ToWorker::Relay {
                    job: f.job.clone(),
                    generation: f.generation,
                    messages: Vec::new(),
                },
            });
            relays.len() - 1
        });
        if let Effect::Send {
            msg: ToWorker::Relay { messages, .. },
            ..
        } = &mut relays[at]
        {
            messages.push((f.rank, msg));
        }
    }
    kept.extend(relays);
    *fx = kept;
}
