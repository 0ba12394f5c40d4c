//! Jobs as the coordinator tracks them: the persisted record and the live
//! state (generation, in-flight step) that is rebuilt after a restart.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::metrics::MetricSums;
use super::recovery::{CheckpointEntry, CommittedStep, Decision};
use super::reference::{ReferenceCache, SeqLogp};
use super::rollouts::RolloutPlan;
use super::step::Annotations;
use super::step::{PlanKind, PlannedStep};
use super::WorkerId;
use crate::cursor::Cursor;
use crate::doc::{DocId, Document};
use crate::spec::JobSpec;

pub type JobId = String;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    Pending,
    Running,
    Paused,
    Completed,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }
}

/// Everything about a job that survives a coordinator restart. Persisted
/// before any reply or worker message that depends on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub name: String,
    /// The validated spec with paths resolved.
    pub spec_toml: String,
    pub state: JobState,
    /// Why the job is pending, paused or failed.
    pub reason: String,
    /// Last committed step (0 before the first).
    pub step: u64,
    pub cursor: Cursor,
    /// Last generation formed (monotonic per job).
    pub generation: u64,
    pub submitted_unix_ms: i64,
    pub last_loss: Option<f64>,
    /// Documents in the dataset.
    pub documents: u64,
    /// Total steps when known, else 0.
    pub total_steps: u64,
    /// Last step whose checkpoint every rank reported written.
    pub last_checkpoint: Option<u64>,
    /// The checkpoint directory the job resumed from (restored until the
    /// job writes a checkpoint of its own).
    #[serde(default)]
    pub resumed_from: Option<std::path::PathBuf>,
    /// Operator changes of the step settings (`accrue set`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<crate::manifest::ConfigChange>,
    /// Good checkpoints, ascending by step (the newest `checkpoint.keep`;
    /// a resumed job's starting checkpoint is the first). Recovery restores
    /// from these.
    #[serde(default)]
    pub checkpoints: Vec<CheckpointEntry>,
    /// Checkpoints that failed to restore, never used again.
    #[serde(default)]
    pub bad_checkpoints: Vec<u64>,
    /// Committed steps after this one are kept for replay (their manifests
    /// are in the store): the job's start, or its oldest retained
    /// checkpoint once older ones were dropped.
    #[serde(default)]
    pub history_from: u64,
    /// Members of the last generation formed (after a restart they are
    /// waited for briefly: they may hold the state in memory).
    #[serde(default)]
    pub members: Vec<WorkerId>,
}

impl JobRecord {
    /// Whether recovery may fall back to the model's own init: the job
    /// started at step 0 and every step since can be replayed.
    pub fn init_allowed(&self) -> bool {
        self.history_from == 0 && self.resumed_from.is_none()
    }
}

/// A fixed membership of a job: ranks 0..W-1.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub id: u64,
    /// Worker of each rank.
    pub members: Vec<WorkerId>,
    /// Ranks that reported Ready for this generation.
    pub ready: Vec<bool>,
    /// The step its members hold: the configured step, then advanced by
    /// every replayed or committed step.
    pub step: u64,
    /// Where its state came from, and the steps it replays.
    pub decision: Decision,
}

impl Generation {
    pub fn world_size(&self) -> u32 {
        self.members.len() as u32
    }

    pub fn all_ready(&self) -> bool {
        self.ready.iter().all(|&r| r)
    }

    pub fn rank_of(&self, worker: &str) -> Option<u32> {
        self.members
            .iter()
            .position(|w| w == worker)
            .map(|r| r as u32)
    }
}

/// A dispatched step waiting for every rank's result.
#[derive(Debug, Clone)]
pub struct InFlight {
    pub planned: Arc<PlannedStep>,
    pub started_ms: i64,
    pub results: BTreeMap<u32, MetricSums>,
    /// Reference plans: the sequences' log-probs reported so far.
    pub logps: Vec<SeqLogp>,
}

/// A job with its live state.
#[derive(Debug, Clone)]
pub struct Job {
    pub rec: JobRecord,
    pub spec: JobSpec,
    /// The tokenized dataset (shared, read-only).
    pub docs: Arc<[Document]>,
    pub gen: Option<Generation>,
    pub inflight: Option<InFlight>,
    /// Pause at the next step boundary.
    pub pause_requested: bool,
    /// Checkpoint at the next step boundary.
    pub checkpoint_requested: bool,
    /// Checkpoints being written (asynchronously; training goes on): per
    /// step, the workers asked to write it and whether each reported it
    /// durable. It counts once all have.
    pub pending_checkpoints: BTreeMap<u64, BTreeMap<WorkerId, bool>>,
    /// Published policies (`rl.publish_every`) by step: members yet to answer.
    pub publish_acks: BTreeMap<u64, std::collections::BTreeSet<WorkerId>>,
    /// A cached reference (DPO, or PG with a KL penalty): the log-probs so far.
    pub reference: Option<ReferenceCache>,
    /// Policy gradient: groups and advantages.
    pub rollouts: Option<RolloutPlan>,
    /// A membership change waits for the checkpoint of the current step
    /// (zero2/fsdp drains only: the leaver's shards must reach disk).
    pub regroup_after_checkpoint: bool,
    /// Committed steps after `rec.history_from`, for replay.
    pub history: BTreeMap<u64, CommittedStep>,
    /// The next generation must restore from disk (a state sync failed).
    pub force_restore: bool,
    /// The last plan dispatched: (generation, step, kind), so that a result
    /// arriving after its generation ended still tells what the worker holds.
    pub last_plan: Option<(u64, u64, PlanKind)>,
    /// Documents by id (built on the first replay).
    pub doc_index: Option<Arc<HashMap<DocId, usize>>>,
    /// After a restart: form no generation before this time unless every
    /// member of the last one is back.
    pub rejoin_deadline_ms: Option<i64>,
    /// Streamed PG jobs (`data.source = "stream"`): the queue of groups.
    pub stream: Option<super::stream::RolloutStream>,
    /// The last training step dispatched and how many times it was
    /// (1 + aborts before commit); live only.
    pub attempts: (u64, u32),
}

impl Job {
    pub fn new(rec: JobRecord, spec: JobSpec, docs: Arc<[Document]>) -> Self {
        Self {
            rec,
            spec,
            docs,
            gen: None,
            inflight: None,
            pause_requested: false,
            checkpoint_requested: false,
            pending_checkpoints: BTreeMap::new(),
            reference: None,
            rollouts: None,
            regroup_after_checkpoint: false,
            history: BTreeMap::new(),
            force_restore: false,
            last_plan: None,
            doc_index: None,
            rejoin_deadline_ms: None,
            publish_acks: BTreeMap::new(),
            stream: None,
            attempts: (0, 0),
        }
    }

    /// True while the generation re-runs committed steps after a restore.
    pub fn replaying(&self) -> bool {
        self.gen.as_ref().is_some_and(|g| g.step < self.rec.step)
    }

    /// Where the checkpoint of `step` is written.
    pub fn checkpoint_dir(&self, step: u64) -> std::path::PathBuf {
        self.spec
            .job
            .output_dir
            .join("checkpoints")
            .join(format!("step-{step}"))
    }

    /// Drops replay history at or below `rec.history_from`.
    pub fn prune_history(&mut self) {
        self.history = self.history.split_off(&(self.rec.history_from + 1));
    }

    /// What this job's plans carry besides the documents.
    pub fn annotations(&self) -> Annotations<'_> {
        Annotations {
            reference: self.reference.as_ref(),
            rollouts: self.rollouts.as_ref(),
        }
    }

    /// Units of the job's stream: documents, or groups for PG.
    pub fn stream_len(&self) -> usize {
        self.rollouts
            .as_ref()
            .map_or(self.docs.len(), |r| r.units.len())
    }

    /// True when the job has trained all it was asked to.
    pub fn finished(&self) -> bool {
        match self.spec.job.steps {
            Some(steps) => self.rec.step >= steps,
            // A stream without job.steps runs until cancelled.
            None if self.stream.is_some() => false,
            None => {
                super::step::order_of(&self.spec, self.stream_len()).exhausted(&self.rec.cursor)
            }
        }
    }
}
