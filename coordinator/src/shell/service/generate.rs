//! The RL loop at the edge: `GeneratePlan` out, `GenerateResult` in (wire
//! ↔ domain), and scoring a generated round off the state lock: the core
//! asks (`Effect::ScoreRound`), a thread decodes and verifies with the
//! job's [`Scorer`], and the answer comes back as an event; stepping a
//! multi-turn round's environments alike.

use std::sync::Arc;

use accrue_proto::{pack_u32, unpack_f32, unpack_u16, unpack_u32, v1 as wire};
use tonic::Status;
use tracing::{error, info};

use super::shared::Shared;
use crate::core::Event;
use crate::rl::episode::EpisodesToStep;
use crate::rl::generation::{Finish, GenCompletion};
use crate::rl::rounds::{RoundPlan, RoundToScore};
use crate::rl::scorer::Scorer;
use crate::stream::doc::DocId;

/// Rank `rank`'s part of a round.
pub fn generate_plan(job: &str, generation: u64, rank: u32, p: &RoundPlan) -> wire::GeneratePlan {
    let s = &p.sampling;
    wire::GeneratePlan {
        job_id: job.to_string(),
        generation,
        round: p.round,
        rank,
        policy_version: p.policy_version,
        sampling: Some(wire::SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            max_new_tokens: s.max_new_tokens,
            stop_ids: p.stop_ids.to_vec(),
            stop_sequences: p.stop_sequences.iter().map(|q| pack_u32(q)).collect(),
            max_batch: s.max_batch,
            record_routing: p.record_routing,
        }),
        requests: p
            .requests
            .iter()
            .map(|q| wire::GenerateRequest {
                prompt_id: q.prompt.to_string(),
                sample: q.sample,
                prompt_ids: pack_u32(&q.prompt_ids),
                seed: q.seed,
            })
            .collect(),
    }
}

/// A worker's `GenerateResult` as an event; malformed fields are named.
pub fn generate_result(worker: &str, g: wire::GenerateResult) -> Result<Event, Status> {
    if !(g.seconds.is_finite() && g.seconds >= 0.0) {
        return Err(Status::invalid_argument(format!(
            "generate_result.seconds: must be a finite number ≥ 0, got {}",
            g.seconds
        )));
    }
    let completions = g
        .completions
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let bad = |field: &str, e: String| {
                Status::invalid_argument(format!("generate_result.completions[{i}].{field}: {e}"))
            };
            let prompt = c
                .prompt_id
                .parse::<DocId>()
                .map_err(|e| bad("prompt_id", e))?;
            let token_ids =
                unpack_u32(&c.token_ids).map_err(|e| bad("token_ids", e.to_string()))?;
            let logprobs = unpack_f32(&c.logprobs).map_err(|e| bad("logprobs", e.to_string()))?;
            if let Some(j) = logprobs.iter().position(|x| !x.is_finite()) {
                return Err(bad("logprobs", format!("[{j}] is not finite")));
            }
            let routing = unpack_u16(&c.routing).map_err(|e| bad("routing", e.to_string()))?;
            let finish = match wire::FinishReason::try_from(c.finish) {
                Ok(wire::FinishReason::Stop) => Finish::Stop,
                Ok(wire::FinishReason::Length) => Finish::Length,
                _ => {
                    return Err(bad(
                        "finish",
                        format!("expected STOP or LENGTH, got {}", c.finish),
                    ))
                }
            };
            Ok(GenCompletion {
                prompt,
                sample: c.sample,
                token_ids,
                logprobs,
                finish,
                routing,
                trace: None,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    Ok(Event::GenerateResult {
        worker: worker.to_string(),
        job: g.job_id,
        generation: g.generation,
        round: g.round,
        completions,
        seconds: g.seconds,
    })
}

impl Shared {
    /// Keeps a generating job's scorer (at submit and restore).
    pub fn install_scorer(&self, job: &str, scorer: Arc<Scorer>) {
        self.scorers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.to_string(), scorer);
    }

    /// Scores `round` on its own thread, then tells the core.
    pub(super) fn score_round(&self, round: RoundToScore) {
        let scorer = self
            .scorers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&round.job)
            .cloned();
        let me = self.me.clone();
        std::thread::spawn(move || {
            let event = match scorer {
                None => Event::RoundFailed {
                    job: round.job.clone(),
                    round: round.round,
                    error: "the job's prompts and verifier could not be loaded (see the coordinator log)".into(),
                },
                Some(s) => match s.score(&round) {
                    Ok((rollouts, stats)) => {
                        info!(job = %round.job, round = round.round, rollouts = rollouts.len(), reward_mean = stats.reward_sum / (stats.completions.max(1) as f64), "round scored");
                        Event::RoundScored {
                            job: round.job.clone(),
                            round: round.round,
                            rollouts,
                            stats,
                        }
                    }
                    Err(e) => Event::RoundFailed {
                        job: round.job.clone(),
                        round: round.round,
                        error: e.to_string(),
                    },
                },
            };
            if let Some(shared) = me.upgrade() {
                if let Err(status) = shared.apply(event) {
                    error!(job = %round.job, round = round.round, %status, "admitting a scored round failed");
                }
            }
        });
    }

    /// Steps the environments of a multi-turn round's episodes on a
    /// thread of their own, telling the core as they answer.
    pub(super) fn step_episodes(&self, step: EpisodesToStep) {
        let scorer = self
            .scorers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&step.job)
            .cloned();
        let me = self.me.clone();
        std::thread::spawn(move || {
            let tell = |result| {
                let event = Event::EpisodesStepped {
                    job: step.job.clone(),
                    round: step.round,
                    result,
                };
                if let Some(shared) = me.upgrade() {
                    if let Err(status) = shared.apply(event) {
                        error!(job = %step.job, round = step.round, %status, "taking an environment's replies failed");
                    }
                }
            };
            // A panic (a bug) is reported as the environment's failure:
            // while episodes step no wave is out, so no deadline would end
            // the wait.
            let stepped = match scorer {
                None => Err("the job's prompts and environment could not be loaded (see the coordinator log)".into()),
                Some(s) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    s.step_each(&step, |replies| tell(Ok(replies)))
                        .map_err(|e| e.to_string())
                }))
                .unwrap_or_else(|_| Err("stepping the environments panicked (see the coordinator log)".into())),
            };
            if let Err(e) = stepped {
                tell(Err(e));
            }
        });
    }
}
