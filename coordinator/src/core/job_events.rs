//! One job's events, each to its handler on the job's [`JobCtx`]: the
//! workers' messages, the operator's requests, and the shell's answers to
//! the effects it carried out.

use super::ctx::JobCtx;
use super::error::Result;
use super::events::{Event, RankResult};
use super::types::AbortReason;

impl JobCtx<'_> {
    /// Applies `event` (about this job) to it.
    pub(crate) fn apply(&mut self, event: Event) -> Result<()> {
        match event {
            Event::Ready {
                worker,
                generation,
                step,
                ..
            } => self.on_ready(&worker, generation, step),
            Event::StepResult {
                worker,
                generation,
                step,
                sums,
                logps,
                nonfinite,
                ..
            } => {
                self.note_result(&worker, generation, step);
                let result = RankResult {
                    sums,
                    logps,
                    nonfinite,
                };
                self.on_result(&worker, generation, step, result);
            }
            Event::StepResults {
                worker,
                generation,
                step,
                results,
                ..
            } => self.on_gathered(&worker, generation, step, results),
            Event::WorkerError {
                worker,
                generation,
                step,
                kind,
                message,
                ..
            } => self.on_worker_error(&worker, generation, step, kind, message),
            Event::CheckpointDone { worker, step, .. } => self.on_checkpoint_done(&worker, step),
            Event::PolicyPublished {
                worker,
                generation,
                step,
                ..
            } => self.on_policy_published(&worker, generation, step),
            Event::HistoryLoaded { from, steps, .. } => self.history_loaded(from, steps),
            Event::CancelJob { .. } => self.cancel()?,
            Event::PauseJob { .. } => self.pause()?,
            Event::ResumeJob { .. } => self.resume()?,
            Event::TriggerCheckpoint { .. } => self.trigger_checkpoint()?,
            Event::UpdateJob { update, .. } => self.update_job(update)?,
            Event::ReleaseQuarantine { docs, .. } => {
                self.release_quarantine(docs.as_deref())?;
            }
            Event::PushRollouts { rollouts, .. } => self.push_rollouts(rollouts)?,
            Event::Serve { request, .. } => self.serve(request)?,
            Event::ServeCancel { id, .. } => {
                if let Some(q) = self.job.data.serve.as_mut() {
                    q.cancel(id);
                }
            }
            Event::TokenizerWritten { step, .. } => {
                self.on_checkpoint_done(super::job::TOKENIZER_FILES, step)
            }
            Event::OutputFailed { what, .. } => {
                if !self.job.rec.state.is_terminal() {
                    let detail = format!("writing the job's output failed: {what}");
                    self.fail(AbortReason::OutputFailed, detail);
                }
            }
            Event::RestoreRollouts { stored, .. } => self.restore_rollouts(stored),
            Event::LoadPrompts { inputs, .. } => self.load_prompts(inputs)?,
            Event::GenerateResult {
                worker,
                generation,
                round,
                completions,
                seconds,
                ..
            } => self.on_generated(&worker, generation, round, (completions, seconds)),
            Event::RoundScored {
                round,
                rollouts,
                stats,
                ..
            } => self.on_scored(round, rollouts, stats)?,
            Event::RoundFailed { round, error, .. } => self.on_score_failed(round, error),
            Event::EpisodesStepped { round, result, .. } => self.on_episodes_stepped(round, result),
            Event::EngineGenerated { round, result, .. } => self.on_engine_generated(round, result),
            Event::WeightsSynced {
                worker,
                generation,
                version,
                bytes,
                seconds,
                ..
            } => self.on_weights_synced(&worker, generation, version, (bytes, seconds)),
            Event::EngineReloaded { step, result, .. } => self.on_engine_reloaded(step, result),
            // Not one job's: the coordinator handles them.
            Event::Heartbeats { .. }
            | Event::PlanAhead { .. }
            | Event::RegisterWorker { .. }
            | Event::SessionOpened { .. }
            | Event::SessionClosed { .. }
            | Event::Heartbeat { .. }
            | Event::SubmitJob { .. }
            | Event::RestoreJob { .. }
            | Event::DrainWorker { .. }
            | Event::Tick { .. }
            | Event::PersistFailed { .. } => {}
        }
        Ok(())
    }
}
