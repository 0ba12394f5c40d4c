//! A streamed policy-gradient job's rollout queue (issue 5, item 5):
//! rollouts pushed through `Rollouts.PushRollouts` are admitted (staleness
//! against the job's committed step), gathered by group id, and a group
//! that reaches `rl.group_size` rollouts is complete: it gets its
//! group-relative advantages and joins the FIFO queue, or, when its rewards
//! are all equal, is dropped and counted. A step takes whole groups from the
//! queue head until it holds `docs_per_step` rollouts; it is dispatched only
//! when that many are queued.
//!
//! Exactly once: the job's cursor position counts the groups ever committed
//! and `head` is the position of the queue's first group. Groups leave the
//! queue only when a step commits, so an aborted step re-plans the same head
//! groups, and new groups only ever join the tail.
//!
//! Durability: each admission is persisted (rollouts + counters) before the
//! push is acknowledged; a commit deletes its groups' rollouts and moves the
//! stored `head` in the same write. A restart replays the stored rollouts in
//! admission order, which rebuilds the same groups in the same order; groups
//! a commit trained but whose deletion had not been written yet are popped
//! against the cursor and their deletion is owed to the next write.
//!
//! Backpressure: the queue holds at most `rl.queue_capacity` rollouts
//! (complete and filling groups). A push that does not fit is refused with
//! [`CoreError::QueueFull`], leaving the state unchanged; the shell waits for
//! room and retries. A push is let through over capacity only when the
//! queued complete groups cannot make a step (no commit could ever free
//! room, e.g. the capacity is taken by filling groups).

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::jobs::Job;
use super::rollouts::{self, RolloutPlan};
use super::step::{self, PlanKind, PlannedStep};
use super::{CoreError, Effect, Result};
use crate::cursor::{Cursor, Selection};
use crate::doc::{DocBody, DocId, Document, Rollout};
use crate::objective::{step_rollouts, PgParams};
use crate::plan::{PlanError, StepTarget};
use crate::rl::{self, StalenessStats};
use crate::spec::JobSpec;

/// `DocId::file` of streamed rollouts; `line` is the admission number
/// (1-based, never reused within a job).
pub const STREAM_FILE: u32 = 0;

/// What one push did, in rollouts unless named otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdmitCounts {
    pub accepted: u64,
    pub rejected_stale: u64,
    /// Rollouts of groups this push completed with zero reward variance
    /// (members admitted by earlier pushes included).
    pub zero_variance_dropped: u64,
    pub zero_variance_groups: u64,
    /// Rollouts buffered after the push (complete and filling groups).
    pub queued: u64,
}

impl AdmitCounts {
    pub fn add(&mut self, o: &AdmitCounts) {
        self.accepted += o.accepted;
        self.rejected_stale += o.rejected_stale;
        self.zero_variance_dropped += o.zero_variance_dropped;
        self.zero_variance_groups += o.zero_variance_groups;
        self.queued = o.queued;
    }
}

/// The persisted part of a stream besides its rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StreamMeta {
    /// Queue position of the first stored complete group.
    pub head: u64,
    pub next_line: u64,
    pub rejected_stale: u64,
    pub zero_variance_groups: u64,
    pub zero_variance_rollouts: u64,
}

/// A stream read back from the store: its meta and its rollouts in
/// admission order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoredStream {
    pub meta: StreamMeta,
    pub rollouts: Vec<Document>,
}

/// One store write of a stream: insert `admit`, delete `remove`, set `meta`,
/// in one transaction. `counts` is the reply of the push that caused it.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutWrite {
    pub job: String,
    pub admit: Vec<Document>,
    pub remove: Vec<DocId>,
    pub meta: StreamMeta,
    pub counts: Option<AdmitCounts>,
}

/// The live queue of a streamed job.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutStream {
    pub group_size: u32,
    /// Rollouts buffered (complete and filling) before pushes wait.
    pub capacity: u64,
    /// Rollouts a step takes (whole groups).
    pub step_rollouts: u64,
    /// Queue position of `queue[0]`.
    head: u64,
    queue: VecDeque<Vec<Document>>,
    queued_rollouts: u64,
    /// Groups still filling, by group id.
    filling: HashMap<String, Vec<Document>>,
    filling_rollouts: u64,
    next_line: u64,
    /// Stored rollouts of groups already committed (restored before their
    /// deletion was written): deleted by the next write.
    owed_removal: Vec<DocId>,
}

impl RolloutStream {
    /// The queue of a job whose spec streams its data, else `None`.
    pub fn for_spec(spec: &JobSpec) -> Option<RolloutStream> {
        if !spec.data.is_stream() {
            return None;
        }
        let docs = spec.batch.docs_per_step.unwrap_or(1);
        let group_size = spec.rl.group_size.unwrap_or(1).max(1);
        Some(RolloutStream {
            group_size,
            capacity: spec.rl.queue_capacity_or_default(docs),
            step_rollouts: step_rollouts(docs, group_size),
            head: 0,
            queue: VecDeque::new(),
            queued_rollouts: 0,
            filling: HashMap::new(),
            filling_rollouts: 0,
            next_line: 1,
            owed_removal: Vec::new(),
        })
    }

    /// Rollouts buffered: complete groups plus filling ones.
    pub fn buffered(&self) -> u64 {
        self.queued_rollouts + self.filling_rollouts
    }

    /// Rollouts in complete groups waiting to be trained.
    pub fn queued_rollouts(&self) -> u64 {
        self.queued_rollouts
    }

    pub fn queued_groups(&self) -> usize {
        self.queue.len()
    }

    /// Queue position of the head group (groups committed so far).
    pub fn head(&self) -> u64 {
        self.head
    }

    /// True when the queue holds a whole step.
    pub fn step_ready(&self) -> bool {
        self.queued_rollouts >= self.step_rollouts
    }

    /// Whether `n` more rollouts may be admitted now (see the module doc).
    pub fn has_room(&self, n: u64) -> bool {
        self.buffered() + n <= self.capacity || !self.step_ready()
    }

    /// The job's status reason while it waits for rollouts, if it does.
    pub fn waiting_reason(&self) -> Option<String> {
        (!self.step_ready()).then(|| {
            format!(
                "waiting for rollouts: have {} of {}",
                self.queued_rollouts, self.step_rollouts
            )
        })
    }

    fn meta(&self, plan: &RolloutPlan) -> StreamMeta {
        StreamMeta {
            head: self.head,
            next_line: self.next_line,
            rejected_stale: plan.rejected_stale,
            zero_variance_groups: plan.zero_variance_groups,
            zero_variance_rollouts: plan.zero_variance_rollouts,
        }
    }

    /// Adds one admitted rollout; a group that completes is queued (its
    /// advantages recorded in `plan`) or dropped. Returns the dropped
    /// group's ids when it had zero variance.
    fn add(&mut self, plan: &mut RolloutPlan, pg: &PgParams, doc: Document) -> Option<Vec<DocId>> {
        let DocBody::Rollout(r) = &doc.body else {
            unreachable!("streams hold rollouts only")
        };
        let group = r.group.clone();
        let members = self.filling.entry(group.clone()).or_default();
        members.push(doc);
        self.filling_rollouts += 1;
        if members.len() < self.group_size as usize {
            return None;
        }
        let members = self.filling.remove(&group).expect("the group just filled");
        self.filling_rollouts -= members.len() as u64;
        let rewards: Vec<f64> = members.iter().map(reward).collect();
        match rl::group_advantages(&rewards, pg.scale_by_std, pg.advantage_eps) {
            Some(adv) => {
                for (d, a) in members.iter().zip(adv) {
                    plan.advantage.insert(d.id, a);
                }
                self.queued_rollouts += members.len() as u64;
                self.queue.push_back(members);
                None
            }
            None => {
                plan.zero_variance_groups += 1;
                plan.zero_variance_rollouts += members.len() as u64;
                Some(members.iter().map(|d| d.id).collect())
            }
        }
    }

    /// Removes head groups up to queue position `to`, returning their ids.
    fn pop_to(&mut self, plan: &mut RolloutPlan, to: u64) -> Vec<DocId> {
        let mut ids = Vec::new();
        while self.head < to {
            let Some(g) = self.queue.pop_front() else {
                break;
            };
            self.head += 1;
            self.queued_rollouts -= g.len() as u64;
            for d in g {
                plan.advantage.remove(&d.id);
                ids.push(d.id);
            }
        }
        ids
    }
}

fn reward(d: &Document) -> f64 {
    match &d.body {
        DocBody::Rollout(r) => r.reward,
        _ => unreachable!("streams hold rollouts only"),
    }
}

fn parts(job: &mut Job) -> Result<(&mut RolloutStream, &mut RolloutPlan, PgParams)> {
    let id = job.rec.id.clone();
    let pg = job.spec.objective.pg();
    match (job.stream.as_mut(), job.rollouts.as_mut(), pg) {
        (Some(s), Some(p), Some(pg)) => Ok((s, p, pg)),
        _ => Err(CoreError::NotStreamed(id)),
    }
}

/// Admits a batch of rollouts into `job`'s queue, all or nothing: the
/// effect persists them (the shell acknowledges only after it ran).
/// Refused, with nothing changed, for a job that does not stream, has
/// ended, or has no room (`QueueFull`: the shell waits and retries).
pub(super) fn push(job: &mut Job, batch: Vec<Rollout>) -> Result<Effect> {
    if job.rec.state.is_terminal() {
        return Err(super::machine::bad_state(
            &job.rec.id,
            job.rec.state,
            "pushing rollouts",
        ));
    }
    let id = job.rec.id.clone();
    let (step, max_staleness) = (job.rec.step, job.spec.rl.max_staleness);
    let (s, plan, pg) = parts(job)?;
    let (fresh, stale): (Vec<Rollout>, Vec<Rollout>) = batch
        .into_iter()
        .partition(|r| rl::admit(r.policy_version, step, max_staleness).is_ok());
    if !s.has_room(fresh.len() as u64) {
        return Err(CoreError::QueueFull {
            job: id,
            buffered: s.buffered(),
            capacity: s.capacity,
        });
    }
    plan.rejected_stale += stale.len() as u64;
    let mut counts = AdmitCounts {
        accepted: fresh.len() as u64,
        rejected_stale: stale.len() as u64,
        ..Default::default()
    };
    let mut admit = Vec::with_capacity(fresh.len());
    let mut remove = std::mem::take(&mut s.owed_removal);
    for r in fresh {
        let doc = Document {
            id: DocId {
                file: STREAM_FILE,
                line: s.next_line,
            },
            body: DocBody::Rollout(r),
        };
        s.next_line += 1;
        admit.push(doc.clone());
        if let Some(dropped) = s.add(plan, &pg, doc) {
            counts.zero_variance_groups += 1;
            counts.zero_variance_dropped += dropped.len() as u64;
            remove.extend(dropped);
        }
    }
    counts.queued = s.buffered();
    Ok(Effect::PersistRollouts(Box::new(RolloutWrite {
        job: id,
        admit,
        remove,
        meta: s.meta(plan),
        counts: Some(counts),
    })))
}

/// Plans `job`'s next step from the queue head, or `None` when fewer than
/// a step's rollouts are queued (the job waits).
pub fn plan_step(
    job: &Job,
    world_size: u32,
) -> std::result::Result<Option<PlannedStep>, PlanError> {
    let Some(s) = job.stream.as_ref() else {
        return Ok(None);
    };
    if !s.step_ready() {
        return Ok(None);
    }
    let spec = &job.spec;
    let step = job.rec.step + 1;
    let target = StepTarget::new(spec.step_size(), world_size, spec.data.max_tokens);
    let selection: Selection = rollouts::select_groups(
        target,
        s.queue
            .iter()
            .map(|g| (g.iter().map(Document::tokens).sum(), g.len() as u64)),
    );
    let chosen: Vec<&Document> = s.queue.iter().take(selection.consumed).flatten().collect();
    let mut staleness = StalenessStats::default();
    for d in &chosen {
        if let DocBody::Rollout(r) = &d.body {
            staleness.add(rl::staleness(r.policy_version, step - 1));
        }
    }
    let (ranks, normalizers) = step::pack_documents(
        &chosen,
        spec.data.max_tokens,
        world_size,
        target.min_microbatches_per_rank(),
        job.annotations(),
    )?;
    Ok(Some(PlannedStep {
        kind: PlanKind::Train,
        step,
        lr: spec.optimizer.lr_at(step, spec.job.steps.unwrap_or(0)),
        cursor_after: Cursor {
            position: s.head + selection.consumed as u64,
            ..Cursor::default()
        },
        normalizers,
        ranks,
        docs: chosen.iter().map(|d| d.id).collect(),
        staleness: Some(staleness),
        replay: false,
    }))
}

/// After a commit moved the cursor: the trained groups leave the queue and
/// the store (the write follows the step's commit record, so a crash in
/// between leaves them to be popped again on restore).
pub(super) fn on_commit(job: &mut Job, fx: &mut Vec<Effect>) {
    let to = job.rec.cursor.position;
    let id = job.rec.id.clone();
    let Ok((s, plan, _)) = parts(job) else {
        return;
    };
    let mut remove = std::mem::take(&mut s.owed_removal);
    remove.extend(s.pop_to(plan, to));
    fx.push(Effect::PersistRollouts(Box::new(RolloutWrite {
        job: id,
        admit: Vec::new(),
        remove,
        meta: s.meta(plan),
        counts: None,
    })));
}

/// Rebuilds a restored job's queue from the store (see the module doc).
pub(super) fn restore(job: &mut Job, stored: StoredStream) {
    let cursor = job.rec.cursor.position;
    let id = job.rec.id.clone();
    let Ok((s, plan, pg)) = parts(job) else {
        return;
    };
    let m = stored.meta;
    s.head = m.head;
    s.next_line = m.next_line.max(1);
    for doc in stored.rollouts {
        s.next_line = s.next_line.max(doc.id.line + 1);
        // Zero-variance groups were deleted when they completed; one found
        // here is dropped again (its deletion owed).
        if let Some(dropped) = s.add(plan, &pg, doc) {
            s.owed_removal.extend(dropped);
        }
    }
    plan.rejected_stale = m.rejected_stale;
    plan.zero_variance_groups = m.zero_variance_groups;
    plan.zero_variance_rollouts = m.zero_variance_rollouts;
    let popped = s.pop_to(plan, cursor);
    s.owed_removal.extend(popped);
    if s.head != cursor {
        tracing::warn!(
            job = %id,
            head = s.head,
            cursor,
            "restored rollout queue does not start at the job's cursor"
        );
    }
}
