//! The core's side of a streamed job's rollout queue: pushes admitted
//! against the live settings, the stored queue taken back after a restore.

use crate::core::ctx::JobCtx;
use crate::core::effects::Persist;
use crate::core::error::{CoreError, Result};
use crate::rl::stream::{Admission, StoredStream};
use crate::stream::doc::Rollout;

impl JobCtx<'_> {
    /// A streamed job's stored queue, read back after its restore.
    pub(crate) fn restore_rollouts(&mut self, stored: StoredStream) {
        let j = &mut *self.job;
        let cursor = j.rec.cursor.position;
        let pg = j.spec.objective.pg();
        if let (Some(s), Some(plan), Some(pg)) =
            (j.data.stream.as_mut(), j.data.rollouts.as_mut(), pg)
        {
            s.restore(plan, &pg, &self.id, cursor, stored);
        }
    }

    /// Admits rollouts pushed to a streamed job (see `crate::rl::stream`).
    pub(crate) fn push_rollouts(&mut self, batch: Vec<Rollout>) -> Result<()> {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(
                self.id.as_str(),
                job.rec.state,
                "pushing rollouts",
            ));
        }
        let next = job.rec.step + 1;
        let limit = job
            .spec
            .parallel
            .row_budget(job.settings().at(next).max_tokens);
        // Against the live limit (`accrue set --max-tokens`), not the
        // submitted one: the next plan packs with it.
        if let Some((index, tokens)) = batch
            .iter()
            .map(|r| r.seq.len() as u64)
            .enumerate()
            .find(|&(_, t)| t > u64::from(limit.tokens()))
        {
            return Err(CoreError::RolloutTooLong {
                job: self.id.clone(),
                index,
                tokens,
                limit,
            });
        }
        let need = job.settings().rollouts_needed(next);
        let (step, max_staleness) = (job.rec.step, job.spec.rl.max_staleness);
        let pg = job.spec.objective.pg();
        let (Some(s), Some(plan), Some(pg)) =
            (job.data.stream.as_mut(), job.data.rollouts.as_mut(), pg)
        else {
            return Err(CoreError::NotStreamed(self.id.clone()));
        };
        let at = Admission {
            job: self.id.as_str(),
            pg: &pg,
            step,
            max_staleness,
            need,
        };
        self.fx.persist(Persist::Rollouts(Box::new(
            s.push(plan, at, batch).map_err(|f| CoreError::QueueFull {
                job: self.id.clone(),
                buffered: f.buffered,
                capacity: f.capacity,
            })?,
        )));
        Ok(())
    }
}
