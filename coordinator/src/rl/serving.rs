//! The core's handlers of a served job's endpoint calls (`[rl.serve]`;
//! the queue is `super::serve`): a call is queued, and a round of the
//! waiting calls goes to the job's training workers whenever they are
//! idle and no step is due; its answers go back to the shell.

use tracing::info;

use super::rounds::Round;
use super::serve::ServeRequest;
use crate::core::ctx::JobCtx;
use crate::core::effects::Effect;
use crate::core::error::{CoreError, Result};

impl JobCtx<'_> {
    /// Queues a call to the job's endpoint.
    pub(crate) fn serve(&mut self, request: ServeRequest) -> Result<()> {
        let job = &mut *self.job;
        if job.rec.state.is_terminal() {
            return Err(CoreError::bad_state(
                self.id.as_str(),
                job.rec.state,
                "serving a chat completion",
            ));
        }
        let Some(q) = job.data.serve.as_mut() else {
            return Err(CoreError::NotServed(self.id.clone()));
        };
        q.push(request).map_err(|full| CoreError::ServeFull {
            job: self.id.clone(),
            full,
        })
    }

    /// Sends a round of the waiting calls to the idle generation; false
    /// when none wait (or the job serves none).
    pub(crate) fn plan_serve_round(&mut self) -> bool {
        let job = &mut *self.job;
        let Some(gen) = job.gen() else {
            return false;
        };
        let (gen_id, world) = (gen.id, gen.world_size());
        let step = job.rec.step;
        let Some(q) = job.data.serve.as_mut() else {
            return false;
        };
        let Some((round, plans)) = q.plan(world, gen_id, step, self.now) else {
            return false;
        };
        let calls: usize = plans.iter().map(|p| p.requests.len()).sum();
        info!(job = %self.id, round = round.id, calls, policy = step, "serving chat completions");
        self.send_round(round, plans);
        self.job.rec.reason = format!("serving {calls} chat completions");
        true
    }

    /// Every rank answered a serve round: its calls go to their callers.
    pub(crate) fn serve_round_answered(&mut self, r: Round) {
        let Some(q) = self.job.data.serve.as_mut() else {
            return;
        };
        let served = q.answered(r);
        self.job.rec.reason.clear();
        self.fx.push(Effect::Served {
            job: self.id.clone(),
            served,
        });
    }
}
