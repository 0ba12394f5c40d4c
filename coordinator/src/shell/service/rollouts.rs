//! `accrue.v1.Rollouts`: rollouts streamed in by an external generator.
//! Each message is decoded into JSON rows and checked by the same code as
//! file rollouts (`data::rollout`), so errors read the same; a message is
//! admitted whole by the core (`Event::PushRollouts`) and acknowledged only
//! after its store write. When the job's queue is full the core refuses the
//! push unchanged (`QueueFull`) and this adapter waits on a `watch` channel
//! that the shell bumps when a commit frees room or a job changes state,
//! then retries: the stream is not read meanwhile, which is the
//! backpressure a client sees (HTTP/2 flow control).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use accrue_proto::v1 as wire;
use accrue_proto::v1::rollouts_server::Rollouts;
use serde_json::{json, Map, Value as Json};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, instrument};

use super::push_room::Waiting;
use super::shared::{core_status, handle_timed, Shared};
use crate::core::{CoreError, Event, Persist};
use crate::job::data::{DataSection, OnBad};
use crate::job::model::ModelSection;
use crate::job::parallel::RowBudget;
use crate::rl::stream::AdmitCounts;
use crate::stream::data::Encoder;
use crate::stream::doc::Rollout;

impl Shared {
    /// Pushes waiting for room in a rollout queue right now (observability
    /// and tests).
    pub fn rollout_waiters(&self) -> usize {
        self.rollouts.waiting.load(Ordering::SeqCst)
    }

    /// Admits one batch into `job`'s queue, waiting while it is full;
    /// returns after the batch is persisted.
    pub(super) async fn push_rollouts(
        &self,
        job: &str,
        batch: Vec<Rollout>,
    ) -> Result<AdmitCounts, Status> {
        loop {
            let mut room = {
                let mut inner = self.lock();
                let event = Event::PushRollouts {
                    job: job.to_string(),
                    rollouts: batch.clone(),
                };
                match handle_timed(&mut inner, event) {
                    Ok((effects, timing)) => {
                        let counts = effects.persists().iter().find_map(|p| match p {
                            Persist::Rollouts(w) if w.job == job => w.counts,
                            _ => None,
                        });
                        self.run_effects(&mut inner, effects, timing)?;
                        return Ok(counts.unwrap_or_default());
                    }
                    // Subscribed under the lock: no wake-up is missed.
                    Err(CoreError::QueueFull { .. }) => self.rollouts.space.subscribe(),
                    Err(e) => return Err(core_status(e)),
                }
            };
            debug!(job, "rollout queue full, waiting");
            let _w = Waiting::new(&self.rollouts.waiting);
            room.changed()
                .await
                .map_err(|_| Status::unavailable("coordinator shutting down"))?;
        }
    }
}

pub struct RolloutsService {
    shared: Arc<Shared>,
}

impl RolloutsService {
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The data and model sections of a job that takes streamed rollouts
    /// (pushed ids are bounded by the model's vocabulary, as file rows
    /// are), and the row its next step plans with (the live
    /// setting: `accrue set --max-tokens` may have changed the spec's).
    fn sections(&self, job: &str) -> Result<(DataSection, ModelSection, RowBudget), Status> {
        let inner = self.shared.lock();
        let j = inner.core.job(job).map_err(core_status)?;
        if j.data.stream.is_none() {
            return Err(core_status(CoreError::NotStreamed(job.to_string())));
        }
        let limit = j
            .spec
            .parallel
            .row_budget(j.settings().at(j.rec.step + 1).max_tokens);
        Ok((j.spec.data.clone(), j.spec.model.clone(), limit))
    }
}

/// A wire rollout as the JSON row a rollouts file would hold.
fn json_row(r: &wire::StreamedRollout) -> Json {
    let mut o = Map::new();
    if r.prompt_ids.is_empty() {
        o.insert("prompt".into(), json!(r.prompt));
    } else {
        o.insert("prompt_ids".into(), json!(r.prompt_ids));
    }
    if r.completion_ids.is_empty() {
        o.insert("completion".into(), json!(r.completion));
    } else {
        o.insert("completion_ids".into(), json!(r.completion_ids));
    }
    // A non-finite reward becomes null, which the row check names.
    o.insert("reward".into(), json!(r.reward));
    if !r.group.is_empty() {
        o.insert("group".into(), json!(r.group));
    }
    o.insert("policy_version".into(), json!(r.policy_version));
    if !r.old_logprobs.is_empty() {
        let lps: Vec<Json> = r.old_logprobs.iter().map(|&x| json!(x)).collect();
        o.insert("old_logprobs".into(), Json::Array(lps));
    }
    Json::Object(o)
}

/// Checks every rollout of message `index`; the first problem names
/// `messages[index].rollouts[i]` and the field.
fn decode_message(
    enc: &Encoder,
    limit: RowBudget,
    index: u64,
    rollouts: &[wire::StreamedRollout],
) -> Result<Vec<Rollout>, String> {
    rollouts
        .iter()
        .enumerate()
        .map(|(i, r)| {
            crate::stream::data::rollout::checked_rollout(enc, limit, &json_row(r))
                .map_err(|e| format!("messages[{index}].rollouts[{i}]: {e}"))
        })
        .collect()
}

fn response(messages: u64, invalid: u64, c: &AdmitCounts) -> wire::PushRolloutsResponse {
    wire::PushRolloutsResponse {
        messages,
        accepted: c.accepted,
        rejected_stale: c.rejected_stale,
        zero_variance_dropped: c.zero_variance_dropped,
        zero_variance_groups: c.zero_variance_groups,
        invalid,
        queued: c.queued,
    }
}

#[tonic::async_trait]
impl Rollouts for RolloutsService {
    #[instrument(skip_all, fields(job = tracing::field::Empty))]
    async fn push_rollouts(
        &self,
        req: Request<Streaming<wire::PushRolloutsRequest>>,
    ) -> Result<Response<wire::PushRolloutsResponse>, Status> {
        let mut stream = req.into_inner();
        let first = stream.message().await?.ok_or_else(|| {
            Status::invalid_argument("messages[0].job_id: the stream is empty; name the job")
        })?;
        if first.job_id.is_empty() {
            return Err(Status::invalid_argument(
                "messages[0].job_id: the first message must name the job",
            ));
        }
        let job = first.job_id.clone();
        tracing::Span::current().record("job", job.as_str());
        let (data, model, limit) = self.sections(&job)?;
        let skip_bad = data.on_bad_line == OnBad::Skip || data.on_overlong == OnBad::Skip;
        // Pushed ids are bounded by the model's vocabulary, as file rows are.
        let enc = tokio::task::spawn_blocking(move || {
            let vocab = crate::model::config::read_config(&model)
                .map_err(|e| format!("model: {e}"))?
                .vocab_size;
            crate::stream::data::encoder(&data, vocab).map_err(|e| format!("tokenizer: {e}"))
        })
        .await
        .map_err(|e| Status::internal(format!("tokenizer task: {e}")))?
        .map_err(|e| Status::failed_precondition(format!("job {job}: {e}")))?;
        let enc = Arc::new(enc);
        let (mut total, mut messages, mut invalid) = (AdmitCounts::default(), 0u64, 0u64);
        let mut next = Some(first);
        while let Some(msg) = next {
            let index = messages;
            if !msg.job_id.is_empty() && msg.job_id != job {
                return Err(Status::invalid_argument(format!(
                    "messages[{index}].job_id: {} differs from the first message's {job}",
                    msg.job_id
                )));
            }
            let n = msg.rollouts.len() as u64;
            // Tokenizing is CPU work: keep it off the async runtime.
            let e = enc.clone();
            let decoded = tokio::task::spawn_blocking(move || {
                decode_message(&e, limit, index, &msg.rollouts)
            })
            .await
            .map_err(|e| Status::internal(format!("decoding task: {e}")))?;
            match decoded {
                Ok(batch) if batch.is_empty() => {}
                Ok(batch) => total.add(&self.shared.push_rollouts(&job, batch).await?),
                Err(why) if skip_bad => {
                    debug!(%why, "skipping a malformed rollout message");
                    invalid += n;
                }
                Err(why) => {
                    return Err(Status::invalid_argument(format!(
                        "{why} (nothing of message {index} was admitted; {} rollouts of earlier messages were)",
                        total.accepted
                    )))
                }
            }
            messages += 1;
            next = stream.message().await?;
        }
        Ok(Response::new(response(messages, invalid, &total)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_rollouts_become_the_rows_files_hold() {
        let r = wire::StreamedRollout {
            prompt: "1+1=".into(),
            completion_ids: vec![50, 2],
            reward: 1.0,
            policy_version: 3,
            old_logprobs: vec![-0.5, -0.25],
            ..Default::default()
        };
        let row = json_row(&r);
        assert_eq!(row["prompt"], "1+1=");
        assert_eq!(row["completion_ids"], json!([50, 2]));
        assert!(
            row.get("group").is_none(),
            "the prompt is the default group"
        );
        assert_eq!(row["old_logprobs"], json!([-0.5, -0.25]));
        let nan = wire::StreamedRollout {
            reward: f64::NAN,
            ..r
        };
        assert!(json_row(&nan)["reward"].is_null());
    }

    #[test]
    fn a_bad_rollout_is_named_by_message_index_and_field() {
        let enc =
            crate::stream::data::encoder(&toml::from_str("format = \"rollouts\"").unwrap(), 259)
                .unwrap();
        let good = wire::StreamedRollout {
            prompt: "2+2=".into(),
            completion: "4".into(),
            reward: 1.0,
            ..Default::default()
        };
        let bad = wire::StreamedRollout {
            reward: f64::INFINITY,
            ..good.clone()
        };
        let ok =
            decode_message(&enc, RowBudget::single(64), 0, std::slice::from_ref(&good)).unwrap();
        assert_eq!(ok[0].group, "2+2=");
        let e = decode_message(&enc, RowBudget::single(64), 4, &[good.clone(), bad]).unwrap_err();
        assert!(
            e.starts_with("messages[4].rollouts[1]: \"reward\" must be a finite number"),
            "{e}"
        );
        let e = decode_message(&enc, RowBudget::single(3), 0, &[good]).unwrap_err();
        assert!(e.contains("data.max_tokens = 3"), "{e}");
    }
}
