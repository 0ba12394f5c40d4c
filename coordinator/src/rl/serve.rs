//! The core's side of a served job's endpoint (`[rl.serve]`, issue 36):
//! chat-completion calls the shell rendered into prompt tokens wait here
//! until the job's training workers are idle between steps, then go out
//! as one generation round ([`RoundKind::Serve`]) dealt over the ranks;
//! the answered round comes back to the shell ([`Served`]) to be sent to
//! the callers. A step due (its rollouts queued) goes first: the calls
//! wait at most one step.
//!
//! A call stays queued until its answer is handed out: a round lost with
//! its generation (a worker died, the round overran its deadline) is
//! planned again with the same seeds by the next generation, so the
//! caller waits longer and gets what it would have got. Nothing here is
//! persisted: a caller whose coordinator restarted gets a broken
//! connection and calls again (its episode's record is lost with the
//! coordinator, see `crate::rl::endpoint`).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::job::rl::SamplingSection;
use crate::rl::generation::{GenCompletion, GenRequest};
use crate::rl::rounds::{Round, RoundKind, RoundPlan};
use crate::stream::doc::DocId;

/// `DocId::file` of a served call's generation request (`line` is the
/// call's number): never a prompt file's index.
pub const SERVE_FILE: u32 = u32::MAX - 1;

/// One chat-completion call, rendered.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeRequest {
    /// Numbers the call within the coordinator's run (the shell's).
    pub id: u64,
    pub prompt_ids: Arc<[u32]>,
    pub seed: u64,
    /// The call's sampling (the job's defaults where it named none);
    /// calls are decoded together only with equal sampling.
    pub sampling: Arc<SamplingSection>,
    /// Generation stops after one of these ids (the tokenizer's EOS).
    pub stop_ids: Arc<[u32]>,
}

/// A call's answer: its completion and the policy that drew it.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    pub id: u64,
    pub completion: GenCompletion,
    pub policy_version: u64,
}

/// Why a call was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{waiting} calls are waiting for generation (rl.serve.max_waiting = {max})")]
pub struct ServeFull {
    pub waiting: usize,
    pub max: usize,
}

/// A served job's waiting calls.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeQueue {
    waiting: BTreeMap<u64, ServeRequest>,
    max_waiting: usize,
    max_batch: u32,
    next_round: u64,
}

impl ServeQueue {
    pub fn new(max_waiting: u32, max_batch: u32) -> ServeQueue {
        ServeQueue {
            waiting: BTreeMap::new(),
            max_waiting: max_waiting as usize,
            max_batch,
            next_round: 1,
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Queues a call; refused when `rl.serve.max_waiting` are waiting.
    pub fn push(&mut self, r: ServeRequest) -> Result<(), ServeFull> {
        if self.waiting.len() >= self.max_waiting && !self.waiting.contains_key(&r.id) {
            return Err(ServeFull {
                waiting: self.waiting.len(),
                max: self.max_waiting,
            });
        }
        self.waiting.insert(r.id, r);
        Ok(())
    }

    /// Forgets a call whose caller went away (not generated if still
    /// waiting; an answer already out is dropped by the shell).
    pub fn cancel(&mut self, id: u64) {
        self.waiting.remove(&id);
    }

    /// A round of the waiting calls that share the oldest one's sampling,
    /// dealt round-robin over `world` ranks (a rank may get none: every
    /// rank of an fsdp generation takes part in the gather); `None` when
    /// nothing waits.
    pub fn plan(
        &mut self,
        world: u32,
        generation: u64,
        policy_version: u64,
        now_ms: i64,
    ) -> Option<(Round, Vec<RoundPlan>)> {
        let first = self.waiting.values().next()?;
        let (sampling, stop_ids) = (first.sampling.clone(), first.stop_ids.clone());
        let world = world.max(1) as usize;
        let mut asked = vec![Vec::new(); world];
        let mut requests: Vec<Vec<GenRequest>> = vec![Vec::new(); world];
        let batch = self
            .waiting
            .values()
            .filter(|r| r.sampling == sampling && r.stop_ids == stop_ids);
        for (i, r) in batch.enumerate() {
            let prompt = DocId {
                file: SERVE_FILE,
                line: r.id,
            };
            asked[i % world].push((prompt, 0));
            requests[i % world].push(GenRequest {
                prompt,
                sample: 0,
                prompt_ids: r.prompt_ids.clone(),
                seed: r.seed,
            });
        }
        let id = self.next_round;
        self.next_round += 1;
        let sampling = Arc::new(SamplingSection {
            max_batch: self.max_batch,
            stop: Vec::new(),
            ..(*sampling).clone()
        });
        let plans = requests
            .into_iter()
            .map(|requests| RoundPlan {
                round: id,
                policy_version,
                sampling: sampling.clone(),
                stop_ids: stop_ids.clone(),
                stop_sequences: Arc::from(Vec::new()),
                requests,
                record_routing: false,
            })
            .collect();
        let round = Round {
            id,
            kind: RoundKind::Serve,
            generation,
            policy_version,
            positions: 0..0,
            started_ms: now_ms,
            asked,
            answers: BTreeMap::new(),
            episodes: None,
        };
        Some((round, plans))
    }

    /// An answered serve round: its calls leave the queue with their
    /// completions (a call cancelled meanwhile is left out).
    pub fn answered(&mut self, r: Round) -> Vec<Served> {
        let version = r.policy_version;
        r.answers
            .into_values()
            .flat_map(|(c, _)| c)
            .filter_map(|completion| {
                let id = completion.prompt.line;
                self.waiting.remove(&id).map(|_| Served {
                    id,
                    completion,
                    policy_version: version,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::generation::Finish;

    fn call(id: u64, temperature: f32) -> ServeRequest {
        ServeRequest {
            id,
            prompt_ids: vec![1, 2, id as u32].into(),
            seed: 100 + id,
            sampling: Arc::new(SamplingSection {
                temperature,
                ..Default::default()
            }),
            stop_ids: vec![0].into(),
        }
    }

    fn answer(r: &Round, rank: usize) -> Vec<GenCompletion> {
        r.asked[rank]
            .iter()
            .map(|&(prompt, sample)| GenCompletion {
                prompt,
                sample,
                token_ids: vec![7, 0],
                logprobs: vec![-0.5, -0.1],
                finish: Finish::Stop,
                routing: Vec::new(),
                trace: None,
            })
            .collect()
    }

    /// Calls of one sampling go out together over every rank; a call of
    /// another sampling waits for the next round; a round lost with its
    /// generation is planned again with the same seeds, and a call is
    /// answered once.
    #[test]
    fn calls_are_dealt_by_sampling_and_survive_a_lost_round() {
        let mut q = ServeQueue::new(8, 0);
        for c in [call(1, 1.0), call(2, 0.0), call(3, 1.0), call(4, 1.0)] {
            q.push(c).unwrap();
        }
        let (r, plans) = q.plan(2, 7, 3, 0).unwrap();
        assert_eq!(r.kind, RoundKind::Serve);
        assert_eq!((r.generation, r.policy_version), (7, 3));
        let ids = |p: &RoundPlan| p.requests.iter().map(|g| g.prompt.line).collect::<Vec<_>>();
        assert_eq!(ids(&plans[0]), [1, 4]);
        assert_eq!(ids(&plans[1]), [3]);
        assert_eq!(plans[0].requests[0].seed, 101);
        assert_eq!(plans[0].sampling.temperature, 1.0);
        // The generation was lost: the same calls again, same seeds.
        let (mut again, plans2) = q.plan(1, 8, 3, 0).unwrap();
        assert_eq!(ids(&plans2[0]), [1, 3, 4]);
        assert_ne!(again.id, r.id);
        assert_eq!(again.answer(0, answer(&again, 0), 0.1), Ok(true));
        let served = q.answered(again);
        assert_eq!(served.iter().map(|s| s.id).collect::<Vec<_>>(), [1, 3, 4]);
        assert!(served.iter().all(|s| s.policy_version == 3));
        // The greedy call is next, alone; an answer of the old round finds
        // its calls gone.
        let (_, plans3) = q.plan(2, 8, 4, 0).unwrap();
        assert_eq!(ids(&plans3[0]), [2]);
        assert!(plans3[1].requests.is_empty());
        assert_eq!(plans3[0].sampling.temperature, 0.0);
        let mut old = r;
        assert_eq!(old.answer(0, answer(&old, 0), 0.1), Ok(false));
        assert!(q.answered(old).is_empty());
    }

    #[test]
    fn a_full_queue_refuses_and_a_cancelled_call_is_not_generated() {
        let mut q = ServeQueue::new(2, 0);
        q.push(call(1, 1.0)).unwrap();
        q.push(call(2, 1.0)).unwrap();
        assert_eq!(q.push(call(3, 1.0)), Err(ServeFull { waiting: 2, max: 2 }));
        q.cancel(1);
        q.push(call(3, 1.0)).unwrap();
        let (_, plans) = q.plan(1, 1, 0, 0).unwrap();
        let ids: Vec<u64> = plans[0].requests.iter().map(|g| g.prompt.line).collect();
        assert_eq!(ids, [2, 3]);
        q.cancel(2);
        q.cancel(3);
        assert!(q.plan(1, 1, 0, 0).is_none());
    }
}
