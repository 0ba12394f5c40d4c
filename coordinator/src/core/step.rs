//! Turns a job's documents and cursor into a planned step: which documents
//! (via `plan::select`), how they are packed and spread over ranks (via
//! `plan::solve`), and the per-rank payloads with inline tokens.

use crate::cursor::{Cursor, Order};
use crate::doc::{DocBody, DocId, Document};
use crate::plan::{self, Normalizers, PackItem, PackProblem, PlanError, StepTarget};
use crate::spec::{JobSpec, StepSize};

use super::reference::ReferenceCache;

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
/// and progress), else 0.
pub fn total_steps(spec: &JobSpec, docs: &[Document]) -> u64 {
    if let Some(steps) = spec.job.steps {
        return steps;
    }
    let epochs = spec.job.epochs.unwrap_or(1);
    match spec.step_size() {
        StepSize::Docs(n) => (epochs * docs.len() as u64).div_ceil(n),
        StepSize::Tokens(t) => {
            let tokens: u64 = docs.iter().map(Document::tokens).sum();
            (epochs * tokens).div_ceil(t).max(1)
        }
        // Depends on how documents pack; not known before planning.
        StepSize::MicrobatchesPerRank(_) => 0,
    }
}

/// Plans step `step` (1-based) from `cursor` for `world_size` ranks, or
/// returns `None` when the stream has no documents left. DPO jobs with a
/// cached reference pass `reference`: each sequence then carries its
/// `ref_logp` scalar.
pub fn plan_step(
    spec: &JobSpec,
    docs: &[Document],
    cursor: &Cursor,
    step: u64,
    world_size: u32,
    reference: Option<&ReferenceCache>,
) -> Result<Option<PlannedStep>, PlanError> {
    let order = order_of(spec, docs.len());
    let max_tokens = spec.data.max_tokens;
    // Phase 1: choose the step's documents from the stream.
    let target = StepTarget::new(spec.step_size(), world_size, max_tokens);
    let offered = order
        .candidates(cursor)
        .map(|c| docs[c.index as usize].tokens());
    let selection = plan::select(target, offered);
    if selection.taken.is_empty() {
        return Ok(None);
    }
    let offered: Vec<u64> = order
        .candidates(cursor)
        .take(selection.consumed)
        .map(|c| c.index)
        .collect();
    let chosen: Vec<&Document> = selection
        .taken
        .iter()
        .map(|&i| &docs[offered[i] as usize])
        .collect();

    // Phase 2: pack and assign to ranks; phase 3: payloads.
    let (ranks, normalizers) = pack_documents(
        &chosen,
        max_tokens,
        world_size,
        target.min_microbatches_per_rank(),
        reference,
    )?;
    let total = total_steps(spec, docs);
    Ok(Some(PlannedStep {
        kind: PlanKind::Train,
        step,
        lr: spec.optimizer.lr_at(step, total),
        cursor_after: cursor.advance(&order, &selection),
        normalizers,
        ranks,
        docs: chosen.iter().map(|d| d.id).collect(),
    }))
}

/// Packs `chosen` into microbatches of at most `max_tokens`, spreads them
/// over `world_size` ranks (equal counts), and materialises the payloads.
pub fn pack_documents(
    chosen: &[&Document],
    max_tokens: u32,
    world_size: u32,
    min_microbatches_per_rank: u32,
    reference: Option<&ReferenceCache>,
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
                        reference,
                    )
                })
                .collect()
        })
        .collect();
    Ok((ranks, solution.normalizers))
}

fn payload<'a>(
    docs: impl Iterator<Item = &'a Document>,
    reference: Option<&ReferenceCache>,
) -> MicrobatchPayload {
    let mut p = MicrobatchPayload {
        cu_seq_lens: vec![0],
        ..Default::default()
    };
    for d in docs {
        for (role, seq) in d.sequences().into_iter().enumerate() {
            p.token_ids.extend_from_slice(&seq.input_ids);
            p.labels.extend_from_slice(&seq.labels);
            p.cu_seq_lens.push(p.token_ids.len() as u32);
            let mut scalars = Vec::new();
            if let DocBody::Rollout(r) = &d.body {
                scalars.push(("reward".to_string(), r.reward));
                scalars.push(("policy_version".to_string(), r.policy_version as f64));
            }
            if let Some(logps) = reference.and_then(|c| c.get(&d.id)) {
                scalars.push(("ref_logp".to_string(), logps[role.min(1)]));
            }
            p.seqs.push(SeqRef {
                doc: d.id,
                role: role as u32,
                scalars,
            });
        }
    }
    p
}
