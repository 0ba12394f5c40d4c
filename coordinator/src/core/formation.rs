//! Forming a generation, decided (pure, beside [`super::membership`]'s
//! who-joins): from the members and generators chosen and where their
//! state comes from, every member's `Configure` (peers, priors, the weight
//! ring of a disaggregated job, its relay role) and what each keeps of the
//! state it holds. Nothing changes here; the job's context applies it.

use std::sync::Arc;

use super::effects::ToWorker;
use super::generation::Generation;
use super::job::Job;
use super::links::LinkSecret;
use super::options::CoordinatorOptions;
use super::recovery::{self, Decision};
use super::relay::{Follows, RelayRole, Relaying};
use super::types::{HeldState, Role, WeightRing, WorkerId};
use super::workers::Workers;
use crate::job::parallel::Sharding;

/// Who forms the generation, as `membership::compose` chose.
pub struct Chosen {
    pub members: Vec<WorkerId>,
    pub generators: Vec<WorkerId>,
    pub decision: Decision,
    pub disk_only: bool,
}

/// A generation to form.
pub struct Formation {
    pub gen: Generation,
    /// Each member's and generator's Configure, trainers in rank order
    /// first.
    pub configures: Vec<(WorkerId, ToWorker)>,
    pub assignments: Vec<Assignment>,
    /// What the watch stream is told.
    pub message: String,
}

/// What a worker becomes in the generation.
pub struct Assignment {
    pub worker: WorkerId,
    /// Its training rank (generators have none).
    pub rank: Option<u32>,
    /// The hub its messages go through, in a relayed generation.
    pub follows: Option<Follows>,
    /// Whether the state it holds survives its Configure (a ddp holder
    /// only sends it; a sharded layout kept exactly as it was).
    pub keeps_held: bool,
}

/// The generation after `job`'s current one, of the `chosen` workers
/// (registered in `workers`); relayed when at least `relay_min_world`
/// members can all relay.
pub fn plan(job: &Job, workers: &Workers, opts: &CoordinatorOptions, chosen: Chosen) -> Formation {
    let Chosen {
        members,
        generators,
        decision,
        disk_only,
    } = chosen;
    let id = &job.rec.id;
    let generation = job.rec.generation + 1;
    let addr = |m: &WorkerId| (m.clone(), workers[m].reg.collective_addr.clone());
    let peers: Arc<[(WorkerId, String)]> = members.iter().map(addr).collect();
    let world = members.len();
    let priors: Arc<[Option<HeldState>]> = (0..world).map(|i| decision.prior(i).cloned()).collect();
    let prior_runs: Arc<[recovery::PriorRun]> = recovery::prior_runs(&priors).into();
    // The weight ring of a disaggregated generation: trainer rank 0, then
    // the generators; each member dials the next.
    let ring: Vec<(WorkerId, String)> = members
        .iter()
        .take(1)
        .chain(&generators)
        .map(addr)
        .collect();
    let weight_ring = |i: usize| {
        (!generators.is_empty()).then(|| WeightRing {
            rank: i as u32,
            world: ring.len() as u32,
            next: ring[(i + 1) % ring.len()].clone(),
        })
    };
    let relay_addrs: Vec<&str> = members
        .iter()
        .map(|m| workers[m].reg.relay_addr.as_str())
        .collect();
    // A job whose relay links kept failing sends directly (issue 33 (6)).
    let relaying = (job.faults.relay_failures < super::job::RELAY_FAILURES_BEFORE_DIRECT)
        .then(|| Relaying::decide(&relay_addrs, opts.relay_min_world))
        .flatten();
    // One ring secret for the generation's training and weight rings.
    let link = LinkSecret::generate(opts.seal_links);
    let relay_addr = |rank: u32| relay_addrs[rank as usize].to_string();
    let roles: Vec<Option<RelayRole>> = (0..world as u32)
        .map(|r| relaying.as_ref()?.role(r, world as u32, relay_addr))
        .collect();
    // Memory a Configure does not overwrite: a ddp holder's (it only
    // sends), or a sharded layout that stays exactly as it was.
    let unchanged_layout = priors.iter().enumerate().all(|(i, p)| {
        p.as_ref()
            .is_some_and(|p| p.rank as usize == i && p.world_size as usize == world)
    });
    let ddp = job.spec.parallel.sharding == Sharding::Ddp;
    let mut configures = Vec::with_capacity(world + generators.len());
    let mut assignments = Vec::with_capacity(world + generators.len());
    for (rank, m) in members.iter().enumerate() {
        configures.push((
            m.clone(),
            ToWorker::Configure {
                job: id.clone(),
                generation,
                rank: rank as u32,
                peers: peers.clone(),
                priors: priors.clone(),
                prior_runs: prior_runs.clone(),
                spec: job.spec.clone(),
                step: decision.step,
                restore_from: decision.restore_from(),
                role: Role::Trainer,
                weights: if rank == 0 { weight_ring(0) } else { None },
                relay: roles[rank].clone(),
                link: link.clone(),
            },
        ));
        // A hub's own messages come in its relays too.
        let follows = match (&relaying, &roles[rank]) {
            (Some(r), Some(_)) => Some(Follows {
                job: id.clone(),
                generation,
                hub: members[r.hub_of(rank as u32) as usize].clone(),
                rank: rank as u32,
            }),
            _ => None,
        };
        assignments.push(Assignment {
            worker: m.clone(),
            rank: Some(rank as u32),
            follows,
            keeps_held: priors[rank].is_some() && (ddp || unchanged_layout),
        });
    }
    let generator_peers: Arc<[(WorkerId, String)]> = generators.iter().map(addr).collect();
    for (i, m) in generators.iter().enumerate() {
        configures.push((
            m.clone(),
            ToWorker::Configure {
                job: id.clone(),
                generation,
                rank: i as u32,
                peers: generator_peers.clone(),
                priors: Arc::new([]),
                prior_runs: Arc::new([]),
                spec: job.spec.clone(),
                step: decision.step,
                restore_from: None,
                role: Role::Generator,
                weights: weight_ring(i + 1),
                relay: None,
                link: link.clone(),
            },
        ));
        // A generator holds no training state.
        assignments.push(Assignment {
            worker: m.clone(),
            rank: None,
            follows: None,
            keeps_held: false,
        });
    }
    let source = decision.describe();
    let message = match generators.len() {
        0 => format!("generation {generation} formed with {world} workers; {source}"),
        n => format!(
            "generation {generation} formed with {world} training and {n} generating workers; {source}"
        ),
    };
    let gen = Generation::new(generation, members, decision, disk_only).with_generators(generators);
    Formation {
        gen,
        configures,
        assignments,
        message,
    }
}
