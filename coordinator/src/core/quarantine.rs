//! Poison documents (issue 14): a non-finite step under
//! `faults.on_nonfinite = "bisect"` ends its generation, probe plans
//! narrow its documents down (`super::bisect`), the culprits are
//! quarantined in the job's record and the step is planned again without
//! them. Operators list and release quarantined documents.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::bisect::{self, Bisection, Next};
use super::ctx::JobCtx;
use super::effects::Persist;
use super::error::{CoreError, Result};
use super::phase::InFlight;
use super::types::{AbortReason, End, EventKind, PlanKind, Quarantined, Why};
use crate::job::faults::OnNonFinite;
use crate::job::parallel::Sharding;
use crate::stream::doc::DocId;

impl JobCtx<'_> {
    /// Whether a non-finite `step` of the job is bisected rather than
    /// failing it: the spec asks for it and `step` is the training step
    /// in flight (not a replay, not a probe or reference plan).
    pub(crate) fn bisects(&self, step: u64) -> bool {
        let Some(job) = Some(&*self.job) else {
            return false;
        };
        job.spec.faults.on_nonfinite == OnNonFinite::Bisect
            && job.inflight().is_some_and(|f| {
                f.planned.kind == PlanKind::Train && !f.planned.replay && f.planned.step == step
            })
    }

    /// The training step in flight was non-finite: its documents, as its
    /// microbatches grouped them, become the first probe round, and the
    /// generation ends (its members' collectives may be mid-way).
    pub(crate) fn start_bisection(&mut self, worker: &str, message: &str) {
        let job = &mut *self.job;
        let planned = job
            .inflight()
            .expect("bisecting the step in flight")
            .planned
            .clone();
        let groups: Vec<Vec<DocId>> = planned
            .ranks
            .iter()
            .flatten()
            .map(|mb| {
                let mut seen = BTreeSet::new();
                // A DPO pair is two sequences of one document.
                mb.seqs
                    .iter()
                    .map(|s| s.doc)
                    .filter(|d| seen.insert(*d))
                    .collect()
            })
            .collect();
        let detail = format!("worker {worker}: {message}");
        let b = Bisection::new(planned.step, groups, planned.normalizers, detail.clone());
        let (docs, groups) = (planned.docs.len(), b.groups().len());
        warn!(
            job = %self.id,
            step = planned.step,
            docs,
            "non-finite step: bisecting its documents"
        );
        job.faults.bisection = Some(b);
        let msg = format!(
            "step {} was non-finite ({detail}); bisecting its {docs} documents, starting from its {groups} microbatches",
            planned.step
        );
        self.fx
            .push(job.event(EventKind::Quarantine, msg, self.now));
        let why = Why::new(
            AbortReason::NonFinite,
            format!("step {} non-finite; bisecting its documents", planned.step),
        );
        self.end_generation(why, false);
    }

    /// Every rank answered a probe: its verdict narrows the bisection,
    /// which probes again, quarantines what it found, or fails the job.
    pub(crate) fn probed(&mut self, flight: InFlight) {
        let job = &mut *self.job;
        let world = flight.planned.ranks.len() as u32;
        let coupled = job.spec.parallel.sharding == Sharding::Fsdp;
        let max_rounds = job.spec.faults.max_bisect_rounds;
        let Some(b) = job.faults.bisection.as_mut() else {
            return;
        };
        let slots = bisect::slots(b.groups().len(), world, coupled);
        let bad = bisect::verdict(&slots, &flight.nonfinite);
        let suspects: usize = b
            .groups()
            .iter()
            .zip(&bad)
            .filter(|(_, &bad)| bad)
            .map(|(g, _)| g.len())
            .sum();
        let (step, round) = (b.step, b.rounds + 1);
        let detail = b.detail.clone();
        match b.observe(&bad, max_rounds) {
            Next::Probe => {
                let msg = format!(
                    "bisecting step {step}: probe round {round} left {suspects} suspect documents"
                );
                self.fx
                    .push(job.event(EventKind::Quarantine, msg, self.now));
            }
            Next::Found(docs) => {
                job.faults.bisection = None;
                for doc in &docs {
                    warn!(job = %self.id, step, %doc, "document quarantined");
                    job.rec.quarantine.push(Quarantined {
                        doc: *doc,
                        step,
                        detail: detail.clone(),
                        unix_ms: self.now,
                    });
                }
                self.fx.persist(Persist::Job(Box::new(job.rec.clone())));
                for doc in &docs {
                    let msg = format!(
                        "document {doc} quarantined: step {step} is non-finite with it alone (found in {round} probe rounds)"
                    );
                    self.fx
                        .push(job.event(EventKind::Quarantine, msg, self.now));
                }
                info!(
                    job = %self.id,
                    step, "step re-planned without its quarantined documents"
                );
                self.at_boundary();
            }
            Next::NotReproduced => {
                job.faults.bisection = None;
                let why = Why::new(
                    AbortReason::NonFinite,
                    format!(
                        "step {step} was non-finite ({detail}), but none of its microbatches or documents is on its own; no document to quarantine"
                    ),
                );
                self.finish(End::Failed(why));
            }
            Next::OutOfRounds(suspects) => {
                job.faults.bisection = None;
                let list: Vec<String> = suspects.iter().take(10).map(ToString::to_string).collect();
                let why = Why::new(
                    AbortReason::NonFinite,
                    format!(
                        "step {step} was non-finite ({detail}); bisection stopped after {round} rounds (faults.max_bisect_rounds) with {} suspect documents: {}{}",
                        suspects.len(),
                        list.join(", "),
                        if suspects.len() > 10 { ", ..." } else { "" }
                    ),
                );
                self.finish(End::Failed(why));
            }
        }
    }

    /// Returns quarantined documents to the job (`None`: all of them). The
    /// stream trains each when it next reaches it. Unknown ids are an
    /// error and release nothing.
    pub(crate) fn release_quarantine(
        &mut self,
        docs: Option<&[DocId]>,
    ) -> Result<Vec<Quarantined>> {
        let job = &mut *self.job;
        if let Some(docs) = docs {
            if let Some(d) = docs.iter().find(|d| !job.rec.quarantined(d)) {
                return Err(CoreError::NotQuarantined {
                    job: self.id.clone(),
                    doc: *d,
                });
            }
        }
        let (released, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut job.rec.quarantine)
            .into_iter()
            .partition(|q| docs.is_none_or(|d| d.contains(&q.doc)));
        job.rec.quarantine = kept;
        if released.is_empty() {
            return Ok(released);
        }
        self.fx.persist(Persist::Job(Box::new(job.rec.clone())));
        let names: Vec<String> = released.iter().map(|q| q.doc.to_string()).collect();
        let msg = format!("released from quarantine: {}", names.join(", "));
        self.fx
            .push(job.event(EventKind::Quarantine, msg, self.now));
        Ok(released)
    }
}
