//! The one planner (issue 13): every plan a job runs comes from a
//! [`Source`] and the step's settings (`crate::job::settings`), and is packed
//! and built in one place (`plan`):
//! - **files**: the next documents (PG: whole groups) of the job's seeded
//!   stream from its cursor, sized by the step's settings;
//! - **stream**: whole groups from the head of a streamed job's queue;
//! - **replay**: a committed step's documents and learning rate again,
//!   after a restore from an older state;
//! - **reference**: a forward-only chunk of the cached reference pass.
//!
//! Phase 1 chooses the documents (`plan::select` for files, whole groups
//! for rollouts), phase 2 packs them and spreads them over ranks
//! (`plan::solve`, through [`pack_documents`]), phase 3 lays out the
//! per-rank microbatches: handles to the documents and the counts a result
//! is checked against, never copies of their tokens (the session task
//! materialises those when it encodes the plan, outside the state lock).
//! See `coordinator/src/plan/README.md`.

use std::collections::HashSet;

use crate::job::batch::StepSize;
use crate::job::parallel::Sharding;
use crate::job::settings::StepSettings;
use crate::job::spec::JobSpec;
use crate::rl::pg::{self, StalenessStats};
use crate::stream::cursor::Cursor;
use crate::stream::doc::{DocBody, DocId, Document};
use crate::stream::plan::{self, PlanError, StepTarget};

use super::ahead::{Ahead, Origin};
use super::bisect::{self, Bisection};
use super::eval::EvalRun;
use super::job::Job;
use super::job_data::HISTORY_LOAD_STEPS;
use super::step::{pack_documents, payload, DocHandle, PlannedStep};
use super::types::{CommittedStep, PlanKind};
use crate::rl::rollouts::{self, RolloutPlan};

/// Where a plan's documents come from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    Files,
    Stream,
    Replay(&'a CommittedStep),
    /// A replay reached steps `from..=to` whose documents only the store
    /// holds: they are read back before the replay goes on.
    LoadHistory {
        from: u64,
        to: u64,
    },
    Reference,
    /// The next round of a bisection of a non-finite step.
    Probe(&'a Bisection),
    /// The next chunk of an evaluation (`[eval]`).
    Eval(&'a EvalRun),
}

/// Why a step could not be planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanFailure {
    #[error("planning step {step}: {source}")]
    Pack { step: u64, source: PlanError },
    #[error("replaying step {step}: its manifest names document {doc}, which the dataset no longer holds")]
    UnknownDoc {
        step: u64,
        doc: crate::stream::doc::DocId,
    },
    #[error("replaying step {step}: no manifest kept for it")]
    NoHistory { step: u64 },
    #[error("probing step {step}: document {doc} is no longer held")]
    ProbeDoc {
        step: u64,
        doc: crate::stream::doc::DocId,
    },
}

/// The source of `job`'s next plan: a replay while its generation is
/// behind the committed step, the reference pass while its cache is
/// incomplete, else its stream or files.
pub fn next_source(job: &Job) -> Result<Source<'_>, PlanFailure> {
    if let Some(gen) = job.gen().filter(|_| job.replaying()) {
        let step = gen.step + 1;
        if let Some(h) = job.data.history.get(&step) {
            return Ok(Source::Replay(h));
        }
        let stored = job.data.history_stored_through;
        if step > job.rec.history_from && step <= stored {
            let to = stored.min(step + HISTORY_LOAD_STEPS - 1);
            return Ok(Source::LoadHistory { from: step, to });
        }
        return Err(PlanFailure::NoHistory { step });
    }
    if let Some(b) = &job.faults.bisection {
        return Ok(Source::Probe(b));
    }
    if !job.data.reference_complete() {
        return Ok(Source::Reference);
    }
    if let Some(run) = job.eval_run.as_ref().filter(|_| job.data.eval.is_some()) {
        return Ok(Source::Eval(run));
    }
    Ok(if job.data.stream.is_some() {
        Source::Stream
    } else {
        Source::Files
    })
}

/// Where `job` is now, as a step planned ahead records it (`ahead`).
fn origin(job: &Job, world_size: u32) -> Option<Origin> {
    Some(Origin {
        generation: job.gen()?.id,
        world_size,
        step: job.rec.step,
        cursor: job.rec.cursor.clone(),
        changes: job.rec.changes.clone(),
        quarantine: job.rec.quarantine.clone(),
        total_steps: job.rec.total_steps,
    })
}

/// Plans the step after `in_flight` as dispatch will once `in_flight`
/// commits (see `ahead`); `None` when dispatch would not plan it from the
/// job's files (a replay, a stream, a bisection, an incomplete reference
/// pass, the last step) or there is nothing to plan.
pub fn plan_ahead(job: &mut Job, world_size: u32, in_flight: &PlannedStep) -> Option<Ahead> {
    let files = in_flight.kind == PlanKind::Train
        && !in_flight.replay
        && job.data.stream.is_none()
        && job.faults.bisection.is_none()
        && job.data.reference_complete();
    if !files {
        return None;
    }
    // The job as it will be once `in_flight` commits (its step and cursor:
    // nothing else planning reads moves at a commit).
    let step = std::mem::replace(&mut job.rec.step, in_flight.step);
    let cursor = std::mem::replace(&mut job.rec.cursor, in_flight.cursor_after.clone());
    let ahead = match job.finished() {
        true => None,
        false => match (
            plan(job, Source::Files, world_size),
            origin(job, world_size),
        ) {
            (Ok(Some(planned)), Some(origin)) => Some(Ahead::new(origin, planned)),
            // Failures are dispatch's to report, when it plans again.
            _ => None,
        },
    };
    job.rec.step = step;
    job.rec.cursor = cursor;
    ahead
}

/// The step planned ahead, if the job is now where it was planned from
/// (dispatch, about to plan from the job's files); dropped either way.
pub fn take_ahead(job: &mut Job, world_size: u32) -> Option<PlannedStep> {
    let ahead = job.ahead.next.take()?;
    ahead.take_if_from(&origin(job, world_size)?)
}

/// The longest row a microbatch of a step planned with `settings` holds:
/// a rank's budget times its context-parallel group (the planner packs
/// for the group; each of its ranks trains a share of every row).
fn row_tokens(job: &Job, settings: &StepSettings) -> u32 {
    job.spec.parallel.row_budget(settings.max_tokens).tokens()
}

/// A plan's documents before packing.
struct Chosen {
    kind: PlanKind,
    step: u64,
    settings: StepSettings,
    lr: f64,
    docs: Vec<DocHandle>,
    cursor_after: Cursor,
    staleness: Option<StalenessStats>,
    replay: bool,
}

/// Plans `job`'s next work from `source` for `world_size` data-parallel
/// ranks (a generation's context-parallel groups), or `None`
/// when the source has nothing to give (the file stream is exhausted, the
/// queue does not hold a step, the reference cache is complete).
pub fn plan(
    job: &Job,
    source: Source<'_>,
    world_size: u32,
) -> Result<Option<PlannedStep>, PlanFailure> {
    let chosen = match source {
        Source::Files => files(job, world_size),
        Source::Stream => stream(job, world_size),
        Source::Replay(entry) => replay(job, entry).map(Some)?,
        // Dispatch asks the shell to load them first; never planned.
        Source::LoadHistory { from, .. } => return Err(PlanFailure::NoHistory { step: from }),
        Source::Reference => reference(job),
        Source::Probe(b) => return probe(job, b, world_size).map(Some),
        Source::Eval(run) => eval(job, run),
    };
    let Some(c) = chosen else {
        return Ok(None);
    };
    let row = row_tokens(job, &c.settings);
    let target = StepTarget::new(c.settings.size, world_size, row);
    let min_microbatches = match c.kind {
        PlanKind::Train => target.min_microbatches_per_rank(),
        PlanKind::Reference | PlanKind::Probe | PlanKind::Eval => 1,
    };
    let (ranks, normalizers) = pack_documents(
        &c.docs,
        row,
        world_size,
        min_microbatches,
        job.data.annotations(),
    )
    .map_err(|source| PlanFailure::Pack {
        step: c.step,
        source,
    })?;
    Ok(Some(PlannedStep {
        kind: c.kind,
        step: c.step,
        lr: c.lr,
        settings: c.settings,
        cursor_after: c.cursor_after,
        normalizers,
        ranks,
        docs: c.docs.iter().map(|d| d.id).collect(),
        staleness: c.staleness,
        replay: c.replay,
    }))
}

/// The next training step from the job's files (PG: its groups).
fn files(job: &Job, world_size: u32) -> Option<Chosen> {
    let step = job.rec.step + 1;
    let settings = job.settings().at(step);
    let docs = &job.data.docs;
    let rollouts = job.data.rollouts.as_ref();
    let order = job.order_at(step);
    let cursor = &job.rec.cursor;
    let target = StepTarget::new(settings.size, world_size, row_tokens(job, &settings));
    // Quarantined documents are passed over as if not in the dataset (a
    // PG group is passed over once all its rollouts are).
    let quarantined: HashSet<DocId> = job.rec.quarantine.iter().map(|q| q.doc).collect();
    let kept = |d: &u32| !quarantined.contains(&docs[*d as usize].id);
    let skip = |unit: u64| match rollouts {
        _ if quarantined.is_empty() => false,
        None => quarantined.contains(&docs[unit as usize].id),
        Some(r) => !r.units[unit as usize].iter().any(kept),
    };
    if !quarantined.is_empty() && (0..job.data.stream_len() as u64).all(skip) {
        return None;
    }
    // One pass over the candidates: the selector pulls lazily, and the
    // indices it consumed are kept for phase 2.
    let mut offered = Vec::new();
    let candidates = order
        .candidates(cursor)
        .filter(|c| !skip(c.index))
        .map(|c| {
            offered.push(c.index);
            c.index as usize
        });
    let selection = match rollouts {
        None => plan::select(target, candidates.map(|i| docs[i].tokens())),
        Some(r) => rollouts::select_groups(
            target,
            candidates.map(|i| group_size(r, docs, i, &quarantined)),
        ),
    };
    if selection.taken.is_empty() {
        return None;
    }
    let chosen: Vec<DocHandle> = match rollouts {
        None => selection
            .taken
            .iter()
            .map(|&i| DocHandle::new(docs, offered[i] as usize))
            .collect(),
        Some(r) => selection
            .taken
            .iter()
            .flat_map(|&i| r.units[offered[i] as usize].iter().filter(|d| kept(d)))
            .map(|&d| DocHandle::new(docs, d as usize))
            .collect(),
    };
    Some(Chosen {
        kind: PlanKind::Train,
        step,
        settings,
        lr: job.settings().lr(step, job.rec.total_steps),
        staleness: rollouts.map(|_| staleness(&chosen, step)),
        cursor_after: order.advance_skipping(cursor, &selection, skip),
        docs: chosen,
        replay: false,
    })
}

/// A probe round of bisection `b`: each group one microbatch, laid out
/// by `bisect::slots`, every rank with the same count (padding), the
/// failed step's normalisers; the cursor does not move.
fn probe(job: &Job, b: &Bisection, world_size: u32) -> Result<PlannedStep, PlanFailure> {
    let coupled = job.spec.parallel.sharding == Sharding::Fsdp;
    let slots = bisect::slots(b.groups().len(), world_size, coupled);
    let per_rank = slots.iter().map(|&(_, i)| i + 1).max().unwrap_or(1);
    let notes = job.data.annotations();
    let empty = || payload(std::iter::empty(), notes);
    let mut ranks = vec![vec![empty(); per_rank as usize]; world_size.max(1) as usize];
    let mut docs = Vec::new();
    for (group, &(r, i)) in b.groups().iter().zip(&slots) {
        let members = group
            .iter()
            .map(|id| {
                find_doc(job, id).ok_or(PlanFailure::ProbeDoc {
                    step: b.step,
                    doc: *id,
                })
            })
            .collect::<Result<Vec<DocHandle>, _>>()?;
        docs.extend(group.iter().copied());
        ranks[r as usize][i as usize] = payload(members.iter(), notes);
    }
    Ok(PlannedStep {
        kind: PlanKind::Probe,
        step: b.step,
        lr: 0.0,
        settings: job.settings().at(b.step),
        cursor_after: job.rec.cursor.clone(),
        normalizers: b.normalizers,
        ranks,
        docs,
        staleness: None,
        replay: false,
    })
}

/// A document of the job by id: its files, else its stream's queue.
fn find_doc(job: &Job, id: &DocId) -> Option<DocHandle> {
    if let Some(&i) = job.data.doc_index().get(id) {
        return Some(DocHandle::new(&job.data.docs, i));
    }
    let s = job.data.stream.as_ref()?;
    s.group_tables().find_map(|g| {
        g.iter()
            .position(|d| d.id == *id)
            .map(|i| DocHandle::new(g, i))
    })
}

/// (tokens, rollouts) of group `i`, without its quarantined rollouts.
fn group_size(
    r: &RolloutPlan,
    docs: &[Document],
    i: usize,
    quarantined: &HashSet<DocId>,
) -> (u64, u64) {
    let members = r.units[i]
        .iter()
        .map(|&d| &docs[d as usize])
        .filter(|d| !quarantined.contains(&d.id));
    members.fold((0, 0), |(t, n), d| (t + d.tokens(), n + 1))
}

/// How old the chosen rollouts' policies are at `step`.
fn staleness(chosen: &[DocHandle], step: u64) -> StalenessStats {
    let mut s = StalenessStats::default();
    for d in chosen {
        if let DocBody::Rollout(r) = &d.body {
            s.add(pg::staleness(r.policy_version, step - 1));
        }
    }
    s
}

/// The next training step from the head of a streamed job's queue, once
/// it holds the step's rollouts.
fn stream(job: &Job, world_size: u32) -> Option<Chosen> {
    let s = job.data.stream.as_ref()?;
    let step = job.rec.step + 1;
    let settings = job.settings().at(step);
    if !s.step_ready(job.settings().rollouts_needed(step)) {
        return None;
    }
    let target = StepTarget::new(settings.size, world_size, row_tokens(job, &settings));
    let selection = rollouts::select_groups(
        target,
        s.groups()
            .map(|g| (g.iter().map(Document::tokens).sum(), g.len() as u64)),
    );
    // A quarantined rollout leaves the queue with its group, untrained.
    let chosen: Vec<DocHandle> = s
        .group_tables()
        .take(selection.consumed)
        .flat_map(|g| (0..g.len()).map(move |i| (g, i)))
        .filter(|&(g, i)| !job.rec.quarantined(&g[i].id))
        .map(|(g, i)| DocHandle::new(g, i))
        .collect();
    Some(Chosen {
        kind: PlanKind::Train,
        step,
        settings,
        lr: job.settings().lr(step, job.rec.total_steps),
        staleness: Some(staleness(&chosen, step)),
        cursor_after: Cursor {
            position: s.head() + selection.consumed as u64,
            ..Cursor::default()
        },
        docs: chosen,
        replay: false,
    })
}

/// Committed step `entry.step` again: its documents in manifest order, its
/// learning rate and cursor; the annotations (DPO `ref_logp`, PG
/// `advantage`) come from the same per-document data.
fn replay(job: &Job, entry: &CommittedStep) -> Result<Chosen, PlanFailure> {
    let step = entry.step;
    let index = job.data.doc_index();
    let docs = entry
        .docs
        .iter()
        .map(|id| {
            index
                .get(&id)
                .map(|&i| DocHandle::new(&job.data.docs, i))
                .ok_or(PlanFailure::UnknownDoc { step, doc: id })
        })
        .collect::<Result<Vec<DocHandle>, _>>()?;
    Ok(Chosen {
        kind: PlanKind::Train,
        step,
        settings: job.settings().for_replay(step),
        lr: entry.lr,
        docs,
        cursor_after: entry.cursor_after.clone(),
        staleness: None,
        replay: true,
    })
}

/// The next forward-only chunk of the reference pass: documents missing
/// from the cache, in dataset order, a training step's worth (at least
/// 64) at a time.
fn reference(job: &Job) -> Option<Chosen> {
    let cache = job.data.reference.as_ref()?;
    let settings = job.settings().latest();
    let chunk = match settings.size {
        StepSize::Docs(n) => n.max(64) as usize,
        _ => 64,
    };
    // The eval pairs need reference log-probs too (their rewards).
    let train = &job.data.docs;
    let eval = job.data.eval.as_ref().map(|e| &e.docs);
    let tables = std::iter::once(train).chain(eval);
    let docs: Vec<DocHandle> = tables
        .flat_map(|t| (0..t.len()).map(move |i| (t, i)))
        .filter(|&(t, i)| !cache.logps.contains_key(&t[i].id))
        .take(chunk)
        .map(|(t, i)| DocHandle::new(t, i))
        .collect();
    if docs.is_empty() {
        return None;
    }
    Some(Chosen {
        kind: PlanKind::Reference,
        step: cache.chunks + 1,
        settings,
        lr: 0.0,
        docs,
        cursor_after: Cursor::default(),
        staleness: None,
        replay: false,
    })
}

/// The next chunk of evaluation `run`: eval documents in order, a training
/// step's worth (at least 64) at a time; the cursor does not move.
fn eval(job: &Job, run: &EvalRun) -> Option<Chosen> {
    let set = job.data.eval.as_ref()?;
    let settings = job.settings().latest();
    let chunk = match settings.size {
        StepSize::Docs(n) => n.max(64) as usize,
        _ => 64,
    };
    let end = set.docs.len().min(run.next.saturating_add(chunk));
    let docs: Vec<DocHandle> = (run.next.min(end)..end)
        .map(|i| DocHandle::new(&set.docs, i))
        .collect();
    if docs.is_empty() {
        return None;
    }
    Some(Chosen {
        kind: PlanKind::Eval,
        step: run.step,
        settings,
        lr: 0.0,
        docs,
        cursor_after: job.rec.cursor.clone(),
        staleness: None,
        replay: false,
    })
}

/// Total steps of a job when they can be known up front (for the learning
/// rate schedule and progress), else 0. PG steps take whole groups, so for
/// them this is an upper bound.
pub fn total_steps(spec: &JobSpec, docs: &[Document], rollouts: Option<&RolloutPlan>) -> u64 {
    if let Some(steps) = spec.job.steps {
        return steps;
    }
    let epochs = spec.job.epochs.unwrap_or(1);
    let count = rollouts.map_or(docs.len(), RolloutPlan::rollouts) as u64;
    // A mixture: each source's documents times its own epochs.
    let sources = spec.data.train_sources(spec.job.epochs);
    let file_source = crate::job::sources::file_sources(&sources);
    let epochs_of = |d: &Document| {
        let s = file_source.get(d.id.file as usize).copied().unwrap_or(0) as usize;
        sources.get(s).and_then(|s| s.epochs).unwrap_or(epochs)
    };
    let mixed = rollouts.is_none() && sources.len() > 1;
    match spec.step_size() {
        StepSize::Docs(n) if mixed => docs.iter().map(epochs_of).sum::<u64>().div_ceil(n),
        StepSize::Docs(n) => (epochs * count).div_ceil(n),
        StepSize::Tokens(t) if mixed => {
            let tokens: u64 = docs.iter().map(|d| epochs_of(d) * d.tokens()).sum();
            tokens.div_ceil(t).max(1)
        }
        StepSize::Tokens(t) => {
            let tokens: u64 = docs.iter().map(Document::tokens).sum();
            (epochs * tokens).div_ceil(t).max(1)
        }
        // Depends on how documents pack; not known before planning.
        StepSize::MicrobatchesPerRank(_) => 0,
    }
}

/// Total steps when the settings change from step `from` on: the steps
/// before it plus what the rest of the stream needs at the new size.
/// Unchanged for `job.steps` jobs and when unknown (0).
pub fn estimated_total_steps(job: &Job, from: u64) -> u64 {
    if job.spec.job.steps.is_some() || job.rec.total_steps == 0 {
        return job.rec.total_steps;
    }
    let cursor = match job.inflight() {
        Some(f) if f.planned.kind == PlanKind::Train && f.planned.step + 1 == from => {
            &f.planned.cursor_after
        }
        _ => &job.rec.cursor,
    };
    let settings = job.settings().at(from);
    let order = job.order_at(from);
    let units = order.candidates(cursor).map(|c| c.index as usize);
    let docs = &job.data.docs;
    let (remaining, per_step) = match settings.size {
        StepSize::Docs(n) => {
            let rem: u64 = match &job.data.rollouts {
                Some(r) => units.map(|u| r.units[u].len() as u64).sum(),
                None => units.count() as u64,
            };
            (rem, n)
        }
        StepSize::Tokens(t) => {
            let tokens = |i: usize| docs[i].tokens();
            let rem: u64 = match &job.data.rollouts {
                Some(r) => units
                    .flat_map(|u| r.units[u].iter())
                    .map(|&d| tokens(d as usize))
                    .sum(),
                None => units.map(tokens).sum(),
            };
            (rem, t)
        }
        StepSize::MicrobatchesPerRank(_) => return job.rec.total_steps,
    };
    (from - 1) + remaining.div_ceil(per_step.max(1))
}
