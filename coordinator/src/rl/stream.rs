//! A streamed policy-gradient job's rollout queue (issue 5, item 5):
//! rollouts pushed through `Rollouts.PushRollouts` are admitted (staleness
//! against the job's committed step), gathered by group id, and a group
//! that reaches `rl.group_size` rollouts is complete: it gets its
//! group-relative advantages and joins the FIFO queue, or, when its rewards
//! are all equal, is dropped and counted. A step takes whole groups from the
//! queue head until it holds its `docs_per_step` rollouts (the step's
//! settings: an operator may change it); it is dispatched only when that
//! many are queued. The planner (`crate::core::planner`) reads the queue head.
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
//! [`QueueFull`] (the core answers `CoreError::QueueFull`), leaving the state unchanged; the shell waits for
//! room and retries. A push is let through over capacity only when the
//! queued complete groups cannot make a step (no commit could ever free
//! room, e.g. the capacity is taken by filling groups).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::rollouts::RolloutPlan;
use crate::job::objective::PgParams;
use crate::job::spec::JobSpec;
use crate::rl::pg;
use crate::stream::doc::{DocBody, DocId, Document, Rollout};

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
    /// The RL loop: prompt-stream positions whose rollouts were admitted
    /// (written with them: a prompt is consumed exactly once).
    #[serde(default)]
    pub prompts_done: u64,
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
    /// Queue position of `queue[0]`.
    head: u64,
    /// Complete groups are read-only: plans hold handles into them.
    queue: VecDeque<Arc<[Document]>>,
    queued_rollouts: u64,
    /// Groups still filling, by group id.
    filling: HashMap<String, Vec<Document>>,
    filling_rollouts: u64,
    next_line: u64,
    /// Stored rollouts of groups already committed (restored before their
    /// deletion was written): deleted by the next write.
    owed_removal: Vec<DocId>,
    /// The RL loop's prompt position (see [`StreamMeta::prompts_done`]).
    pub prompts_done: u64,
}

impl RolloutStream {
    /// The queue of a job whose spec streams its data, else `None`.
    pub fn for_spec(spec: &JobSpec) -> Option<RolloutStream> {
        if !spec.data.is_stream() {
            return None;
        }
        let docs = spec.batch.step_size().docs().unwrap_or(1);
        let group_size = spec.rl.group_size.unwrap_or(1).max(1);
        Some(RolloutStream {
            group_size,
            capacity: spec.rl.queue_capacity_or_default(docs),
            head: 0,
            queue: VecDeque::new(),
            queued_rollouts: 0,
            filling: HashMap::new(),
            filling_rollouts: 0,
            next_line: 1,
            owed_removal: Vec::new(),
            prompts_done: 0,
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

    /// The complete groups, head first.
    pub fn groups(&self) -> impl Iterator<Item = &[Document]> {
        self.queue.iter().map(|g| &g[..])
    }

    /// The complete groups as shared tables (what plans hold handles into).
    pub fn group_tables(&self) -> impl Iterator<Item = &Arc<[Document]>> {
        self.queue.iter()
    }

    /// True when the queue holds a whole step of `need` rollouts.
    pub fn step_ready(&self, need: u64) -> bool {
        self.queued_rollouts >= need
    }

    /// Whether `n` more rollouts may be admitted now, when a step takes
    /// `need` (see the module doc).
    pub fn has_room(&self, n: u64, need: u64) -> bool {
        self.buffered() + n <= self.capacity || !self.step_ready(need)
    }

    /// The job's status reason while it waits for a step of `need`
    /// rollouts, if it does.
    pub fn waiting_reason(&self, need: u64) -> Option<String> {
        (!self.step_ready(need)).then(|| {
            format!(
                "waiting for rollouts: have {} of {need}",
                self.queued_rollouts
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
            prompts_done: self.prompts_done,
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
        match pg::group_advantages(&rewards, pg.scale_by_std, pg.advantage_eps) {
            Some(adv) => {
                for (d, a) in members.iter().zip(adv) {
                    plan.advantage.insert(d.id, a);
                }
                self.queued_rollouts += members.len() as u64;
                self.queue.push_back(members.into());
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
            for d in g.iter() {
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

/// A push refused for want of room: the queue holds `buffered` of its
/// `capacity` rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull {
    pub buffered: u64,
    pub capacity: u64,
}

/// What a push is admitted against.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    pub job: &'a str,
    pub pg: &'a PgParams,
    /// The job's committed step (staleness is measured from it).
    pub step: u64,
    pub max_staleness: Option<u64>,
    /// Rollouts the next step takes.
    pub need: u64,
}

impl RolloutStream {
    /// Admits a batch of rollouts, all or nothing: the returned write
    /// persists them (the shell acknowledges only after it ran). Refused,
    /// with nothing changed, when there is no room (`QueueFull`: the shell
    /// waits and retries).
    pub fn push(
        &mut self,
        plan: &mut RolloutPlan,
        at: Admission<'_>,
        batch: Vec<Rollout>,
    ) -> Result<RolloutWrite, QueueFull> {
        let (fresh, stale): (Vec<Rollout>, Vec<Rollout>) = batch
            .into_iter()
            .partition(|r| pg::admit(r.policy_version, at.step, at.max_staleness).is_ok());
        if !self.has_room(fresh.len() as u64, at.need) {
            return Err(QueueFull {
                buffered: self.buffered(),
                capacity: self.capacity,
            });
        }
        Ok(self.admit(plan, at, fresh, stale.len() as u64))
    }

    /// Admits a generated round whole, over capacity if need be (a round
    /// is planned only while the queue lacks a step, so it is bounded by
    /// `rl.prompts_per_round`), consuming its prompts up to `prompts_done`
    /// in the same write.
    pub fn push_generated(
        &mut self,
        plan: &mut RolloutPlan,
        at: Admission<'_>,
        batch: Vec<Rollout>,
        prompts_done: u64,
    ) -> RolloutWrite {
        let (fresh, stale): (Vec<Rollout>, Vec<Rollout>) = batch
            .into_iter()
            .partition(|r| pg::admit(r.policy_version, at.step, at.max_staleness).is_ok());
        self.prompts_done = prompts_done;
        self.admit(plan, at, fresh, stale.len() as u64)
    }

    fn admit(
        &mut self,
        plan: &mut RolloutPlan,
        at: Admission<'_>,
        fresh: Vec<Rollout>,
        stale: u64,
    ) -> RolloutWrite {
        plan.rejected_stale += stale;
        let mut counts = AdmitCounts {
            accepted: fresh.len() as u64,
            rejected_stale: stale,
            ..Default::default()
        };
        let mut admit = Vec::with_capacity(fresh.len());
        let mut remove = std::mem::take(&mut self.owed_removal);
        for r in fresh {
            let doc = Document {
                id: DocId {
                    file: STREAM_FILE,
                    line: self.next_line,
                },
                body: DocBody::Rollout(r),
            };
            self.next_line += 1;
            admit.push(doc.clone());
            if let Some(dropped) = self.add(plan, at.pg, doc) {
                counts.zero_variance_groups += 1;
                counts.zero_variance_dropped += dropped.len() as u64;
                remove.extend(dropped);
            }
        }
        counts.queued = self.buffered();
        RolloutWrite {
            job: at.job.to_string(),
            admit,
            remove,
            meta: self.meta(plan),
            counts: Some(counts),
        }
    }

    /// After a commit moved the job's cursor to queue position `to`: the
    /// trained groups leave the queue and the store (the write follows the
    /// step's commit record, so a crash in between leaves them to be popped
    /// again on restore).
    pub fn on_commit(&mut self, plan: &mut RolloutPlan, job: &str, to: u64) -> RolloutWrite {
        let mut remove = std::mem::take(&mut self.owed_removal);
        remove.extend(self.pop_to(plan, to));
        RolloutWrite {
            job: job.to_string(),
            admit: Vec::new(),
            remove,
            meta: self.meta(plan),
            counts: None,
        }
    }

    /// Rebuilds a restored job's queue from the store (see the module doc);
    /// `cursor` is the job's committed queue position.
    pub fn restore(
        &mut self,
        plan: &mut RolloutPlan,
        pg: &PgParams,
        job: &str,
        cursor: u64,
        stored: StoredStream,
    ) {
        let m = stored.meta;
        self.head = m.head;
        self.next_line = m.next_line.max(1);
        self.prompts_done = m.prompts_done;
        for doc in stored.rollouts {
            self.next_line = self.next_line.max(doc.id.line + 1);
            // Zero-variance groups were deleted when they completed; one
            // found here is dropped again (its deletion owed).
            if let Some(dropped) = self.add(plan, pg, doc) {
                self.owed_removal.extend(dropped);
            }
        }
        plan.rejected_stale = m.rejected_stale;
        plan.zero_variance_groups = m.zero_variance_groups;
        plan.zero_variance_rollouts = m.zero_variance_rollouts;
        let popped = self.pop_to(plan, cursor);
        self.owed_removal.extend(popped);
        if self.head != cursor {
            tracing::warn!(
                job,
                head = self.head,
                cursor,
                "restored rollout queue does not start at the job's cursor"
            );
        }
    }
}
