//! Generate plans (issue 17): the replica completes the plan's prompts with
//! its current weights ([`crate::generate`]) and answers with a
//! `GenerateResult`. The plan must name the job, generation and committed
//! step this replica holds (its `policy_version`), so completions are
//! always tagged with the weights that drew them. Errors carry the round
//! in `WorkerError.step`.
//!
//! Under fsdp the model is gathered for the round (`Trainer::policy`, a
//! collective): every rank of the generation takes part, an empty share
//! included, and a rank that refuses its plan tells the others before the
//! gather. While the round runs, a newer generation's configure interrupts
//! its collective (see `Handle::submit`).

use std::time::Instant;

use tracing::info;

use super::thread::{lock, PlanKey, Thread};
use crate::convert;
use crate::error::{classify, StepError};
use crate::generate;
use crate::wire;
use crate::wire::worker_message::Msg;

/// The in-flight key of a generation round: no step plan has this step
/// number, so only a newer generation's configure aborts it.
const ROUND_KEY_STEP: u64 = u64::MAX;

impl Thread {
    pub(super) fn generate(&mut self, p: &wire::GeneratePlan) {
        let start = Instant::now();
        lock(&self.in_flight).running = Some(PlanKey {
            job: p.job_id.clone(),
            generation: p.generation,
            step: ROUND_KEY_STEP,
        });
        // libtorch raises C++ exceptions as panics (out of memory among
        // them): the round fails, the thread lives.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.round(p)))
            .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref())));
        lock(&self.in_flight).running = None;
        let seconds = start.elapsed().as_secs_f64();
        match outcome {
            Ok(completions) => {
                let tokens: usize = completions.iter().map(|c| c.token_ids.len() / 4).sum();
                info!(
                    round = p.round,
                    rank = p.rank,
                    completions = completions.len(),
                    tokens,
                    digest = format!("{:016x}", digest(&completions)),
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

    fn round(&mut self, p: &wire::GeneratePlan) -> anyhow::Result<Vec<wire::Completion>> {
        let refuse = |msg: String| -> anyhow::Error { StepError::invalid(msg) };
        let h = match &mut self.job {
            Some(h) if h.job == p.job_id => h,
            _ => return Err(refuse(format!("job {} is not configured here", p.job_id))),
        };
        let at = |h: &super::thread::Held| {
            format!(
                "the plan is for generation {} at policy version {}; this replica is at generation {} step {}",
                p.generation, p.policy_version, h.generation, h.step
            )
        };
        // Another generation's plan: this replica's collective is not the
        // plan's group, so it joins no collective for it.
        if h.generation != p.generation {
            return Err(refuse(at(h)));
        }
        let checked = if h.step != p.policy_version {
            Err(refuse(at(h)))
        } else {
            convert::generate_plan(p).map_err(|e| StepError::invalid(e.to_string()))
        };
        let model = h.exec.policy(checked.is_ok());
        let (params, requests) = checked?;
        let model = model?;
        let done = generate::generate(&model, &params, &requests)?;
        Ok(p.requests
            .iter()
            .zip(&done)
            .map(|(r, c)| convert::completion(r, c))
            .collect())
    }
}

/// FNV-1a over the completions' prompt ids, sample numbers and token ids,
/// in order: two runs that drew the same rollouts log the same digest.
fn digest(completions: &[wire::Completion]) -> u64 {
    let fnv = |h: u64, bytes: &[u8]| {
        bytes.iter().fold(h, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    completions.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| {
        let h = fnv(h, c.prompt_id.as_bytes());
        let h = fnv(h, &c.sample.to_le_bytes());
        fnv(h, &c.token_ids)
    })
}
