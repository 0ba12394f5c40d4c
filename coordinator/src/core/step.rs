//! Turns a job's documents and cursor into a planned step: which documents
//! (via `plan::select`), how they are packed and spread over ranks (via
//! `plan::solve`), and the per-rank payloads with inline tokens.

use crate::cursor::{Cursor, Order};
use crate::doc::{DocBody, DocId, Document};
use crate::plan::{self, Normalizers, PackItem, PackProblem, PlanError, StepTarget};
use crate::spec::{JobSpec, StepSize};

use super::reference::ReferenceCache;
use super::rollouts::{self, RolloutPlan};
use crate::rl::StalenessStats;

/// What workers do with a plan (mirror of `accrue.v1.PlanKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanKind {
    /// Forward, backward, optimizer step; commits a training step.
    #[default]
    Train,
    /// Forward only, per-sequence log-probs back (DPO reference pass);
    /// `step` numbers the chunk and the cursor does not move.
    Reference,
}

/// One sequence inside a microbatch payload.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRef {
    pub doc: DocId,
    /// 0 for SFT/rollouts and DPO chosen, 1 for DPO rejected.
    pub role: u32,
    pub scalars: Vec<(String, f64)>,
}

/// A microbatch ready for the wire: one flat token row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchPayload {
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
    /// Cached reference log-probs: DPO's `ref_logp` scalar per sequence,
    /// PG's per-token `ref_logprobs`.
    pub reference: Option<&'a ReferenceCache>,
    /// PG: groups (the stream's unit) and advantages (`advantage` scalar).
    pub rollouts: Option<&'a RolloutPlan>,
}

impl PlannedStep {
    pub fn microbatches(&self) -> u32 {
        self.ranks.iter().map(|r| r.len() as u32).sum()
    }
}

/// The stream order of a job over `len` documents.
pub fn order_of(spec: &JobSpec, len: usize) -> Order {
    Order {
        seed: spec.job.seed,
        shuffle: spec.data.shuffle,
        len: len as u64,
        epochs: spec.job.epochs,
    }
}

/// Total steps of the job when it can be known up front (for LR schedules
/// and progress), else 0. PG steps take whole groups, so for them this is
/// an upper bound.
pub fn total_steps(spec: &JobSpec, docs: &[Document], rollouts: Option<&RolloutPlan>) -> u64 {
    if let Some(steps) = spec.job.steps {
        return steps;
    }
    let epochs = spec.job.epochs.unwrap_or(1);
    let count = rollouts.map_or(docs.len(), RolloutPlan::rollouts) as u64;
    match spec.step_size() {
        StepSize::Docs(n) => (epochs * count).div_ceil(n),
        StepSize::Tokens(t) => {
            let tokens: u64 = docs.iter().map(Document::tokens).sum();
            (epochs * tokens).div_ceil(t).max(1)
        }
        // Depends on how documents pack; not known before planning.
        StepSize::MicrobatchesPerRank(_) => 0,
    }
}

/// Plans step `step` (1-based) from `cursor` for `world_size` ranks, or
/// returns `None` when the stream has no documents left. `notes` adds the
/// per-sequence scalars of DPO (`ref_logp`) and PG (`advantage`) jobs; a PG
/// job's stream unit is a group of rollouts.
pub fn plan_step(
    spec: &JobSpec,
    docs: &[Document],
    cursor: &Cursor,
    step: u64,
    world_size: u32,
    notes: Annotations<'_>,
) -> Result<Option<PlannedStep>, PlanError> {
    let stream_len = notes.rollouts.map_or(docs.len(), |r| r.units.len());
    let order = order_of(spec, stream_len);
    let max_tokens = spec.data.max_tokens;
    // Phase 1: choose the step's documents (PG: groups) from the stream.
    let target = StepTarget::new(spec.step_size(), world_size, max_tokens);
    let selection = match notes.rollouts {
        None => plan::select(
            target,
            order
                .candidates(cursor)
                .map(|c| docs[c.index as usize].tokens()),
        ),
        Some(r) => rollouts::select_groups(
            target,
            order.candidates(cursor).map(|c| {
                let members = &r.units[c.index as usize];
                let tokens = members.iter().map(|&i| docs[i as usize].tokens()).sum();
                (tokens, members.len() as u64)
            }),
        ),
    };
    if selection.taken.is_empty() {
        return Ok(None);
    }
    let offered: Vec<u64> = order
        .candidates(cursor)
        .take(selection.consumed)
        .map(|c| c.index)
        .collect();
    let chosen: Vec<&Document> = match notes.rollouts {
        None => selection
            .taken
            .iter()
            .map(|&i| &docs[offered[i] as usize])
            .collect(),
        Some(r) => selection
            .taken
            .iter()
            .flat_map(|&i| r.units[offered[i] as usize].iter())
            .map(|&d| &docs[d as usize])
            .collect(),
    };
    let staleness = notes.rollouts.map(|_| {
        let mut s = StalenessStats::default();
        for d in &chosen {
            if let DocBody::Rollout(r) = &d.body {
                s.add(crate::rl::staleness(r.policy_version, step - 1));
            }
        }
        s
    });

    // Phase 2: pack and assign to ranks; phase 3: payloads.
    let (ranks, normalizers) = pack_documents(
        &chosen,
        max_tokens,
        world_size,
        target.min_microbatches_per_rank(),
        notes,
    )?;
    let total = total_steps(spec, docs, notes.rollouts);
    Ok(Some(PlannedStep {
        kind: PlanKind::Train,
        step,
        lr: spec.optimizer.lr_at(step, total),
        cursor_after: cursor.advance(&order, &selection),
        normalizers,
        ranks,
        docs: chosen.iter().map(|d| d.id).collect(),
        staleness,
        replay: false,
    }))
}

/// Packs `chosen` into microbatches of at most `max_tokens`, spreads them
/// over `world_size` ranks (equal counts), and materialises the payloads.
pub fn pack_documents(
    chosen: &[&Document],
    max_tokens: u32,
    world_size: u32,
    min_microbatches_per_rank: u32,
    notes: Annotations<'_>,
) -> Result<(Vec<Vec<MicrobatchPayload>>, Normalizers), PlanError> {
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

fn payload<'a>(
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
            p.token_ids.extend_from_slice(&seq.input_ids);
            p.labels.extend_from_slice(&seq.labels);
            p.cu_seq_lens.push(p.token_ids.len() as u32);
            let mut scalars = Vec::new();
            old.push((
                seq.input_ids.len(),
                match &d.body {
                    DocBody::Rollout(r) => r.old_logprobs.as_deref(),
                    _ => None,
                },
            ));
            if let DocBody::Rollout(r) = &d.body {
                scalars.push(("reward".to_string(), r.reward));
                scalars.push(("policy_version".to_string(), r.policy_version as f64));
            }
            if let Some(a) = notes.rollouts.and_then(|r| r.advantage.get(&d.id)) {
                scalars.push(("advantage".to_string(), *a));
            }
            if let Some(logps) = notes.reference.and_then(|c| c.get(&d.id)) {
                scalars.push(("ref_logp".to_string(), logps[role.min(1)]));
            }
            refs.push((
                seq.input_ids.len(),
                notes.reference.and_then(|c| c.tokens(&d.id)),
            ));
            p.seqs.push(SeqRef {
                doc: d.id,
                role: role as u32,
                scalars,
            });
        }
    }
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
