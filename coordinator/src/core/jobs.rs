//! Jobs as the coordinator tracks them: the persisted record and the live
//! state (generation, in-flight step) that is rebuilt after a restart.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::metrics::MetricSums;
use super::reference::{ReferenceCache, SeqLogp};
use super::rollouts::RolloutPlan;
use super::step::Annotations;
use super::step::PlannedStep;
use super::WorkerId;
use crate::cursor::Cursor;
use crate::doc::Document;
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
}

/// A fixed membership of a job: ranks 0..W-1.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub id: u64,
    /// Worker of each rank.
    pub members: Vec<WorkerId>,
    /// Ranks that reported Ready for this generation.
    pub ready: Vec<bool>,
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
    /// Workers asked to write the checkpoint of step `.0`, and whether each
    /// has reported it written.
    pub checkpoint_acks: Option<(u64, BTreeMap<WorkerId, bool>)>,
    /// Published policies (`rl.publish_every`) by step: members yet to answer.
    pub publish_acks: BTreeMap<u64, std::collections::BTreeSet<WorkerId>>,
    /// DPO with a cached reference: the log-probs computed so far.
    pub reference: Option<ReferenceCache>,
    /// Policy gradient: groups and advantages.
    pub rollouts: Option<RolloutPlan>,
    /// A membership change waits for the checkpoint of the current step.
    pub regroup_after_checkpoint: bool,
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
            checkpoint_acks: None,
            publish_acks: BTreeMap::new(),
            reference: None,
            rollouts: None,
            regroup_after_checkpoint: false,
            stream: None,
            attempts: (0, 0),
        }
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
