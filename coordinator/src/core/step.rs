//! A planned step: its documents packed into per-rank microbatch payloads
//! with inline tokens (via `plan::solve`), its normalisers and the settings
//! it was planned with. Which documents a step takes is the planner's
//! business (`super::planner`).

use crate::cursor::Cursor;
use crate::doc::{DocBody, DocId, Document};
use crate::plan::{self, Normalizers, PackItem, PackProblem, PlanError};
use crate::rl::StalenessStats;
use crate::settings::StepSettings;

use super::metrics::MetricSums;
use super::reference::ReferenceCache;
use super::rollouts::RolloutPlan;
use super::types::PlanKind;

/// One sequence inside a microbatch payload.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRef {
    pub doc: DocId,
    /// The job's source the document belongs to (index).
    pub source: u32,
    /// 0 for SFT/rollouts and DPO chosen, 1 for DPO rejected.
    pub role: u32,
    /// Policy gradient: the rollout's group-relative advantage.
    pub advantage: Option<f64>,
    /// DPO with a cached reference: the sequence's reference log-prob.
    pub ref_logp: Option<f64>,
}

/// A microbatch ready for the wire: one flat token row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchPayload {
    /// The one source of its documents (every microbatch holds one
    /// source's documents only); 0 for padding.
    pub source: u32,
    pub token_ids: Vec<u32>,
    pub labels: Vec<i32>,
    pub cu_seq_lens: Vec<u32>,
    pub seqs: Vec<SeqRef>,
    /// Per-token old log-probs (rollouts that carry them), else empty.
    pub old_logprobs: Vec<f32>,
    /// Per-token cached reference log-probs (PG with a KL penalty and
    /// `reference = "cached"`), aligned like `old_logprobs`; NaN on a
    /// sequence with none, which the worker refuses for a KL term.
    pub ref_logprobs: Vec<f32>,
}

/// A fully planned step: identical normalisers for every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedStep {
    pub kind: PlanKind,
    pub step: u64,
    pub lr: f64,
    /// The settings it was planned with (`max_tokens` goes to the workers,
    /// all of them to the step's manifest).
    pub settings: StepSettings,
    pub cursor_after: Cursor,
    pub normalizers: Normalizers,
    /// `ranks[r]` = rank r's microbatches; every rank has the same count.
    pub ranks: Vec<Vec<MicrobatchPayload>>,
    /// The step's documents, in selection order (the step manifest).
    pub docs: Vec<DocId>,
    /// Policy-gradient steps: how old the rollouts' policies are.
    pub staleness: Option<StalenessStats>,
    /// Re-runs an already committed step after a restore (same documents
    /// and lr); its results advance the generation but never commit.
    pub replay: bool,
}

/// Per-job data the plans carry besides the documents themselves.
#[derive(Debug, Clone, Copy, Default)]
pub struct Annotations<'a> {
    /// Cached reference log-probs: DPO's `ref_logp` per sequence, PG's
    /// per-token `ref_logprobs`.
    pub reference: Option<&'a ReferenceCache>,
    /// PG: groups (the stream's unit) and advantages.
    pub rollouts: Option<&'a RolloutPlan>,
    /// The source of each file of the job (`DocId::file` indexes it).
    pub file_source: Option<&'a [u32]>,
}

impl PlannedStep {
    pub fn microbatches(&self) -> u32 {
        self.ranks.iter().map(|r| r.len() as u32).sum()
    }

    /// Where rank `rank`'s training result disagrees with what this plan
    /// gave it (microbatches, tokens, documents, loss tokens), the first
    /// such field with both values: such a result was not computed on this
    /// plan.
    pub fn disagreement(&self, rank: u32, sums: &MetricSums) -> Option<String> {
        let mbs = self.ranks.get(rank as usize)?;
        let tokens: u64 = mbs.iter().map(|m| m.token_ids.len() as u64).sum();
        // A document counts at its first sequence (role 0), as workers count.
        let docs = mbs.iter().flat_map(|m| &m.seqs).filter(|q| q.role == 0);
        let checks = [
            (
                "microbatches",
                u64::from(sums.microbatches),
                mbs.len() as u64,
            ),
            ("tokens", sums.tokens, tokens),
            ("documents", sums.documents, docs.count() as u64),
            ("loss tokens", sums.loss_tokens, rank_loss_tokens(mbs)),
        ];
        checks
            .into_iter()
            .find(|(_, got, planned)| got != planned)
            .map(|(field, got, planned)| format!("{field} {got}, planned {planned}"))
    }

    /// Tokens of the rank with the most: what the step's time follows.
    pub fn busiest_rank_tokens(&self) -> u64 {
        self.ranks
            .iter()
            .map(|mbs| mbs.iter().map(|m| m.token_ids.len() as u64).sum())
            .max()
            .unwrap_or(0)
    }
}

/// Loss tokens of one rank's microbatches as every objective's worker
/// counts them (SFT, DPO and policy gradient alike): per sequence, the
/// labels after its first that are not ignored (the shift stays inside a
/// document), the count the plan's normaliser T sums.
fn rank_loss_tokens(mbs: &[MicrobatchPayload]) -> u64 {
    mbs.iter()
        .flat_map(|m| {
            m.cu_seq_lens
                .windows(2)
                .map(|w| crate::doc::count_loss_tokens(&m.labels[w[0] as usize..w[1] as usize]))
        })
        .sum()
}

/// Packs `chosen` into microbatches of at most `max_tokens`, spreads them
/// over `world_size` ranks (equal counts), and materialises the payloads.
/// A microbatch holds documents of one source only (`notes.source_of`), so
/// its metric sums are that source's.
pub fn pack_documents(
    chosen: &[&Document],
    max_tokens: u32,
    world_size: u32,
    min_microbatches_per_rank: u32,
    notes: Annotations<'_>,
) -> Result<(Vec<Vec<MicrobatchPayload>>, Normalizers), PlanError> {
    let groups = match notes.file_source {
        Some(fs) if fs.iter().any(|&s| s != 0) => chosen
            .iter()
            .map(|d| fs.get(d.id.file as usize).copied().unwrap_or(0))
            .collect(),
        _ => Vec::new(),
    };
    let problem = PackProblem {
        items: chosen
            .iter()
            .enumerate()
            .map(|(i, d)| PackItem {
                doc: i,
                seq_lens: d.seq_lens(),
                loss_tokens: d.loss_tokens(),
                is_pair: d.is_pair(),
            })
            .collect(),
        max_tokens,
        world_size,
        min_microbatches_per_rank,
        groups,
    };
    let solution = plan::solve(&problem)?;
    let ranks = solution
        .ranks
        .iter()
        .map(|mbs| {
            mbs.iter()
                .map(|mb| {
                    payload(
                        mb.items.iter().map(|&i| chosen[problem.items[i].doc]),
                        notes,
                    )
                })
                .collect()
        })
        .collect();
    Ok((ranks, solution.normalizers))
}

/// One microbatch's payload: `docs` in order, one flat row.
pub fn payload<'a>(
    docs: impl Iterator<Item = &'a Document>,
    notes: Annotations<'_>,
) -> MicrobatchPayload {
    let mut p = MicrobatchPayload {
        cu_seq_lens: vec![0],
        ..Default::default()
    };
    // Rollouts' old and reference log-probs, aligned with the row: NaN on
    // a sequence without them (old: the worker treats its tokens as
    // on-policy; reference: the worker refuses a KL term there).
    let mut old: Vec<(usize, Option<&[f32]>)> = Vec::new();
    let mut refs: Vec<(usize, Option<&[f32]>)> = Vec::new();
    for d in docs {
        for (role, seq) in d.sequences().into_iter().enumerate() {
            p.token_ids.extend_from_slice(seq.input_ids());
            p.labels.extend_from_slice(&seq.labels());
            p.cu_seq_lens.push(p.token_ids.len() as u32);
            old.push((
                seq.len(),
                match &d.body {
                    DocBody::Rollout(r) => r.old_logprobs.as_deref(),
                    _ => None,
                },
            ));
            refs.push((seq.len(), notes.reference.and_then(|c| c.tokens(&d.id))));
            p.seqs.push(SeqRef {
                doc: d.id,
                source: notes
                    .file_source
                    .and_then(|fs| fs.get(d.id.file as usize).copied())
                    .unwrap_or(0),
                role: role as u32,
                advantage: notes.rollouts.and_then(|r| r.advantage.get(&d.id).copied()),
                ref_logp: notes
                    .reference
                    .and_then(|c| c.get(&d.id))
                    .map(|logps| logps[role.min(1)]),
            });
        }
    }
    p.source = p.seqs.first().map_or(0, |s| s.source);
    p.old_logprobs = aligned(&old);
    p.ref_logprobs = aligned(&refs);
    p
}

/// Per-sequence per-token values as one row (NaN for a sequence without
/// them), or empty when no sequence has any.
fn aligned(seqs: &[(usize, Option<&[f32]>)]) -> Vec<f32> {
    let mut row = Vec::new();
    if seqs.iter().any(|(_, v)| v.is_some()) {
        for &(len, v) in seqs {
            match v {
                Some(v) => row.extend_from_slice(v),
                None => row.extend(std::iter::repeat_n(f32::NAN, len)),
            }
        }
    }
    row
}
