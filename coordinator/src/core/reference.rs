//! The cached reference pass (`objective.reference = "cached"`, DESIGN.md
//! and issue 5): before the first training step the coordinator plans
//! forward-only chunks over every document, spread over all ranks; workers
//! report log-probs under the initial weights, and the coordinator stores
//! them by document id (persisted before use).
//! - DPO: each sequence's summed log-prob; training plans carry it as the
//!   `ref_logp` scalar of each sequence.
//! - Policy gradient with `kl_coef > 0` (file rollouts): every token's
//!   log-prob; training plans carry them as the microbatch's
//!   `ref_logprobs`, aligned with the token row like old log-probs.
//!
//! Resumable by construction: only documents missing from the cache are
//! planned, so a lost worker costs its unfinished chunk and a restarted
//! coordinator picks up where the store left off; a complete cache skips
//! the pass.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::job::objective::Reference;
use crate::job::spec::JobSpec;
use crate::stream::doc::{DocId, Document};

/// One sequence's reference log-prob as a rank reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqLogp {
    pub doc: DocId,
    /// 0 = chosen, 1 = rejected.
    pub role: u32,
    pub logp: f64,
    /// Per-token log-probs aligned with the sequence's tokens (0 where no
    /// label); reported for policy-gradient jobs, empty for DPO.
    pub tokens: Vec<f32>,
}

/// One document's cached reference log-probs.
#[derive(Debug, Clone, PartialEq)]
pub enum RefEntry {
    /// DPO: `[chosen, rejected]` summed over each sequence's loss tokens.
    Pair([f64; 2]),
    /// A rollout: one log-prob per token of its sequence (shared: plans
    /// hold it and the session task copies it to the wire).
    Tokens(Arc<[f32]>),
}

/// Reference log-probs per document.
pub type ReferenceLogps = BTreeMap<DocId, RefEntry>;

/// What a job's reference pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassKind {
    /// Summed log-probs of both sequences of each pair (DPO).
    Pairs,
    /// Per-token log-probs of each rollout (policy-gradient KL).
    Tokens,
}

/// The reference pass a job needs before step 1, if any.
pub fn pass_kind(spec: &JobSpec) -> Option<PassKind> {
    if spec
        .objective
        .dpo()
        .is_some_and(|d| d.reference == Reference::Cached)
    {
        return Some(PassKind::Pairs);
    }
    // Streamed rollouts arrive after step 1: the spec refuses a cached KL
    // for them, and they never get here.
    spec.objective
        .pg()
        .filter(|p| p.kl_coef > 0.0 && p.reference == Reference::Cached)
        .filter(|_| !spec.data.is_stream())
        .map(|_| PassKind::Tokens)
}

/// Whether a job needs a cached reference pass at all.
pub fn needs_cache(spec: &JobSpec) -> bool {
    pass_kind(spec).is_some()
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
        match self.logps.get(doc)? {
            RefEntry::Pair(p) => Some(*p),
            RefEntry::Tokens(_) => None,
        }
    }

    /// The rollout's per-token reference log-probs.
    pub fn tokens(&self, doc: &DocId) -> Option<&Arc<[f32]>> {
        match self.logps.get(doc)? {
            RefEntry::Tokens(t) => Some(t),
            RefEntry::Pair(_) => None,
        }
    }
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
    #[error("reference pass: {doc} has {got} per-token log-probs for {want} tokens")]
    TokenCount { doc: DocId, got: usize, want: usize },
    #[error("reference pass: non-finite per-token log-prob {logp} for {doc} at token {at}")]
    NonFiniteToken { doc: DocId, at: usize, logp: f32 },
}

/// Turns the ranks' reports for a chunk of `planned` documents into
/// cache entries. Pairs: both roles of every planned pair, finite.
/// Tokens: role 0 of every planned rollout with one finite log-prob per
/// token; `token_count` gives each rollout's length.
pub fn collect_chunk(
    planned: &[DocId],
    reports: &[SeqLogp],
    kind: PassKind,
    token_count: impl Fn(&DocId) -> usize,
) -> Result<Vec<(DocId, RefEntry)>, ChunkError> {
    let roles = match kind {
        PassKind::Pairs => 2,
        PassKind::Tokens => 1,
    };
    let mut got: BTreeMap<DocId, [Option<&SeqLogp>; 2]> =
        planned.iter().map(|&d| (d, [None, None])).collect();
    for r in reports {
        let slot = got
            .get_mut(&r.doc)
            .and_then(|s| s[..roles].get_mut(r.role as usize))
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
        *slot = Some(r);
    }
    planned
        .iter()
        .map(|&doc| {
            let [c, r] = got[&doc];
            let c = c.ok_or(ChunkError::Missing { doc, role: 0 })?;
            let entry = match kind {
                PassKind::Pairs => {
                    let r = r.ok_or(ChunkError::Missing { doc, role: 1 })?;
                    RefEntry::Pair([c.logp, r.logp])
                }
                PassKind::Tokens => {
                    let want = token_count(&doc);
                    if c.tokens.len() != want {
                        return Err(ChunkError::TokenCount {
                            doc,
                            got: c.tokens.len(),
                            want,
                        });
                    }
                    if let Some((at, &logp)) =
                        c.tokens.iter().enumerate().find(|(_, x)| !x.is_finite())
                    {
                        return Err(ChunkError::NonFiniteToken { doc, at, logp });
                    }
                    RefEntry::Tokens(c.tokens.as_slice().into())
                }
            };
            Ok((doc, entry))
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
        let rep = |doc, role, logp| SeqLogp {
            doc,
            role,
            logp,
            tokens: Vec::new(),
        };
        let pairs = |reports: &[SeqLogp]| collect_chunk(&planned, reports, PassKind::Pairs, |_| 0);
        let full = [
            rep(id(2), 1, -4.0),
            rep(id(1), 0, -1.0),
            rep(id(2), 0, -3.0),
            rep(id(1), 1, -2.0),
        ];
        assert_eq!(
            pairs(&full).unwrap(),
            vec![
                (id(1), RefEntry::Pair([-1.0, -2.0])),
                (id(2), RefEntry::Pair([-3.0, -4.0]))
            ]
        );
        assert_eq!(
            pairs(&full[..3]),
            Err(ChunkError::Missing {
                doc: id(1),
                role: 1
            })
        );
        let stray = [rep(id(9), 0, -1.0)];
        assert!(matches!(pairs(&stray), Err(ChunkError::Unplanned { .. })));
        let nan = [rep(id(1), 0, f64::NAN)];
        assert!(matches!(pairs(&nan), Err(ChunkError::NonFinite { .. })));
    }

    #[test]
    fn a_token_chunk_needs_one_finite_log_prob_per_token_of_every_rollout() {
        let planned = [id(1), id(2)];
        let rep = |doc, tokens: Vec<f32>| SeqLogp {
            doc,
            role: 0,
            logp: -1.0,
            tokens,
        };
        let len = |d: &DocId| d.line as usize + 1;
        let tokens = |r: &[SeqLogp]| collect_chunk(&planned, r, PassKind::Tokens, len);
        let full = [
            rep(id(2), vec![0.0, -1.0, -2.0]),
            rep(id(1), vec![0.0, -0.5]),
        ];
        assert_eq!(
            tokens(&full).unwrap(),
            vec![
                (id(1), RefEntry::Tokens(vec![0.0, -0.5].into())),
                (id(2), RefEntry::Tokens(vec![0.0, -1.0, -2.0].into()))
            ]
        );
        assert_eq!(
            tokens(&full[..1]),
            Err(ChunkError::Missing {
                doc: id(1),
                role: 0
            })
        );
        let short = [full[0].clone(), rep(id(1), vec![0.0])];
        assert_eq!(
            tokens(&short),
            Err(ChunkError::TokenCount {
                doc: id(1),
                got: 1,
                want: 2
            })
        );
        let nan = [full[0].clone(), rep(id(1), vec![0.0, f32::NAN])];
        assert!(matches!(
            tokens(&nan),
            Err(ChunkError::NonFiniteToken { at: 1, .. })
        ));
        // A rollout has one sequence: a role-1 report is not planned.
        let mut rejected = rep(id(1), vec![0.0, -0.5]);
        rejected.role = 1;
        assert!(matches!(
            tokens(&[full[0].clone(), rejected]),
            Err(ChunkError::Unplanned { .. })
        ));
    }
}
