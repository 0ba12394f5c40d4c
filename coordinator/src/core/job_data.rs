//! A job's documents and everything derived from them: the dataset, the
//! cached reference, rollout groups and streams, the RL loop's state, the
//! replay history held in memory, sources, order and eval set.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use tracing::info;

use super::eval::EvalSet;
use super::reference::{self, ReferenceCache, ReferenceLogps};
use super::step::Annotations;
use super::types::CommittedStep;
use crate::job::sources::Source;
use crate::job::spec::JobSpec;
use crate::rl::rollouts::{self, RolloutPlan};
use crate::rl::stream::RolloutStream;
use crate::stream::cursor::{Order, SourceOrder};
use crate::stream::doc::{DocId, Document};

/// Committed steps whose replay history stays in memory; older steps'
/// documents are read back from the store only if a replay reaches them.
pub const HISTORY_WINDOW: u64 = 64;

/// Steps of stored history a replay loads back at a time.
pub const HISTORY_LOAD_STEPS: u64 = 64;

/// A job's documents and everything derived from them.
#[derive(Debug, Clone)]
pub struct JobData {
    /// The tokenized dataset (shared, read-only).
    pub docs: Arc<[Document]>,
    /// A cached reference (DPO, or PG with a KL penalty): the log-probs so far.
    pub reference: Option<ReferenceCache>,
    /// Policy gradient: groups and advantages.
    pub rollouts: Option<RolloutPlan>,
    /// Streamed PG jobs (`data.source = "stream"`): the queue of groups.
    pub stream: Option<RolloutStream>,
    /// The RL loop (`data.source = "generate"`): prompts and rounds.
    pub rollout_loop: Option<crate::rl::rounds::LoopState>,
    /// A served job (`[rl.serve]`): its endpoint's waiting calls.
    pub serve: Option<crate::rl::serve::ServeQueue>,
    /// The loop's rounds scored since the last commit (step metrics).
    pub loop_stats: crate::rl::rounds::RoundStats,
    /// Committed steps after `rec.history_from` held in memory for replay:
    /// the newest `HISTORY_WINDOW`, and those a replay in progress loaded
    /// back from the store (issue 19: a job that never checkpoints would
    /// otherwise hold every step's documents for its whole run).
    pub history: BTreeMap<u64, CommittedStep>,
    /// Committed steps after `rec.history_from` and at or below this were
    /// dropped from memory: the store holds their records, and a replay
    /// loads them back ([`super::effects::Effect::LoadHistory`]).
    pub history_stored_through: u64,
    /// The first step of a load of stored history asked of the shell and
    /// not yet answered.
    pub history_loading: Option<u64>,
    /// Documents by id (built on the first replay).
    doc_index: OnceLock<HashMap<DocId, usize>>,
    /// The training sources (one for a plain `data.train`).
    pub sources: Vec<Source>,
    /// The source of each file of the job (`DocId::file` indexes it).
    pub file_source: Vec<u32>,
    /// How the file stream is served (the spec's weights; see
    /// `Job::order_at` for a step's).
    pub order: Order,
    /// `[eval]`: the eval documents (never in the training stream).
    pub eval: Option<EvalSet>,
}

impl JobData {
    /// The generation running apart from the trainers (`rl.engine` or
    /// `rl.generators`), if the job has one.
    pub fn engine_mut(&mut self) -> Option<&mut crate::rl::rounds::EngineLoop> {
        self.rollout_loop.as_mut().and_then(|l| l.engine.as_mut())
    }

    /// A job's data at submit or restore: the cached reference so far,
    /// its rollout groups (admitted against committed step `step`) and its
    /// stream queue, as its spec asks.
    pub fn new(
        job: &str,
        spec: &JobSpec,
        docs: Arc<[Document]>,
        reference: Option<ReferenceLogps>,
        step: u64,
    ) -> JobData {
        // Eval documents come after the training ones (their files follow
        // the training files): split them off.
        let train_files = spec.data.files().len() as u32;
        let (docs, eval) = match &spec.eval {
            Some(e) if docs.iter().any(|d| d.id.file >= train_files) => {
                let (t, ev): (Vec<Document>, Vec<Document>) =
                    docs.iter().cloned().partition(|d| d.id.file < train_files);
                let sources = crate::job::sources::resolve(&e.sources, train_files, None);
                let mut file_source = vec![0; train_files as usize];
                file_source.extend(crate::job::sources::file_sources(&sources));
                let set = EvalSet {
                    docs: ev.into(),
                    file_source: file_source.clone(),
                    sources,
                    every_steps: e.every_steps,
                    dpo_beta: spec.objective.dpo().map(|d| d.beta),
                };
                (Arc::from(t), Some(set))
            }
            _ => (docs, None),
        };
        let rollouts = spec.objective.pg().map(|pg| {
            let plan = rollouts::prepare(&docs, &pg, spec.rl.max_staleness, step);
            info!(
                job,
                groups = plan.units.len(),
                zero_variance_groups = plan.zero_variance_groups,
                rejected_stale = plan.rejected_stale,
                "rollouts grouped"
            );
            plan
        });
        let sources = spec.data.train_sources(spec.job.epochs);
        let file_source = crate::job::sources::file_sources(&sources);
        let len = rollouts.as_ref().map_or(docs.len(), |r| r.units.len()) as u64;
        let order = if rollouts.is_some() || sources.len() < 2 {
            Order::single(spec.job.seed, spec.data.shuffle, len, spec.job.epochs)
        } else {
            // Documents come in source order: each source is one range.
            let mut parts: Vec<SourceOrder> = sources
                .iter()
                .map(|s| SourceOrder {
                    start: 0,
                    len: 0,
                    epochs: s.epochs,
                })
                .collect();
            for d in docs.iter() {
                let src = file_source.get(d.id.file as usize).copied().unwrap_or(0);
                parts[src as usize].len += 1;
            }
            let mut start = 0;
            for p in &mut parts {
                p.start = start;
                start += p.len;
            }
            let weights = sources.iter().map(|s| s.weight).collect();
            Order::mixture(spec.job.seed, spec.data.shuffle, parts, weights)
        };
        JobData {
            reference: reference::needs_cache(spec)
                .then(|| ReferenceCache::new(reference.unwrap_or_default())),
            rollouts,
            stream: RolloutStream::for_spec(spec),
            rollout_loop: spec.data.is_generate().then(|| {
                let l = crate::rl::rounds::LoopState::new(spec.job.seed, spec.data.shuffle);
                match &spec.rl.engine {
                    // A frozen engine serves the starting policy throughout.
                    Some(e) => l.with_engine(
                        (e.reload == crate::job::engine::EngineReload::None).then_some(step),
                    ),
                    // Generator workers start with no known policy.
                    None if spec.rl.generators.is_some() => l.with_engine(None),
                    None => l,
                }
            }),
            serve: spec
                .rl
                .serve
                .as_ref()
                .map(|s| crate::rl::serve::ServeQueue::new(s.max_waiting, s.max_batch)),
            loop_stats: Default::default(),
            history: BTreeMap::new(),
            history_stored_through: 0,
            history_loading: None,
            doc_index: OnceLock::new(),
            docs,
            sources,
            file_source,
            order,
            eval,
        }
    }

    /// Whether the cached reference holds every document that needs one
    /// (the eval pairs too).
    pub fn reference_complete(&self) -> bool {
        self.reference.as_ref().is_none_or(|c| {
            c.complete(&self.docs) && self.eval.as_ref().is_none_or(|e| c.complete(&e.docs))
        })
    }

    /// Every document of the job: training, then eval.
    pub fn all_docs(&self) -> impl Iterator<Item = &Document> {
        self.docs
            .iter()
            .chain(self.eval.iter().flat_map(|e| e.docs.iter()))
    }

    /// The source index of a document of the job.
    pub fn source_of(&self, doc: &DocId) -> u32 {
        self.file_source
            .get(doc.file as usize)
            .copied()
            .unwrap_or(0)
    }

    /// The name of source `s`.
    pub fn source_name(&self, s: u32) -> &str {
        self.sources
            .get(s as usize)
            .map_or("train", |s| s.name.as_str())
    }

    /// What this job's plans carry besides the documents.
    pub fn annotations(&self) -> Annotations<'_> {
        Annotations {
            reference: self.reference.as_ref(),
            rollouts: self.rollouts.as_ref(),
            file_source: Some(&self.file_source),
        }
    }

    /// Units of the job's file stream: documents, or groups for PG.
    pub fn stream_len(&self) -> usize {
        self.rollouts
            .as_ref()
            .map_or(self.docs.len(), |r| r.units.len())
    }

    /// Documents by id.
    pub fn doc_index(&self) -> &HashMap<DocId, usize> {
        self.doc_index.get_or_init(|| {
            self.docs
                .iter()
                .enumerate()
                .map(|(i, d)| (d.id, i))
                .collect()
        })
    }
}
