//! Committing what a plan did once every rank reported: a training step
//! (the cursor moves only here, with its metrics and manifest), an eval
//! chunk, a reference chunk; then the step boundary (pause, drains, joins,
//! completion once the final checkpoint is durable). See DESIGN.md "The
//! life of a step".

use std::collections::BTreeMap;

use tracing::info;

use super::ctx::JobCtx;
use super::effects::{Effect, Persist, WatchItem};
use super::metrics::{self, StepFacts};
use super::phase::{AfterCheckpoint, InFlight, Work};
use super::reference;
use super::step::PlannedStep;
use super::types::{AbortReason, CommittedStep, End, EventKind, Why};
use super::workers::Worker;
use crate::core::manifest::{MicrobatchEntry, SeqEntry, StepManifest};

impl JobCtx<'_> {
    /// Σ peak FLOP/s of the job's current generation; 0 when any member's
    /// peak is unknown (a partial sum would overstate MFU).
    pub(crate) fn generation_peak_flops(&self) -> f64 {
        let Some(gen) = self.job.gen() else {
            return 0.0;
        };
        let peaks: Vec<u64> = gen
            .members
            .iter()
            .map(|id| self.workers.get(id).map_or(0, |w| w.reg.peak_flops))
            .collect();
        if peaks.contains(&0) {
            return 0.0;
        }
        peaks.iter().map(|&p| p as f64).sum()
    }

    /// Every rank reported its part of an eval chunk: its sums join the
    /// evaluation's; after the last chunk the metrics are written and sent.
    /// Nothing else moves (no cursor, no step).
    pub(crate) fn commit_eval(&mut self, flight: InFlight) {
        let job = &mut *self.job;
        let (Some(set), Some(run)) = (job.data.eval.as_ref(), job.eval_run.as_mut()) else {
            return;
        };
        let wanted: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let docs: Vec<&crate::stream::doc::Document> =
            set.docs.iter().filter(|d| wanted.contains(&d.id)).collect();
        if let Err(e) = run.add_chunk(set, &docs, &flight.logps, job.data.reference.as_ref()) {
            let why = Why::new(AbortReason::JobFailed, e.to_string());
            self.finish(End::Failed(why));
            return;
        }
        if run.next >= set.docs.len() {
            let m = run.finish(set, self.now);
            job.eval_run = None;
            info!(
                job = %self.id,
                step = m.step,
                loss = m.loss,
                "evaluation done"
            );
            self.fx.push(Effect::AppendEval {
                job: self.id.clone(),
                path: job.spec.job.output_dir.join("metrics.jsonl"),
                eval: Box::new(m.clone()),
            });
            self.fx.push(Effect::Publish {
                job: self.id.clone(),
                item: WatchItem::Eval(m),
            });
        }
        self.at_boundary();
    }

    /// Every rank reported its part of a reference chunk: the log-probs are
    /// stored (the store write precedes any plan that carries them).
    pub(crate) fn commit_reference(&mut self, flight: InFlight) {
        let job = &mut *self.job;
        let kind = reference::pass_kind(&job.spec).unwrap_or(reference::PassKind::Pairs);
        let planned: std::collections::BTreeSet<_> = flight.planned.docs.iter().collect();
        let lens: BTreeMap<_, _> = job
            .data
            .docs
            .iter()
            .filter(|d| planned.contains(&d.id))
            .map(|d| (d.id, d.tokens() as usize))
            .collect();
        let token_count = |d: &crate::stream::doc::DocId| lens.get(d).copied().unwrap_or(0);
        let entries = match reference::collect_chunk(
            &flight.planned.docs,
            &flight.logps,
            kind,
            token_count,
        ) {
            Ok(e) => e,
            Err(e) => {
                let why = Why::new(
                    AbortReason::JobFailed,
                    format!("chunk {}: {e}", flight.planned.step),
                );
                self.finish(End::Failed(why));
                return;
            }
        };
        let cache = job.data.reference.get_or_insert_with(Default::default);
        cache.chunks += 1;
        cache.logps.extend(entries.iter().cloned());
        let (done, total) = (cache.logps.len(), job.data.docs.len());
        info!(job = %self.id, done, total, "reference chunk committed");
        self.fx.persist(Persist::Reference {
            job: self.id.clone(),
            entries,
        });
        let what = match kind {
            reference::PassKind::Pairs => "pairs",
            reference::PassKind::Tokens => "rollouts",
        };
        let msg = format!("reference log-probs of {done}/{total} {what} cached");
        self.fx.push(job.event(EventKind::Reference, msg, self.now));
        self.at_boundary();
    }

    /// Every rank reported: the step commits, the cursor moves.
    pub(crate) fn commit(&mut self, flight: InFlight) {
        let peak_flops = self.generation_peak_flops();
        let job = &mut *self.job;
        // Per-source metrics for a mixture (one source: the step's own).
        let source_names: Vec<String> = match job.data.sources.len() {
            0 | 1 => Vec::new(),
            _ => job.data.sources.iter().map(|s| s.name.clone()).collect(),
        };
        let active = job.active_mut().expect("committing within a generation");
        let planned = flight.planned.clone();
        active.gen.step = planned.step;
        let (world_size, generation) = (active.gen.world_size(), active.gen.id);
        // A context-parallel group's ranks each report the group's result:
        // its first rank's counts (`on_result`).
        let context = job.spec.parallel.context.max(1);
        let ranks: Vec<_> = flight
            .results
            .into_iter()
            .filter(|(r, _)| r % context == 0)
            .map(|(_, sums)| sums)
            .collect();
        let facts = StepFacts {
            step: planned.step,
            lr: planned.lr,
            world_size,
            generation,
            microbatches: planned.microbatches(),
            step_time_s: (self.now - flight.started_ms).max(0) as f64 / 1000.0,
            unix_ms: self.now,
            peak_flops,
            source_names: &source_names,
        };
        let mut m = metrics::aggregate(facts, planned.cursor_after.clone(), &ranks);
        if source_names.is_empty() {
            m.sources.clear();
        }
        if let (Some(s), Some(r)) = (&planned.staleness, &job.data.rollouts) {
            m.extra.insert("staleness/mean".into(), s.mean());
            m.extra.insert("staleness/max".into(), s.max as f64);
            m.count("zero_variance_groups", r.zero_variance_groups);
            m.count("rejected_stale", r.rejected_stale);
        }
        // The RL loop's rounds since the last commit (reward, accuracy,
        // response length, generation speed).
        m.extra
            .extend(std::mem::take(&mut job.data.loop_stats).metrics());
        job.rec.step = planned.step;
        job.rec.cursor = planned.cursor_after.clone();
        job.rec.last_loss = Some(m.loss);
        job.data.history.insert(
            planned.step,
            CommittedStep {
                step: planned.step,
                lr: planned.lr,
                docs: crate::stream::doc::DocIds::new(&planned.docs),
                cursor_after: planned.cursor_after.clone(),
            },
        );
        job.trim_history(None);
        info!(
            job = %self.id,
            step = m.step,
            loss = m.loss,
            tokens = m.tokens,
            "step committed"
        );
        let mut manifest = manifest_of(&planned, generation, job.attempts_of(planned.step));
        if !source_names.is_empty() {
            manifest.record_sources(&job.data.file_source, &source_names);
        }
        if let Some(s) = &job.data.stream {
            manifest.groups = trained_groups(s, &planned.docs);
        }
        self.fx.persist(Persist::Step {
            rec: Box::new(job.rec.clone()),
            metrics: Box::new(m.clone()),
            docs: planned.docs.clone(),
            manifest: Box::new(manifest),
        });
        self.fx.push(Effect::AppendMetrics {
            job: self.id.clone(),
            path: job.spec.job.output_dir.join("metrics.jsonl"),
            metrics: Box::new(m.clone()),
        });
        self.fx.push(Effect::Publish {
            job: self.id.clone(),
            item: WatchItem::Step(Box::new(m)),
        });
        let (id, to) = (job.rec.id.clone(), job.rec.cursor.position);
        if let (Some(s), Some(plan)) = (job.data.stream.as_mut(), job.data.rollouts.as_mut()) {
            self.fx
                .persist(Persist::Rollouts(Box::new(s.on_commit(plan, &id, to))));
        }

        super::publish::request_if_due(job, self.fx);
        let every = job.spec.checkpoint.every_steps;
        let finished = job.finished();
        // An evaluation after every `eval.every_steps`-th step and the last
        // (it runs before the next step is planned).
        if let Some(e) = &job.data.eval {
            if job.rec.step.is_multiple_of(e.every_steps.max(1)) || finished {
                job.eval_run = Some(super::eval::EvalRun::new(job.rec.step));
            }
        }
        let due = (every > 0 && job.rec.step.is_multiple_of(every))
            || job.requests.checkpoint
            || finished;
        if due {
            job.requests.checkpoint = false;
            job.request_checkpoint(self.fx);
        }
        // A final evaluation (or the RL loop's eval prompts) runs first;
        // the job completes after it.
        if finished && job.eval_run.is_none() && !self.eval_due() {
            self.complete("all steps trained");
            return;
        }
        self.at_boundary();
    }

    /// The job trained all it will: it completes once the committed
    /// step's checkpoint is durable, so that "completed" always means the
    /// trained model is on disk. Until then the generation waits (a lost
    /// writer re-forms it, and the next generation asks again).
    pub(crate) fn complete(&mut self, detail: &str) {
        let job = &mut *self.job;
        if job.step_durable() {
            self.finish(End::Completed(detail.into()));
            return;
        }
        job.request_checkpoint(self.fx);
        if let Some(a) = job.active_mut() {
            a.work = Work::AwaitingCheckpoint(AfterCheckpoint::Complete(detail.into()));
        }
        let msg = format!(
            "step {} trained ({detail}); completing once its checkpoint is durable",
            job.rec.step
        );
        self.fx.push(job.event(EventKind::State, msg, self.now));
    }

    /// A step boundary: a requested pause takes effect, drained workers
    /// leave and joiners come in (both form a new generation).
    pub(crate) fn at_boundary(&mut self) {
        let job = &*self.job;
        let gen = job.gen().expect("a boundary within a generation");
        // Every step, so no copy of the generation and no lookup per
        // member: one pass over the workers, and the membership check only
        // for a draining one (rare).
        let leaving = self
            .workers
            .iter()
            .any(|(id, w)| w.draining && gen.everyone().any(|m| m == id));
        let size = gen.world_size() + gen.generators.len();
        let joining = size < job.spec.parallel.max_workers
            && match job.spec.parallel.context {
                0 | 1 => self.workers.values().any(Worker::available),
                // Joiners that would not make a whole group more wait
                // (a new generation of the same members would only cost).
                _ => {
                    let spares = self.workers.values().filter(|w| w.available()).count();
                    grows(job, gen, spares as u32)
                }
            };
        if self.job.requests.pause {
            self.job.requests.pause = false;
            self.pause_now();
        }
        if leaving || joining {
            self.regroup();
        }
    }
}

/// Whether `spares` more workers would form a larger generation than
/// `gen` under context parallelism: more whole context-parallel groups of
/// trainers, or more generators (`membership::compose` decides alike).
fn grows(job: &super::job::Job, gen: &super::generation::Generation, spares: u32) -> bool {
    let p = &job.spec.parallel;
    let size = gen.world_size() + gen.generators.len();
    let all = (size + spares).min(p.max_workers);
    let generators = job
        .spec
        .rl
        .generators
        .map_or(0, |g| g.min(all.saturating_sub(1)));
    let trainers = (all - generators) / p.context * p.context;
    trainers > gen.world_size() || generators > gen.generators.len()
}

/// The groups of a streamed step's documents, in queue order (they are
/// still queued: a commit pops them after its manifest is written).
fn trained_groups(
    s: &crate::rl::stream::RolloutStream,
    docs: &[crate::stream::doc::DocId],
) -> Vec<String> {
    let ids: std::collections::HashSet<_> = docs.iter().collect();
    s.groups()
        .filter_map(|g| g.iter().find(|d| ids.contains(&d.id)))
        .filter_map(|d| match &d.body {
            crate::stream::doc::DocBody::Rollout(r) => Some(r.group.clone()),
            _ => None,
        })
        .collect()
}

/// The manifest of `planned`, committing in `generation` after `attempts`
/// dispatches: the settings it ran with and its exact layout.
fn manifest_of(planned: &PlannedStep, generation: u64, attempts: u32) -> StepManifest {
    let ranks: Vec<Vec<MicrobatchEntry>> = planned
        .ranks
        .iter()
        .map(|mbs| {
            mbs.iter()
                .map(|mb| MicrobatchEntry {
                    tokens: mb.tokens() as u32,
                    seqs: mb
                        .seqs
                        .iter()
                        .zip(mb.cu_seq_lens.windows(2))
                        .map(|(s, w)| SeqEntry(s.doc, s.role, w[1] - w[0]))
                        .collect(),
                })
                .collect()
        })
        .collect();
    StepManifest {
        step: planned.step,
        generation,
        world_size: planned.ranks.len() as u32,
        lr: planned.lr,
        settings: planned.settings,
        epoch: planned.cursor_after.epoch,
        tokens: ranks.iter().flatten().map(|m| u64::from(m.tokens)).sum(),
        attempts,
        replayed: false,
        ranks,
        files: Default::default(),
        sources: Default::default(),
        groups: Vec::new(),
    }
}
