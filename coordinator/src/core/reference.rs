//! The DPO reference pass (`objective.reference = "cached"`, DESIGN.md and
//! issue 5): before the first training step the coordinator plans
//! forward-only chunks over every preference pair, spread over all ranks;
//! workers report each sequence's summed log-prob, and the coordinator
//! stores them by document id (persisted before use). Training plans then
//! carry each sequence's reference log-prob as the `ref_logp` scalar.
//!
//! Resumable by construction: only documents missing from the cache are
//! planned, so a lost worker costs its unfinished chunk and a restarted
//! coordinator picks up where the store left off; a complete cache skips
//! the pass.

use std::collections::BTreeMap;

use crate::doc::{DocId, Document};
use crate::objective::Reference;
use crate::plan::PlanError;
use crate::spec::{JobSpec, StepSize};

use super::step::{pack_documents, Annotations, PlanKind, PlannedStep};

/// One sequence's reference log-prob as a rank reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqLogp {
    pub doc: DocId,
    /// 0 = chosen, 1 = rejected.
    pub role: u32,
    pub logp: f64,
}

/// Reference log-probs per pair: `[chosen, rejected]`.
pub type ReferenceLogps = BTreeMap<DocId, [f64; 2]>;

/// Whether a job needs a cached reference pass at all.
pub fn needs_cache(spec: &JobSpec) -> bool {
    spec.objective
        .dpo()
        .is_some_and(|d| d.reference == Reference::Cached)
}

/// The job's cache and the progress of its pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReferenceCache {
    pub logps: ReferenceLogps,
    /// Chunks committed since this coordinator started (numbers plans).
    pub chunks: u64,
}

impl ReferenceCache {
    pub fn new(logps: ReferenceLogps) -> Self {
        Self { logps, chunks: 0 }
    }

    /// True when every pair of `docs` has both log-probs.
    pub fn complete(&self, docs: &[Document]) -> bool {
        docs.iter().all(|d| self.logps.contains_key(&d.id))
    }

    /// The pair's `[chosen, rejected]` reference log-probs.
    pub fn get(&self, doc: &DocId) -> Option<[f64; 2]> {
        self.logps.get(doc).copied()
    }
}

/// Documents per reference chunk: a training step's worth (at least 64).
fn chunk_docs(spec: &JobSpec) -> usize {
    match spec.step_size() {
        StepSize::Docs(n) => n.max(64) as usize,
        _ => 64,
    }
}

/// Plans the next forward-only chunk over pairs missing from `cache`, in
/// dataset order, or `None` when the cache is complete.
pub fn plan_chunk(
    spec: &JobSpec,
    docs: &[Document],
    cache: &ReferenceCache,
    world_size: u32,
) -> Result<Option<PlannedStep>, PlanError> {
    let chosen: Vec<&Document> = docs
        .iter()
        .filter(|d| !cache.logps.contains_key(&d.id))
        .take(chunk_docs(spec))
        .collect();
    if chosen.is_empty() {
        return Ok(None);
    }
    let (ranks, normalizers) = pack_documents(
        &chosen,
        spec.data.max_tokens,
        world_size,
        1,
        Annotations::default(),
    )?;
    Ok(Some(PlannedStep {
        kind: PlanKind::Reference,
        step: cache.chunks + 1,
        lr: 0.0,
        cursor_after: Default::default(),
        normalizers,
        ranks,
        docs: chosen.iter().map(|d| d.id).collect(),
        staleness: None,
        replay: false,
    }))
}

/// Why a chunk's reports cannot be committed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChunkError {
    #[error("reference pass: no log-prob for {doc} role {role}")]
    Missing { doc: DocId, role: u32 },
    #[error("reference pass: non-finite log-prob {logp} for {doc} role {role}")]
    NonFinite { doc: DocId, role: u32, logp: f64 },
    #[error("reference pass: {doc} role {role} reported but not planned in this chunk")]
    Unplanned { doc: DocId, role: u32 },
}

/// Turns the ranks' reports for a chunk of `planned` documents into
/// cache entries; every planned pair must have both roles, finite.
pub fn collect_chunk(
    planned: &[DocId],
    reports: &[SeqLogp],
) -> Result<Vec<(DocId, [f64; 2])>, ChunkError> {
    let mut got: BTreeMap<DocId, [Option<f64>; 2]> =
        planned.iter().map(|&d| (d, [None, None])).collect();
    for r in reports {
        let slot = got
            .get_mut(&r.doc)
            .and_then(|s| s.get_mut(r.role as usize))
            .ok_or(ChunkError::Unplanned {
                doc: r.doc,
                role: r.role,
            })?;
        if !r.logp.is_finite() {
            return Err(ChunkError::NonFinite {
                doc: r.doc,
                role: r.role,
                logp: r.logp,
            });
        }
        *slot = Some(r.logp);
    }
    planned
        .iter()
        .map(|&doc| {
            let [c, r] = got[&doc];
            let c = c.ok_or(ChunkError::Missing { doc, role: 0 })?;
            let r = r.ok_or(ChunkError::Missing { doc, role: 1 })?;
            Ok((doc, [c, r]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(line: u64) -> DocId {
        DocId { file: 0, line }
    }

    #[test]
    fn a_chunk_needs_both_roles_of_every_planned_pair() {
        let planned = [id(1), id(2)];
        let rep = |doc, role, logp| SeqLogp { doc, role, logp };
        let full = [
            rep(id(2), 1, -4.0),
            rep(id(1), 0, -1.0),
            rep(id(2), 0, -3.0),
            rep(id(1), 1, -2.0),
        ];
        assert_eq!(
            collect_chunk(&planned, &full).unwrap(),
            vec![(id(1), [-1.0, -2.0]), (id(2), [-3.0, -4.0])]
        );
        assert_eq!(
            collect_chunk(&planned, &full[..3]),
            Err(ChunkError::Missing {
                doc: id(1),
                role: 1
            })
        );
        let stray = [rep(id(9), 0, -1.0)];
        assert!(matches!(
            collect_chunk(&planned, &stray),
            Err(ChunkError::Unplanned { .. })
        ));
        let nan = [rep(id(1), 0, f64::NAN)];
        assert!(matches!(
            collect_chunk(&planned, &nan),
            Err(ChunkError::NonFinite { .. })
        ));
    }
}
