//! Planning a job's next step while its current one runs (issue 19: the
//! gap between steps). Between the last result of step N and the plans of
//! N+1 every worker idles; planning N+1 there cost ~8 ms at W = 1024. Once
//! N's plans are out the coordinator plans N+1 from N's `cursor_after`, as
//! dispatch would once N commits (`planner::plan_ahead`), and keeps it with
//! the [`Origin`] it was planned from; dispatch takes it only if the job is
//! then exactly there (`planner::take_ahead`), else plans again. So a step
//! planned ahead is the step planned at dispatch: debug builds plan it
//! again and compare (every scenario test that trains checks it).

use crate::job::settings::ConfigChange;
use crate::stream::cursor::Cursor;

use super::step::PlannedStep;
use super::types::Quarantined;

/// A step planned ahead, and where it was planned from.
#[derive(Debug, Clone)]
pub struct Ahead {
    origin: Origin,
    planned: PlannedStep,
}

/// Everything planning from a job's files reads that can change while a
/// step runs (the dataset, its order and the spec cannot).
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    pub generation: u64,
    pub world_size: u32,
    /// The committed step the plan follows, and the cursor after it.
    pub step: u64,
    pub cursor: Cursor,
    pub changes: Vec<ConfigChange>,
    pub quarantine: Vec<Quarantined>,
    pub total_steps: u64,
}

impl Ahead {
    pub fn new(origin: Origin, planned: PlannedStep) -> Self {
        Ahead { origin, planned }
    }

    /// The step planned.
    pub fn planned(&self) -> &PlannedStep {
        &self.planned
    }

    /// Whether it was planned to follow `in_flight` of `generation`.
    pub fn follows(&self, in_flight: &PlannedStep, generation: u64) -> bool {
        self.origin.generation == generation
            && self.origin.step == in_flight.step
            && self.origin.cursor == in_flight.cursor_after
    }

    /// The step planned, if it was planned from `now`.
    pub fn take_if_from(self, now: &Origin) -> Option<PlannedStep> {
        (self.origin == *now).then_some(self.planned)
    }
}
