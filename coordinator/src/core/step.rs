//! A planned step: its documents packed into per-rank microbatch layouts
//! (via `plan::solve`) holding shared handles to the documents, whose token
//! rows are materialised outside the state lock ([`MicrobatchPayload::rows`],
//! called where the plan is encoded), its normalisers and the settings it
//! was planned with. Which documents a step takes is the planner's
//! business (`super::planner`).

use std::sync::Arc;

use crate::job::settings::StepSettings;
use crate::rl::pg::StalenessStats;
use crate::stream::cursor::Cursor;
use crate::stream::doc::{DocBody, DocId, Document, Sequence};
use crate::stream::plan::{self, Normalizers, PackItem, PackProblem, PlanError};

use super::metrics::MetricSums;
use super::reference::{ReferenceCache, SeqLogp};
use super::types::PlanKind;
use crate::rl::rollouts::RolloutPlan;

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

/// One document of a shared, read-only table (the job's dataset, its eval
/// set, a streamed job's complete group): what a plan holds instead of copies of the document's tokens, so
/// that the payload is materialised outside the state lock.
#[derive(Clone)]
pub struct DocHandle {
    table: Arc<[Document]>,
    index: usize,
}

impl DocHandle {
    /// Document `index` of `table`.
    pub fn new(table: &Arc<[Document]>, index: usize) -> Self {
        debug_assert!(index < table.len());
        Self {
            table: Arc::clone(table),
            index,
        }
    }
}

impl std::ops::Deref for DocHandle {
    type Target = Document;
    fn deref(&self) -> &Document {
        &self.table[self.index]
    }
}

impl PartialEq for DocHandle {
    fn eq(&self, other: &Self) -> bool {
        let same = Arc::ptr_eq(&self.table, &other.table) && self.index == other.index;
        same || **self == **other
    }
}

impl std::fmt::Debug for DocHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DocHandle({})", self.id)
    }
}

/// A microbatch's layout, decided under the state lock: its documents in
/// order (handles, not copies), where each sequence starts and the counts
/// a result is checked against. Its token rows are built from the handles
/// by [`Self::rows`] where the message is encoded (the session task).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MicrobatchPayload {
    /// The one source of its documents (every microbatch holds one
    /// source's documents only); 0 for padding.
    pub source: u32,
    pub cu_seq_lens: Vec<u32>,
    pub seqs: Vec<SeqRef>,
    /// Its documents, in row order.
    pub docs: Vec<DocHandle>,
    /// Loss tokens as workers count them (see [`rank_loss_tokens`]).
    pub loss_tokens: u64,
    /// Per sequence, its cached per-token reference log-probs (PG with a
    /// KL penalty and `reference = "cached"`; shared, not copied); empty
    /// when the job has no cache. See [`Self::ref_logprobs`].
    pub ref_tokens: Vec<Option<Arc<[f32]>>>,
}

/// A microbatch's token rows, materialised from its documents.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rows {
    pub token_ids: Vec<u32>,
    pub labels: Vec<i32>,
    /// Per-token old log-probs (rollouts that carry them), else empty.
    pub old_logprobs: Vec<f32>,
}

impl MicrobatchPayload {
    /// Tokens in the row.
    pub fn tokens(&self) -> u64 {
        u64::from(self.cu_seq_lens.last().copied().unwrap_or(0))
    }

    /// Starts loading its documents' entries (see [`crate::stream::prefetch`]):
    /// a handle gives an entry's address without reading it, so every
    /// entry's miss is in flight before the first is read.
    pub fn prefetch_docs(&self) {
        for d in &self.docs {
            crate::stream::prefetch::value::<Document>(d);
        }
    }

    /// Its sequences in row order (read-only; safe outside the state
    /// lock): what the encoder writes to the wire without a copy between.
    pub fn sequences(&self) -> impl Iterator<Item = &Sequence> {
        self.docs.iter().flat_map(|d| d.sequences())
    }

    /// Rollouts' old log-probs aligned with the row: NaN on a sequence
    /// without them (the worker treats its tokens as on-policy), empty when
    /// no sequence has any.
    pub fn old_logprobs(&self) -> Vec<f32> {
        fn old_of(d: &DocHandle) -> Option<&[f32]> {
            match &d.body {
                DocBody::Rollout(r) => r.old_logprobs.as_deref(),
                _ => None,
            }
        }
        // Most microbatches have none (SFT, DPO): no alignment to build,
        // for every microbatch of every plan.
        if self.docs.iter().all(|d| old_of(d).is_none()) {
            return Vec::new();
        }
        let old: Vec<(usize, Option<&[f32]>)> = self
            .docs
            .iter()
            .flat_map(|d| {
                let lps = old_of(d);
                d.sequences().map(move |s| (s.len(), lps))
            })
            .collect();
        aligned(&old)
    }

    /// Rollouts' routing (routing replay) aligned with the row, the same
    /// number of expert ids per token: `NO_EXPERT` on a sequence without
    /// (the worker's router decides there), empty when no sequence has any.
    pub fn routing(&self) -> Vec<u16> {
        fn routing_of(d: &DocHandle) -> Option<&[u16]> {
            match &d.body {
                DocBody::Rollout(r) => r.routing.as_deref(),
                _ => None,
            }
        }
        let Some((first, seq)) = self.docs.iter().find_map(|d| {
            let r = routing_of(d)?;
            Some((r, d.sequences().next()?))
        }) else {
            return Vec::new();
        };
        let width = first.len() / seq.len().max(1);
        let mut out = Vec::with_capacity(self.tokens() as usize * width);
        for d in &self.docs {
            let r = routing_of(d);
            for s in d.sequences() {
                match r {
                    Some(r) => out.extend_from_slice(r),
                    None => out.extend(std::iter::repeat_n(
                        accrue_proto::NO_EXPERT,
                        s.len() * width,
                    )),
                }
            }
        }
        out
    }

    /// The cached reference log-probs aligned with the row like the old
    /// ones: NaN on a sequence with none (the worker refuses a KL term
    /// there), empty when no sequence has any.
    pub fn ref_logprobs(&self) -> Vec<f32> {
        if self.ref_tokens.iter().all(Option::is_none) {
            return Vec::new();
        }
        let lens = self.cu_seq_lens.windows(2).map(|w| (w[1] - w[0]) as usize);
        let refs: Vec<(usize, Option<&[f32]>)> = lens
            .zip(&self.ref_tokens)
            .map(|(n, t)| (n, t.as_deref()))
            .collect();
        aligned(&refs)
    }

    /// The flat token row, its labels and old log-probs, materialised.
    pub fn rows(&self) -> Rows {
        let len = self.tokens() as usize;
        let mut r = Rows {
            token_ids: Vec::with_capacity(len),
            labels: Vec::with_capacity(len),
            old_logprobs: self.old_logprobs(),
        };
        for seq in self.sequences() {
            r.token_ids.extend_from_slice(seq.input_ids());
            r.labels.extend_from_slice(&seq.labels());
        }
        r
    }
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

    /// Where rank `rank`'s result disagrees with what this plan gave it,
    /// the first such field with both values: such a result was not
    /// computed on this plan. Every kind is checked on its microbatches,
    /// tokens, documents and loss tokens as its workers count them (a
    /// training result counts a DPO pair once, a forward-only pass counts
    /// every sequence); reference and eval results must carry one log-prob
    /// per planned sequence, in row order, with per-token log-probs (when
    /// any) as long as the sequence; a probe may count fewer tokens (a
    /// non-finite microbatch counts none) and names only its microbatches.
    pub fn disagreement(
        &self,
        rank: u32,
        sums: &MetricSums,
        logps: &[SeqLogp],
        nonfinite: &[u32],
    ) -> Option<String> {
        let Some(mbs) = self.ranks.get(rank as usize) else {
            return Some(format!("rank {rank}, planned {} ranks", self.ranks.len()));
        };
        let tokens: u64 = mbs.iter().map(MicrobatchPayload::tokens).sum();
        let seqs = || mbs.iter().flat_map(|m| &m.seqs);
        let documents = match self.kind {
            // A document counts at its first sequence (role 0), as workers count.
            PlanKind::Train => seqs().filter(|q| q.role == 0).count(),
            PlanKind::Reference | PlanKind::Eval | PlanKind::Probe => seqs().count(),
        } as u64;
        let loss_tokens: u64 = mbs.iter().map(|m| m.loss_tokens).sum();
        // A probe counts its finite microbatches' tokens only: never more.
        let at_most = self.kind == PlanKind::Probe;
        let checks = [
            (
                "microbatches",
                u64::from(sums.microbatches),
                mbs.len() as u64,
                false,
            ),
            ("tokens", sums.tokens, tokens, at_most),
            ("documents", sums.documents, documents, false),
            ("loss tokens", sums.loss_tokens, loss_tokens, at_most),
        ];
        for (field, got, planned, at_most) in checks {
            if at_most && got > planned {
                return Some(format!("{field} {got}, planned at most {planned}"));
            }
            if !at_most && got != planned {
                return Some(format!("{field} {got}, planned {planned}"));
            }
        }
        if let Some(&i) = nonfinite.iter().find(|&&i| i as usize >= mbs.len()) {
            return Some(format!(
                "non-finite microbatch {i}, planned {} microbatches",
                mbs.len()
            ));
        }
        match self.kind {
            PlanKind::Reference | PlanKind::Eval => logp_disagreement(mbs, logps),
            PlanKind::Train | PlanKind::Probe if !logps.is_empty() => Some(format!(
                "{} log-probs, planned none for a {:?} plan",
                logps.len(),
                self.kind
            )),
            PlanKind::Train | PlanKind::Probe => None,
        }
    }

    /// Tokens of the rank with the most: what the step's time follows.
    pub fn busiest_rank_tokens(&self) -> u64 {
        self.ranks
            .iter()
            .map(|mbs| mbs.iter().map(MicrobatchPayload::tokens).sum())
            .max()
            .unwrap_or(0)
    }
}

/// Where a forward-only result's log-probs differ from the sequences
/// planned (one each, in row order, per-token ones as long as the
/// sequence when reported): the first difference, named.
fn logp_disagreement(mbs: &[MicrobatchPayload], logps: &[SeqLogp]) -> Option<String> {
    let planned = mbs.iter().flat_map(|m| {
        let lens = m.cu_seq_lens.windows(2).map(|w| (w[1] - w[0]) as usize);
        m.seqs.iter().zip(lens)
    });
    let want = mbs.iter().map(|m| m.seqs.len()).sum::<usize>();
    if logps.len() != want {
        return Some(format!("log-probs {}, planned {want}", logps.len()));
    }
    logps
        .iter()
        .zip(planned)
        .enumerate()
        .find_map(|(i, (l, (q, len)))| {
            if (l.doc, l.role) != (q.doc, q.role) {
                Some(format!(
                    "log-prob {i} for document {} role {}, planned document {} role {}",
                    l.doc, l.role, q.doc, q.role
                ))
            } else if !l.tokens.is_empty() && l.tokens.len() != len {
                Some(format!(
                    "log-prob {i} (document {}) has {} per-token log-probs, planned {len} tokens",
                    l.doc,
                    l.tokens.len()
                ))
            } else {
                None
            }
        })
}

/// Loss tokens of one microbatch's rows as every objective's worker
/// counts them (SFT, DPO and policy gradient alike): per sequence, the
/// labels after its first that are not ignored (the shift stays inside a
/// document), the count the plan's normaliser T sums. From the rows: what
/// [`MicrobatchPayload::loss_tokens`] must equal.
pub fn rank_loss_tokens(cu_seq_lens: &[u32], labels: &[i32]) -> u64 {
    cu_seq_lens
        .windows(2)
        .map(|w| crate::stream::doc::count_loss_tokens(&labels[w[0] as usize..w[1] as usize]))
        .sum()
}

/// Packs `chosen` into microbatches of at most `max_tokens`, spreads them
/// over `world_size` ranks (equal counts), and materialises the payloads.
/// A microbatch holds documents of one source only (`notes.source_of`), so
/// its metric sums are that source's.
pub fn pack_documents(
    chosen: &[DocHandle],
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
    // Each document is read here once (its ids too, for the layout): the
    // step's documents are scattered over the dataset, so a second read
    // is a second cache miss per document, under the state lock.
    // A few documents ahead are asked for while one is read, so their
    // misses overlap (see `crate::stream::prefetch`).
    const AHEAD: usize = 8;
    let ids: Vec<DocId> = chosen
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if let Some(ahead) = chosen.get(i + AHEAD) {
                crate::stream::prefetch::value::<Document>(ahead);
            }
            d.id
        })
        .collect();
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
                    // The packer summed the loss tokens already: the
                    // labels are not read again under the lock.
                    layout(
                        mb.items.iter().map(|&i| {
                            let it = &problem.items[i];
                            (&chosen[it.doc], ids[it.doc], &it.seq_lens[..])
                        }),
                        mb.loss_tokens,
                        notes,
                    )
                })
                .collect()
        })
        .collect();
    Ok((ranks, solution.normalizers))
}

/// One microbatch's layout: `docs` in order, one flat row (tokens left
/// in the documents, see [`MicrobatchPayload::rows`]).
pub fn payload<'a>(
    docs: impl Iterator<Item = &'a DocHandle>,
    notes: Annotations<'_>,
) -> MicrobatchPayload {
    let docs: Vec<(&DocHandle, DocId, crate::stream::plan::SeqLens)> =
        docs.map(|d| (d, d.id, d.seq_lens())).collect();
    let loss_tokens = docs.iter().map(|(d, ..)| d.loss_tokens()).sum();
    layout(
        docs.iter().map(|(d, id, lens)| (*d, *id, &lens[..])),
        loss_tokens,
        notes,
    )
}

/// [`payload`] with the microbatch's loss tokens already counted, from
/// each document's handle, id and sequence lengths.
fn layout<'a>(
    docs: impl Iterator<Item = (&'a DocHandle, DocId, &'a [u32])>,
    loss_tokens: u64,
    notes: Annotations<'_>,
) -> MicrobatchPayload {
    // Sized for one sequence a document (a pair grows them once).
    let n = docs.size_hint().0;
    let mut p = MicrobatchPayload {
        cu_seq_lens: Vec::with_capacity(n + 1),
        seqs: Vec::with_capacity(n),
        docs: Vec::with_capacity(n),
        loss_tokens,
        ..Default::default()
    };
    p.cu_seq_lens.push(0);
    let mut end = 0u32;
    for (d, id, lens) in docs {
        let source = notes
            .file_source
            .and_then(|fs| fs.get(id.file as usize).copied())
            .unwrap_or(0);
        let advantage = notes.rollouts.and_then(|r| r.advantage.get(&id).copied());
        let ref_logps = notes.reference.and_then(|c| c.get(&id));
        for (role, &len) in lens.iter().enumerate() {
            end += len;
            p.cu_seq_lens.push(end);
            if let Some(c) = notes.reference {
                p.ref_tokens.push(c.tokens(&id).cloned());
            }
            p.seqs.push(SeqRef {
                doc: id,
                source,
                role: role as u32,
                advantage,
                ref_logp: ref_logps.map(|logps| logps[role.min(1)]),
            });
        }
        p.docs.push(d.clone());
    }
    p.source = p.seqs.first().map_or(0, |s| s.source);
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

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use crate::core::reference::RefEntry;
    use crate::stream::doc::{Rollout, Row, TokenRows, IGNORE_INDEX};

    /// The payload as it was built under the state lock before the
    /// layout/rows split (issue 19): the reference the rows must equal.
    struct OldPayload {
        token_ids: Vec<u32>,
        labels: Vec<i32>,
        cu_seq_lens: Vec<u32>,
        seqs: Vec<SeqRef>,
        old_logprobs: Vec<f32>,
        ref_logprobs: Vec<f32>,
    }

    fn old_payload(docs: &[&Document], notes: Annotations<'_>) -> OldPayload {
        let mut p = OldPayload {
            token_ids: Vec::new(),
            labels: Vec::new(),
            cu_seq_lens: vec![0],
            seqs: Vec::new(),
            old_logprobs: Vec::new(),
            ref_logprobs: Vec::new(),
        };
        let mut old: Vec<(usize, Option<&[f32]>)> = Vec::new();
        let mut refs: Vec<(usize, Option<&[f32]>)> = Vec::new();
        for d in docs {
            for (role, seq) in d.sequences().enumerate() {
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
                refs.push((
                    seq.len(),
                    notes
                        .reference
                        .and_then(|c| c.tokens(&d.id))
                        .map(|t| &t[..]),
                ));
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
        p.old_logprobs = aligned(&old);
        p.ref_logprobs = aligned(&refs);
        p
    }

    /// Rows of a mapped store (a row's `start` is its index): labels are the
    /// ids with every third ignored.
    struct Store(Vec<Vec<u32>>);

    fn store_labels(ids: &[u32]) -> Vec<i32> {
        let label = |(i, &t): (usize, &u32)| if i % 3 == 1 { IGNORE_INDEX } else { t as i32 };
        ids.iter().enumerate().map(label).collect()
    }

    impl TokenRows for Store {
        fn ids(&self, row: &Row) -> &[u32] {
            &self.0[row.start as usize]
        }
        fn labels(&self, row: &Row) -> Cow<'_, [i32]> {
            Cow::Owned(store_labels(&self.0[row.start as usize]))
        }
    }

    /// SFT (owned and mapped), DPO pairs and rollouts (with and without
    /// old log-probs), with reference log-probs and advantages for some.
    fn mixed() -> (Vec<Document>, ReferenceCache, RolloutPlan) {
        let ids = |n: usize, k: u32| (0..n as u32).map(|t| 7 * k + t).collect::<Vec<_>>();
        // Some with labels that are not their ids (then the wire packs
        // the microbatch's labels instead of masking them).
        let owned = |n: usize, k: u32| {
            let i = ids(n, k);
            let l = i
                .iter()
                .map(|&t| match t {
                    _ if t % 4 == 0 => IGNORE_INDEX,
                    _ if k % 9 == 4 && t % 5 == 0 => 1,
                    _ => t as i32,
                })
                .collect();
            Sequence::new(i, l)
        };
        let store = Arc::new(Store((0..8).map(|k| ids(5 + k, k as u32)).collect()));
        let mut docs = Vec::new();
        let mut refs = BTreeMap::new();
        let mut advantage = HashMap::new();
        for k in 0..40u32 {
            let id = DocId {
                file: 0,
                line: u64::from(k),
            };
            let body = match k % 5 {
                0 => DocBody::Sft(owned(3 + k as usize % 11, k)),
                1 => {
                    let row = k % 8;
                    let rows: Arc<dyn TokenRows> = store.clone();
                    let labels = store_labels(&store.0[row as usize]);
                    let row = Row {
                        len: store.0[row as usize].len() as u32,
                        loss_tokens: crate::stream::doc::count_loss_tokens(&labels) as u32,
                        start: u64::from(row),
                        explicit: Row::NO_EXPLICIT,
                    };
                    DocBody::Sft(Sequence::mapped(rows, row))
                }
                2 => {
                    refs.insert(id, RefEntry::Pair([-1.5 - k as f64, -2.5]));
                    DocBody::Pair {
                        chosen: owned(4, k),
                        rejected: owned(6, k + 1),
                    }
                }
                _ => {
                    let seq = owned(2 + k as usize % 7, k);
                    let n = seq.len();
                    if k % 2 == 0 {
                        refs.insert(id, RefEntry::Tokens(vec![-0.25 * k as f32; n].into()));
                    }
                    advantage.insert(id, k as f64 - 20.0);
                    // Two expert ids per token on some rollouts.
                    let routing =
                        (k % 4 == 1).then(|| (0..2 * n).map(|j| (j % 8) as u16).collect());
                    DocBody::Rollout(Rollout {
                        routing,
                        seq,
                        reward: 1.0,
                        group: format!("g{}", k / 4),
                        policy_version: 0,
                        old_logprobs: (k % 3 == 0).then(|| vec![-0.5; n]),
                    })
                }
            };
            docs.push(Document { id, body });
        }
        let plan = RolloutPlan {
            units: Vec::new(),
            advantage,
            zero_variance_groups: 0,
            zero_variance_rollouts: 0,
            rejected_stale: 0,
        };
        (docs, ReferenceCache::new(refs), plan)
    }

    /// Routing replay: a microbatch's routing is its rollouts' routing in
    /// row order, `NO_EXPERT` rows for sequences without, the same number
    /// of ids per token; none when no document has any.
    #[test]
    fn routing_is_aligned_with_the_row() {
        let (docs, cache, rollouts) = mixed();
        let table: Arc<[Document]> = docs.into();
        let notes = Annotations {
            reference: Some(&cache),
            rollouts: Some(&rollouts),
            file_source: None,
        };
        let chosen: Vec<DocHandle> = (0..table.len())
            .map(|i| DocHandle::new(&table, i))
            .collect();
        let (ranks, _) = pack_documents(&chosen, 40, 3, 2, notes).unwrap();
        let (mut with, mut without) = (0, 0);
        for mb in ranks.iter().flatten() {
            let mut want = Vec::new();
            let mut any = false;
            for d in &mb.docs {
                for s in d.sequences() {
                    match &d.body {
                        DocBody::Rollout(Rollout {
                            routing: Some(r), ..
                        }) => {
                            any = true;
                            want.extend_from_slice(r);
                        }
                        _ => want.extend(std::iter::repeat_n(accrue_proto::NO_EXPERT, 2 * s.len())),
                    }
                }
            }
            let got = mb.routing();
            if any {
                with += 1;
                assert_eq!(got.len(), 2 * mb.tokens() as usize);
                assert_eq!(got, want);
            } else {
                without += 1;
                assert!(got.is_empty());
            }
        }
        assert!(
            with > 0 && without > 0,
            "{with} with routing, {without} without"
        );
    }

    /// Issue 19: the layout decided under the lock, materialised later by
    /// `rows` (and by the wire encoder), carries exactly the payload the
    /// old in-lock copy built, and its loss-token count is the one counted
    /// on the rows.
    #[test]
    fn materialised_rows_equal_the_payload_built_under_the_lock() {
        let (docs, cache, rollouts) = mixed();
        let table: Arc<[Document]> = docs.into();
        let notes = Annotations {
            reference: Some(&cache),
            rollouts: Some(&rollouts),
            file_source: None,
        };
        let chosen: Vec<DocHandle> = (0..table.len())
            .map(|i| DocHandle::new(&table, i))
            .collect();
        let (ranks, _) = pack_documents(&chosen, 40, 3, 2, notes).unwrap();
        let (mut checked, mut masked_mbs, mut packed_mbs) = (0, 0, 0);
        for mb in ranks.iter().flatten() {
            let docs: Vec<&Document> = mb.docs.iter().map(|h| &**h).collect();
            let old = old_payload(&docs, notes);
            let rows = mb.rows();
            assert_eq!(rows.token_ids, old.token_ids);
            assert_eq!(rows.labels, old.labels);
            // What the session task writes to the wire, byte for byte: the
            // labels masked when each is its id or ignored, else packed.
            let wire = crate::shell::service::convert::packed_rows(mb);
            assert_eq!(wire.token_ids, accrue_proto::pack_u32(&old.token_ids));
            let masked = (old.token_ids.iter().zip(&old.labels))
                .all(|(&t, &l)| l == IGNORE_INDEX || l == t as i32);
            assert_eq!(wire.labels.is_empty(), masked);
            assert_eq!(wire.loss_mask.is_empty(), !masked || old.labels.is_empty());
            masked_mbs += usize::from(masked && !old.labels.is_empty());
            packed_mbs += usize::from(!masked);
            assert_eq!(
                accrue_proto::microbatch_labels(&old.token_ids, &wire.labels, &wire.loss_mask),
                Ok(old.labels.clone())
            );
            assert_eq!(mb.cu_seq_lens, old.cu_seq_lens);
            assert_eq!(mb.seqs, old.seqs);
            // NaN-aware: compare the bits.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&rows.old_logprobs), bits(&old.old_logprobs));
            assert_eq!(bits(&mb.ref_logprobs()), bits(&old.ref_logprobs));
            assert_eq!(mb.tokens(), old.token_ids.len() as u64);
            assert_eq!(
                mb.loss_tokens,
                rank_loss_tokens(&old.cu_seq_lens, &old.labels)
            );
            checked += docs.len();
        }
        assert_eq!(checked, table.len(), "every document placed once");
        assert!(
            masked_mbs > 0 && packed_mbs > 0,
            "{masked_mbs} masked, {packed_mbs} packed"
        );
        let some = |f: fn(&Rows) -> bool| ranks.iter().flatten().any(|m| f(&m.rows()));
        assert!(
            some(|r| !r.old_logprobs.is_empty()),
            "old log-probs covered"
        );
        assert!(ranks.iter().flatten().any(|m| !m.ref_logprobs().is_empty()));
    }
}
