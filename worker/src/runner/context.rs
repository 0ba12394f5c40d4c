//! Context parallelism on the worker (issue 37, `parallel.context` = C):
//! each group of C consecutive training ranks forms a ring of its own, over
//! which every layer's attention of a split row runs
//! (`crate::model::context`); the trainer's collective stays the whole
//! generation's and carries the data-parallel reduction unchanged (each
//! rank's gradient is its share of its group's rows).
//!
//! The group's ring is formed at configure after the training ring (and
//! trainer rank 0's weight ring), on the same listener, behind a barrier of
//! the training collective: once every member passed it, no handshake of
//! the generation's other rings is still in flight, so the group's hellos
//! meet only the group's accepts. They also carry the generation with
//! [`CONTEXT_RING_TAG`] set, so a ring of another kind never takes one. On
//! GPUs the connector builds the group's NCCL communicator over it as it
//! does the generation's.

use super::thread::{lock, ConfigureError, Peer, Thread};
use crate::collective::{AbortHandle, CollectiveError};
use crate::config::JobConfig;
use crate::wire;

/// Set in the generation of a context-parallel group ring's handshakes
/// (below the weight ring's tag; a training ring's generation has
/// neither).
pub const CONTEXT_RING_TAG: u64 = 1 << 62;

/// The configure message that joins `c`'s context-parallel group ring (what
/// the connector reads: the rank's place in its group, the group's size,
/// the member it dials, the tagged generation); `None` when `c` names no
/// group member to dial.
fn group_configure(c: &wire::Configure, context: usize) -> Option<wire::Configure> {
    let next = c.context_next.as_ref()?;
    Some(wire::Configure {
        job_id: c.job_id.clone(),
        generation: c.generation | CONTEXT_RING_TAG,
        rank: c.rank % context as u32,
        world_size: context as u32,
        next: Some(next.clone()),
        job: c.job.clone(),
        link_key: c.link_key.clone(),
        seal_links: c.seal_links,
        ..Default::default()
    })
}

/// The training rank of place `place` in the group of training rank
/// `rank` (what an error blames).
fn member(rank: u32, context: usize, place: usize) -> u32 {
    rank / context as u32 * context as u32 + place as u32
}

impl Thread {
    /// Gives the configured replica its context-parallel group (none when
    /// `cfg.context` is 1), and the in-flight abort both rings.
    pub(super) fn join_context(
        &mut self,
        c: &wire::Configure,
        cfg: &JobConfig,
    ) -> Result<(), ConfigureError> {
        let context = cfg.context;
        let h = self.job.as_mut().expect("configured before its group");
        if context <= 1 {
            return h.exec.set_context(None).map_err(|e| {
                let msg = format!("configure: {e:#}");
                (wire::ErrorKind::InvalidPlan, msg, None)
            });
        }
        let failed = |e: CollectiveError| {
            let msg = format!(
                "configure: joining the context-parallel group of rank {} (parallel.context = {context}) in generation {}: {e}",
                c.rank, c.generation
            );
            let peer = e.peer().map(|p| Peer::Rank(member(c.rank, context, p)));
            (wire::ErrorKind::CollectiveTimeout, msg, peer)
        };
        if !(c.world_size as usize).is_multiple_of(context) {
            let msg = format!(
                "configure: a generation of {} ranks is not whole groups of parallel.context = {context}",
                c.world_size
            );
            return Err((wire::ErrorKind::InvalidPlan, msg, None));
        }
        let Some(ring) = group_configure(c, context) else {
            return Err(failed(CollectiveError::Setup(
                "the configure names no member of this rank's group (context_next)".into(),
            )));
        };
        // No handshake of the generation's other rings is in flight once
        // every member is past this.
        h.exec.barrier().map_err(|e| {
            let msg = format!("configure: before joining the context-parallel group: {e:#}");
            let peer = crate::error::classify(&e).1.map(Peer::Rank);
            (wire::ErrorKind::CollectiveTimeout, msg, peer)
        })?;
        let group = self.join_ring(&ring).map_err(failed)?;
        if (group.rank(), group.world_size()) != (ring.rank as usize, context) {
            let msg = format!(
                "configure: the group ring says place {} of {}, the coordinator place {} of {context}",
                group.rank(),
                group.world_size(),
                ring.rank
            );
            return Err((wire::ErrorKind::Internal, msg, None));
        }
        // An abort interrupts whichever ring the step is blocked on.
        if let Some(group_abort) = group.abort_handle() {
            let mut f = lock(&self.in_flight);
            let both: AbortHandle = match f.collective.take() {
                Some((_, world)) => std::sync::Arc::new(move || {
                    world();
                    group_abort();
                }),
                None => group_abort,
            };
            f.collective = Some((c.generation, both));
        }
        let h = self.job.as_mut().expect("configured before its group");
        h.exec
            .set_context(Some(Box::new(crate::collective::timed::Timed(group))))
            .map_err(|e| {
                let msg = format!("configure: {e:#}");
                (wire::ErrorKind::InvalidPlan, msg, None)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_ring_is_the_ranks_place_among_its_group() {
        let c = wire::Configure {
            generation: 5,
            rank: 5,
            world_size: 8,
            context_next: Some(wire::Peer {
                rank: 2,
                collective_addr: "h:6".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let g = group_configure(&c, 4).unwrap();
        assert_eq!((g.rank, g.world_size), (1, 4));
        assert_eq!(g.generation, 5 | CONTEXT_RING_TAG);
        assert_eq!(g.generation & super::super::WEIGHT_RING_TAG, 0);
        assert_eq!(super::super::work::ring_addrs(&g).unwrap()[2], "h:6");
        // Place 3 of rank 5's group (ranks 4..8) is rank 7.
        assert_eq!(member(5, 4, 3), 7);
        let none = wire::Configure {
            context_next: None,
            ..c
        };
        assert!(group_configure(&none, 4).is_none());
    }
}
