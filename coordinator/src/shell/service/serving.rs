//! The shell's side of a served job's endpoint (`[rl.serve]`): each job's
//! [`Endpoint`] (tokenizer, template, episodes), and the calls waiting
//! for their generation. A call is queued in the core (`Event::Serve`)
//! and answered when the core hands out its round (`Effect::Served`); a
//! caller that goes away cancels it; a job that ends drops its waiting
//! calls (their callers get an error, never a hang).

use std::sync::Arc;

use super::shared::{handle_timed, Shared};
use crate::core::{CoreError, Event};
use crate::rl::endpoint::chat::ApiError;
use crate::rl::endpoint::{Endpoint, Report, Turn};
use crate::rl::serve::{ServeRequest, Served};

/// Cancels a call whose caller went away before its answer.
struct Pending<'a> {
    shared: &'a Shared,
    job: &'a str,
    id: u64,
    endpoint: &'a Endpoint,
    turn: Option<&'a Turn>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(turn) = self.turn else {
            return;
        };
        self.shared.calls.forget(self.id);
        self.endpoint.abandon(turn);
        let event = Event::ServeCancel {
            job: self.job.to_string(),
            id: self.id,
        };
        // The job may be gone: nothing to cancel then.
        let _ = self.shared.apply(event);
    }
}

impl Shared {
    /// Keeps a served job's endpoint (at submit and restore).
    pub fn install_endpoint(&self, job: &str, endpoint: Arc<Endpoint>) {
        self.endpoints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.to_string(), endpoint);
    }

    /// A served job's endpoint, while the job lives.
    pub fn endpoint(&self, job: &str) -> Option<Arc<Endpoint>> {
        self.endpoints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
            .cloned()
    }

    /// An ended job's endpoint goes, and its waiting calls with it.
    pub(super) fn drop_endpoint(&self, job: &str) {
        self.endpoints
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(job);
        self.calls.drop_job(job);
    }

    /// Hands generated calls to their callers (`Effect::Served`).
    pub(super) fn deliver(&self, served: Vec<Served>) {
        self.calls.deliver(served);
    }

    /// One chat-completion call of `job`: queued, generated between
    /// steps, recorded in its episode; the response body.
    pub async fn chat_completion(
        &self,
        job: &str,
        body: &serde_json::Value,
        episode: Option<String>,
    ) -> Result<serde_json::Value, ApiError> {
        let endpoint = self.endpoint(job).ok_or_else(|| no_endpoint(job))?;
        let turn = endpoint.begin(body, episode)?;
        let (id, rx) = self.calls.open(job);
        let mut pending = Pending {
            shared: self,
            job,
            id,
            endpoint: &endpoint,
            turn: Some(&turn),
        };
        let request = ServeRequest {
            id,
            prompt_ids: turn.prompt_ids.clone().into(),
            seed: turn.seed.unwrap_or_else(rand::random),
            sampling: Arc::new(turn.sampling.clone()),
            stop_ids: turn.stop_ids.clone().into(),
        };
        let event = Event::Serve {
            job: job.to_string(),
            request,
        };
        {
            let mut inner = self.lock();
            let (effects, timing) = handle_timed(&mut inner, event).map_err(|e| match e {
                CoreError::ServeFull { .. } => ApiError::status(429, e.to_string()),
                CoreError::JobNotFound(_) => ApiError::status(404, e.to_string()),
                _ => ApiError::status(409, e.to_string()),
            })?;
            self.run_effects(&mut inner, effects, timing)
                .map_err(|s| ApiError::status(500, s.message().to_string()))?;
        }
        let served = rx.await.map_err(|_| {
            ApiError::status(
                409,
                format!("job {job} ended before the call was generated"),
            )
        })?;
        pending.turn = None;
        drop(pending);
        let created = (super::shared::now_ms() / 1000).max(0) as u64;
        endpoint.finish(turn, &served, created)
    }

    /// An episode's reward: its rollout admitted into the job's stream
    /// (waiting for queue room like a push), once; a repeated report gets
    /// the first answer.
    pub async fn report_episode(
        &self,
        job: &str,
        episode: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let endpoint = self.endpoint(job).ok_or_else(|| no_endpoint(job))?;
        let report = Report::parse(body)?;
        let (rollout, stats) = match endpoint.report(episode, &report)? {
            Ok(taken) => taken,
            Err(mut first) => {
                first["repeated"] = true.into();
                return Ok(first);
            }
        };
        // A reporter that goes away while the queue is full leaves the
        // episode reportable again.
        struct Unreport<'a>(&'a Endpoint, &'a str, bool);
        impl Drop for Unreport<'_> {
            fn drop(&mut self) {
                if self.2 {
                    self.0.unreport(self.1);
                }
            }
        }
        let mut guard = Unreport(&endpoint, episode, true);
        let counts = self.push_rollouts(job, vec![rollout]).await.map_err(|s| {
            let status = match s.code() {
                tonic::Code::InvalidArgument => 400,
                tonic::Code::NotFound => 404,
                _ => 409,
            };
            ApiError::status(status, format!("episode {episode}: {}", s.message()))
        })?;
        guard.2 = false;
        let answer = serde_json::json!({
            "episode": episode,
            "accepted": counts.accepted,
            "rejected_stale": counts.rejected_stale,
            "zero_variance_dropped": counts.zero_variance_dropped,
            "queued": counts.queued,
            "turns": stats.turns,
            "tool_calls": stats.tool_calls,
            "tokens": stats.tokens,
            "policy_tokens": stats.policy_tokens,
        });
        endpoint.reported(episode, answer.clone());
        Ok(answer)
    }
}

fn no_endpoint(job: &str) -> ApiError {
    ApiError::status(
        404,
        format!("job {job} has no endpoint here: unknown, ended, or its spec has no [rl.serve]"),
    )
}
