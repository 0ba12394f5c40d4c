//! What a generation request and its answer are (issue 17), the pieces
//! of the RL loop's rounds ([`crate::rl::rounds`]) and of their
//! multi-turn episodes ([`crate::rl::episode`]) share: one completion to
//! sample, how it ended, what came back (with a finished episode's
//! turns), and the seeds.

use std::sync::Arc;

use crate::rl::verify::Score;
use crate::stream::doc::DocId;

/// One completion to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: DocId,
    pub sample: u32,
    pub prompt_ids: Arc<[u32]>,
    pub seed: u64,
}

/// How a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

/// One sampled completion, as a worker returned it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenCompletion {
    pub prompt: DocId,
    pub sample: u32,
    pub token_ids: Vec<u32>,
    /// One per completion token, under the sampling policy.
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// With routing recorded: the experts of every token the generator
    /// ran (prompt, then the completion but its last token), a fixed
    /// number per token; empty otherwise.
    pub routing: Vec<u16>,
    /// A finished multi-turn episode: its policy and environment turns
    /// (the tokens are the whole episode after the prompt). `None`: one
    /// policy turn, as a worker returns it.
    pub trace: Option<Box<Trace>>,
}

/// A run of an episode's tokens after its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Sampled by the policy (trained on) or inserted by the environment.
    pub policy: bool,
    pub len: u32,
}

/// What a finished episode tells the scorer beside its tokens.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Trace {
    /// The runs of policy and environment tokens, in order, covering the
    /// completion's tokens.
    pub spans: Vec<Span>,
    /// Where the last policy turn starts (the answer the verifier reads).
    pub answer_from: usize,
    pub turns: u32,
    pub tool_calls: u32,
    /// The environment's score, when it gave one (it replaces the
    /// verifier's).
    pub score: Option<Score>,
}

/// The sampler seed of sample `sample` at stream position `pos`
/// (SplitMix64 of the three: a re-planned round samples the same seeds).
pub fn seed_of(job_seed: u64, pos: u64, sample: u32) -> u64 {
    let mut z = job_seed
        .wrapping_add(pos.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(u64::from(sample).wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
