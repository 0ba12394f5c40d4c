//! Continuous batching (Orca, vLLM): up to `max_batch` sequences decode
//! together, one token each per step; a finished sequence's slot takes the
//! next waiting prompt at once (its prefill), so short completions never
//! wait on long ones. Requests are taken in order; completions are
//! returned in request order.
//!
//! A prompt several requests share (the `rl.group_size` samples of a
//! group) is prefilled once: the others start from its cached keys and
//! values and its last-token logits (`SamplingParams::share_prompts`).
//!
//! A slot's state is the last sampled token, not yet in the cache: the
//! next decode step feeds it. A sequence ends on the token that finishes
//! it, which is then never fed.

use std::collections::HashMap;

use tch::{Device, Tensor};

use super::sampler::Sampler;
use super::stop::finished;
use super::types::{Completion, Finish, Request, SamplingParams};
use crate::error::StepError;
use crate::model::{KvCache, Llama, Prefix};

/// A sequence being decoded in a slot.
struct Active {
    request: usize,
    sampler: Sampler,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
}

/// Completes every request with `model` (no gradient), in request order.
pub fn generate(
    model: &Llama,
    params: &SamplingParams,
    requests: &[Request],
) -> anyhow::Result<Vec<Completion>> {
    let vocab = model.cfg.vocab_size as i64;
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(StepError::data(format!("request {i}: empty prompt")));
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(StepError::data(format!(
                "request {i}: prompt token {t} outside the vocabulary of {vocab}"
            )));
        }
    }
    let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
    let capacity = requests
        .iter()
        .map(|r| r.prompt.len() + params.max_new_tokens)
        .max()
        .unwrap_or(0);
    let slots = params.max_batch.max(1).min(requests.len());
    if params.max_new_tokens == 0 || slots == 0 {
        return Ok(requests
            .iter()
            .map(|_| Completion {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finish: Finish::Length,
                routing: Vec::new(),
            })
            .collect());
    }
    tch::no_grad(|| {
        let mut cache = match params.kv_page_tokens {
            0 => KvCache::new(model, slots, capacity),
            page => KvCache::paged(model, slots, capacity, page),
        };
        if params.record_routing {
            cache = cache.record_routing();
        }
        let mut active: Vec<Option<Active>> = (0..slots).map(|_| None).collect();
        let mut waiting = 0..requests.len();
        let mut shared = params.share_prompts.then(|| Shared::new(requests));
        loop {
            // Refill: every free slot takes the next prompt, prefilled
            // together; one that finishes on its first token frees its
            // slot again.
            loop {
                let fill: Vec<(usize, usize)> = active
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.is_none())
                    .map(|(s, _)| s)
                    .zip(&mut waiting)
                    .collect();
                if fill.is_empty() {
                    break;
                }
                let logits = prefill(model, &mut cache, requests, &fill, &mut shared)?;
                for (&(slot, r), row) in fill.iter().zip(logits) {
                    let a = Active {
                        request: r,
                        sampler: Sampler::new(requests[r].seed),
                        tokens: Vec::new(),
                        logprobs: Vec::new(),
                    };
                    active[slot] = advance(params, a, &row, &mut done, &cache, slot);
                    if active[slot].is_none() {
                        cache.clear(slot);
                    }
                }
            }
            let step: Vec<(usize, i64)> = active
                .iter()
                .enumerate()
                .filter_map(|(s, a)| Some((s, *a.as_ref()?.tokens.last()?)))
                .collect();
            if step.is_empty() {
                break;
            }
            let logits = rows(&model.decode(&mut cache, &step)?)?;
            for (&(slot, _), row) in step.iter().zip(logits) {
                let a = active[slot].take().expect("stepped slots are active");
                active[slot] = advance(params, a, &row, &mut done, &cache, slot);
                if active[slot].is_none() {
                    cache.clear(slot);
                }
            }
        }
        Ok(done
            .into_iter()
            .map(|c| c.expect("every request completes"))
            .collect())
    })
}

/// Shared-prompt prefill: per distinct prompt, the requests not yet
/// started, and the prefix (keys, values, last-token logits) of a prompt
/// already prefilled while requests still need it. Requests of a group
/// are contiguous, so few prefixes are held at once.
struct Shared<'a> {
    left: HashMap<&'a [i64], usize>,
    held: HashMap<&'a [i64], (Prefix, Row)>,
}

impl<'a> Shared<'a> {
    fn new(requests: &'a [Request]) -> Shared<'a> {
        let mut left = HashMap::new();
        for r in requests {
            *left.entry(r.prompt.as_slice()).or_default() += 1;
        }
        Shared {
            left,
            held: HashMap::new(),
        }
    }
}

/// Prefills `fill`'s (slot, request) pairs as one packed row and returns
/// each one's last-token logits row. With `shared`, a prompt is run once:
/// its first request in the fill is prefilled, the others (in this fill
/// or a later one) start from its cached prefix and logits.
fn prefill<'a>(
    model: &Llama,
    cache: &mut KvCache,
    requests: &'a [Request],
    fill: &[(usize, usize)],
    shared: &mut Option<Shared<'a>>,
) -> anyhow::Result<Vec<Row>> {
    let Some(sh) = shared else {
        let prompts: Vec<(usize, &[i64])> = fill
            .iter()
            .map(|&(s, r)| (s, requests[r].prompt.as_slice()))
            .collect();
        return rows(&model.prefill(cache, &prompts)?);
    };
    // The first request of each prompt neither held nor already run here.
    let mut run: Vec<(usize, &[i64])> = Vec::new();
    for &(slot, r) in fill {
        let p = requests[r].prompt.as_slice();
        if !sh.held.contains_key(p) && !run.iter().any(|&(_, q)| q == p) {
            run.push((slot, p));
        }
    }
    let mut fresh = HashMap::new();
    if !run.is_empty() {
        let logits = rows(&model.prefill(cache, &run)?)?;
        for (&(slot, p), row) in run.iter().zip(logits) {
            // Kept only while another request still needs it.
            if sh.left[p] > 1 {
                let prefix = cache.prefix(slot, p.len())?;
                sh.held.insert(p, (prefix, row.clone()));
            }
            fresh.insert(slot, row);
        }
    }
    let mut out = Vec::with_capacity(fill.len());
    for &(slot, r) in fill {
        let p = requests[r].prompt.as_slice();
        let row = match fresh.remove(&slot) {
            Some(row) => row,
            None => {
                let (prefix, row) = sh.held.get(p).expect("run or held above");
                cache.start_from(slot, prefix)?;
                row.clone()
            }
        };
        out.push(row);
        let left = sh.left.get_mut(p).expect("every prompt is counted");
        *left -= 1;
        if *left == 0 {
            sh.held.remove(p);
        }
    }
    Ok(out)
}

/// A logits row on the host and its log-sum-exp.
type Row = (Vec<f32>, f32);

/// Samples `a`'s next token from a logits row and its log-sum-exp; returns it still active, or
/// `None` after storing its completion in `done` (with the routing its
/// `slot` of `cache` recorded).
fn advance(
    params: &SamplingParams,
    mut a: Active,
    (logits, lse): &Row,
    done: &mut [Option<Completion>],
    cache: &KvCache,
    slot: usize,
) -> Option<Active> {
    let (token, logprob) = a.sampler.sample(params, logits, *lse);
    a.tokens.push(token as i64);
    a.logprobs.push(logprob);
    match finished(params, &a.tokens) {
        None => Some(a),
        Some(finish) => {
            done[a.request] = Some(Completion {
                tokens: a.tokens,
                logprobs: a.logprobs,
                finish,
                routing: cache.routing(slot).to_vec(),
            });
            None
        }
    }
}

/// `[N, V]` float32 logits as N host rows, each with its log-sum-exp
/// (computed by libtorch, as the training forward's log-softmax is).
fn rows(logits: &Tensor) -> anyhow::Result<Vec<Row>> {
    let v = logits.size()[1] as usize;
    let lse = Vec::<f32>::try_from(logits.logsumexp([1], false).to_device(Device::Cpu))?;
    let flat = Vec::<f32>::try_from(logits.to_device(Device::Cpu).contiguous().view([-1]))?;
    Ok(flat.chunks(v).map(<[f32]>::to_vec).zip(lse).collect())
}
