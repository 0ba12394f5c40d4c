//! Generate plans (issue 17): the replica completes the plan's prompts with
//! its current weights ([`crate::generate`]) and answers with a
//! `GenerateResult`. The plan must name the job, generation and committed
//! step this replica holds (its `policy_version`), so completions are
//! always tagged with the weights that drew them. Errors carry the round
//! in `WorkerError.step`.

use std::time::Instant;

use tracing::info;

use super::thread::Thread;
use crate::convert;
use crate::error::{classify, StepError};
use crate::generate;
use crate::wire;
use crate::wire::worker_message::Msg;

impl Thread {
    pub(super) fn generate(&mut self, p: &wire::GeneratePlan) {
        let start = Instant::now();
        let refuse = |msg: String| -> anyhow::Error { StepError::invalid(msg) };
        let outcome = (|| -> anyhow::Result<Vec<wire::Completion>> {
            let h = match &self.job {
                Some(h) if h.job == p.job_id => h,
                _ => return Err(refuse(format!("job {} is not configured here", p.job_id))),
            };
            if h.generation != p.generation || h.step != p.policy_version {
                return Err(refuse(format!(
                    "the plan is for generation {} at policy version {}; this replica is at generation {} step {}",
                    p.generation, p.policy_version, h.generation, h.step
                )));
            }
            let model = h.exec.policy().ok_or_else(|| {
                refuse(
                    "generation needs the whole model on each rank (sharding ddp or zero2); \
                     under fsdp a rank holds a shard of the parameters"
                        .into(),
                )
            })?;
            let (params, requests) =
                convert::generate_plan(p).map_err(|e| StepError::invalid(e.to_string()))?;
            // libtorch raises C++ exceptions as panics (out of memory
            // among them): the round fails, the thread lives.
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                generate::generate(model, &params, &requests)
            }))
            .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref())))?;
            Ok(p.requests
                .iter()
                .zip(&done)
                .map(|(r, c)| convert::completion(r, c))
                .collect())
        })();
        let seconds = start.elapsed().as_secs_f64();
        match outcome {
            Ok(completions) => {
                let tokens: usize = completions.iter().map(|c| c.token_ids.len() / 4).sum();
                info!(
                    round = p.round,
                    completions = completions.len(),
                    tokens,
                    tokens_per_s = tokens as f64 / seconds.max(1e-9),
                    "generation round done"
                );
                self.send(Msg::GenerateResult(wire::GenerateResult {
                    job_id: p.job_id.clone(),
                    generation: p.generation,
                    round: p.round,
                    rank: p.rank,
                    policy_version: p.policy_version,
                    completions,
                    seconds,
                }));
            }
            Err(e) => {
                let (kind, peer) = classify(&e);
                let msg = format!("generation round {}: {e:#}", p.round);
                self.error(&p.job_id, p.generation, p.round, kind, msg, peer);
            }
        }
    }
}
