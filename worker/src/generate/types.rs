//! What generation takes and returns: the sampling settings, a request,
//! a completion (shared by the sampler, the stop rule and the scheduler).

/// How completions are drawn (the wire's `SamplingParams`, resolved).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: u32,
    pub max_new_tokens: usize,
    /// A completion ends after any of these (kept in it).
    pub stop_ids: Vec<i64>,
    /// A completion ends once it ends with one of these.
    pub stop_sequences: Vec<Vec<i64>>,
    /// Sequences decoded at once.
    pub max_batch: usize,
    /// Prefill a prompt that several requests share (a group of
    /// `rl.group_size` samples) once and start their slots from its cached
    /// keys and values; false prefills each request's prompt.
    pub share_prompts: bool,
    /// Record the experts every token went through (Qwen3-MoE routing
    /// replay: [`Completion::routing`]).
    pub record_routing: bool,
    /// Tokens per page of the KV cache (0: [`crate::model::decode::PAGE_TOKENS`];
    /// at least the longest sequence: the static layout).
    pub kv_page_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 16,
            stop_ids: Vec::new(),
            stop_sequences: Vec::new(),
            max_batch: DEFAULT_MAX_BATCH,
            share_prompts: true,
            record_routing: false,
            kv_page_tokens: 0,
        }
    }
}

/// Sequences decoded at once when the plan leaves it to the worker.
pub const DEFAULT_MAX_BATCH: usize = 32;

/// One prompt to complete.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub prompt: Vec<i64>,
    /// The sampler's seed.
    pub seed: u64,
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop id or stop sequence.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

/// A request's completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The stop id or sequence included.
    pub tokens: Vec<i64>,
    /// One per token: `log_softmax` of the raw logits at it.
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// With `record_routing` on a sparse model: the experts each token
    /// the model ran went through — the prompt's, then every completion
    /// token but the last (never fed) — `sparse layers × top_k` ids per
    /// token, flat, in layer order. Empty otherwise.
    pub routing: Vec<i64>,
}
