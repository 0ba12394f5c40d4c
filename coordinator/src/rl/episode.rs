//! Multi-turn episodes (issue 36, `[rl.env]`): the pure state of a
//! round whose rollouts are episodes. An episode is its prompt followed by
//! turns: policy turns (sampled tokens with their log-probs, trained on)
//! and environment turns (tool results rendered by the shell, never
//! trained on).
//!
//! Continuous batching across turns: each episode moves on its own
//! ([`Stage`]). The core sends WAVES — generation rounds of whichever
//! episodes are ready — one at a time; a wave's answered turns go to the
//! shell to step their environments (`EpisodesToStep`), and the shell
//! answers each episode as its environment does (`Event::EpisodesStepped`
//! with any subset). A wave ends, its turns go to their environments and
//! the next wave takes every episode ready by then, so tool calls run
//! while the next wave decodes and an episode waiting on a slow tool holds
//! no other. Each turn's seed is its episode's first seed and its turn
//! number, so an episode's requests are the same whatever waves carry
//! them (the same as when every episode took its turns together). A round
//! is scored when its last episode ended.
//!
//! Exactly once: an episode lives in its round until the round is scored,
//! and its prompt is consumed only when the round's rollouts are admitted.
//! A round lost with a worker (or with the coordinator) is planned again
//! from its prompts with the same seeds: episodes restart from the prompt,
//! never from a half-recorded prefix, so an environment is always reset
//! before it is stepped and never sees a turn twice within an episode.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::generation::{seed_of, Finish, GenCompletion, GenRequest, Span, Trace};
use super::verify::Score;
use crate::stream::doc::DocId;

/// Where an episode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Its next policy turn is in the wave being generated.
    Generating,
    /// Its last policy turn is with its environment.
    Stepping,
    /// Its environment answered: it goes in the next wave.
    Ready,
    /// It ended (`finish` is set).
    Done,
}

/// One episode of a round.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub prompt: DocId,
    pub sample: u32,
    /// The rank that generates its turns.
    pub rank: u32,
    pub prompt_ids: Arc<[u32]>,
    /// The seed of its first turn (later turns derive theirs from it).
    pub seed: u64,
    /// Tokens after the prompt, and one log-prob per token (0 on the
    /// environment's).
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub trace: Trace,
    pub stage: Stage,
    /// Set when the episode ended.
    pub finish: Option<Finish>,
    /// Its last policy turn was cut by `max_new_tokens`.
    pub truncated: bool,
}

/// One open episode's last policy turn, for the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnToStep {
    pub prompt: DocId,
    pub sample: u32,
    /// The episode's id for an environment program: new for every attempt
    /// (`r<first round>-<prompt>-<sample>`).
    pub episode: String,
    /// The policy turn just sampled.
    pub turn: Vec<u32>,
    /// Policy turns so far (this one included).
    pub turns: u32,
    /// Tokens of the episode after its prompt (this turn included).
    pub episode_tokens: u32,
}

/// The episodes of a wave every rank answered: the shell steps their
/// environments and answers `Event::EpisodesStepped` per episode (in any
/// grouping, as their environments answer).
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodesToStep {
    pub job: String,
    /// The round's first id (`Episodes::origin`): the round whatever
    /// wave it is in.
    pub round: u64,
    pub episodes: Vec<TurnToStep>,
}

/// The environment's answer to one policy turn.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvReply {
    pub prompt: DocId,
    pub sample: u32,
    /// The environment turn's tokens (empty when the episode ends).
    pub tokens: Vec<u32>,
    /// Tool calls the policy turn made.
    pub tool_calls: u32,
    /// `Some` ends the episode: `Stop` when the policy answered, `Length`
    /// when a limit (turns, episode tokens) cut it.
    pub done: Option<Finish>,
    /// The environment's score of an ended episode.
    pub score: Option<Score>,
}

/// Why a reply does not fit the episodes it answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadReply {
    #[error("environment reply for prompt {prompt} sample {sample}: no such episode waiting for its environment (or answered twice)")]
    Unasked { prompt: DocId, sample: u32 },
}

/// A round's episodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Episodes {
    pub list: Vec<Episode>,
    /// The wave being generated (its round id), if one is out.
    pub wave: Option<u64>,
    /// Waves generated so far.
    pub waves: u32,
    /// Sum over waves of the slowest rank's seconds.
    pub gen_seconds: f64,
    /// The id of the round's first wave (episode ids are made from it).
    pub origin: u64,
}

impl Episodes {
    /// The episodes of round `origin`, whose first wave (every episode's
    /// first turn) is `requests` per rank.
    pub fn new(origin: u64, requests: &[Vec<GenRequest>]) -> Episodes {
        let list = requests
            .iter()
            .enumerate()
            .flat_map(|(rank, rs)| {
                rs.iter().map(move |q| Episode {
                    prompt: q.prompt,
                    sample: q.sample,
                    rank: rank as u32,
                    prompt_ids: q.prompt_ids.clone(),
                    seed: q.seed,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    trace: Trace::default(),
                    stage: Stage::Generating,
                    finish: None,
                    truncated: false,
                })
            })
            .collect();
        Episodes {
            list,
            wave: Some(origin),
            waves: 1,
            gen_seconds: 0.0,
            origin,
        }
    }

    fn index(&self) -> BTreeMap<(DocId, u32), usize> {
        self.list
            .iter()
            .enumerate()
            .map(|(i, e)| ((e.prompt, e.sample), i))
            .collect()
    }

    /// Takes the wave's answers (every rank's, checked by `Round::answer`
    /// against what was asked) as policy turns and returns them for the
    /// environments: every turn goes to its environment, one cut by
    /// `max_new_tokens` too (as the `verifiers` library's multi-turn
    /// environments do); an episode whose last turn was cut counts as
    /// truncated. No wave is out afterwards.
    pub fn absorb(
        &mut self,
        job: &str,
        answers: BTreeMap<u32, (Vec<GenCompletion>, f64)>,
    ) -> EpisodesToStep {
        let index = self.index();
        let mut slowest: f64 = 0.0;
        let mut episodes = Vec::new();
        for (cs, s) in answers.into_values() {
            slowest = slowest.max(s);
            for c in cs {
                let e = &mut self.list[index[&(c.prompt, c.sample)]];
                e.trace.answer_from = e.tokens.len();
                e.trace.turns += 1;
                e.trace.spans.push(Span {
                    policy: true,
                    len: c.token_ids.len() as u32,
                });
                e.tokens.extend(&c.token_ids);
                e.logprobs.extend(&c.logprobs);
                e.truncated = c.finish == Finish::Length;
                e.stage = Stage::Stepping;
                episodes.push(TurnToStep {
                    prompt: e.prompt,
                    sample: e.sample,
                    episode: format!("r{}-{}-{}", self.origin, e.prompt, e.sample),
                    turn: c.token_ids,
                    turns: e.trace.turns,
                    episode_tokens: e.tokens.len() as u32,
                });
            }
        }
        self.gen_seconds += slowest;
        self.wave = None;
        EpisodesToStep {
            job: job.to_string(),
            round: self.origin,
            episodes,
        }
    }

    /// Whether every episode ended.
    pub fn over(&self) -> bool {
        self.list.iter().all(|e| e.stage == Stage::Done)
    }

    /// Whether a next wave has episodes to carry.
    pub fn ready(&self) -> bool {
        self.list.iter().any(|e| e.stage == Stage::Ready)
    }

    /// Applies replies of the environments to episodes waiting on them
    /// (any of them, each once). Nothing is applied when one does not fit.
    pub fn apply(&mut self, replies: Vec<EnvReply>) -> Result<(), BadReply> {
        let index = self.index();
        let mut seen = std::collections::BTreeSet::new();
        for r in &replies {
            let ok = index
                .get(&(r.prompt, r.sample))
                .is_some_and(|&i| self.list[i].stage == Stage::Stepping);
            if !ok || !seen.insert((r.prompt, r.sample)) {
                return Err(BadReply::Unasked {
                    prompt: r.prompt,
                    sample: r.sample,
                });
            }
        }
        for r in replies {
            let e = &mut self.list[index[&(r.prompt, r.sample)]];
            e.trace.tool_calls += r.tool_calls;
            if let Some(f) = r.done {
                e.finish = Some(if e.truncated { Finish::Length } else { f });
                e.trace.score = r.score;
                e.stage = Stage::Done;
                continue;
            }
            e.trace.spans.push(Span {
                policy: false,
                len: r.tokens.len() as u32,
            });
            e.logprobs.extend(std::iter::repeat_n(0.0, r.tokens.len()));
            e.tokens.extend(r.tokens);
            e.stage = Stage::Ready;
        }
        Ok(())
    }

    /// The next wave, round `id`, over `world` ranks: every ready episode
    /// continues on its rank from all its tokens so far, with the seed of
    /// its turn (its first seed and how many turns it took: the same
    /// whatever wave carries it, and when a round is planned again).
    #[allow(clippy::type_complexity)]
    pub fn next_wave(
        &mut self,
        id: u64,
        world: u32,
    ) -> (Vec<Vec<(DocId, u32)>>, Vec<Vec<GenRequest>>) {
        let mut requests: Vec<Vec<GenRequest>> = vec![Vec::new(); world as usize];
        for e in self.list.iter_mut().filter(|e| e.stage == Stage::Ready) {
            let mut ids = e.prompt_ids.to_vec();
            ids.extend(&e.tokens);
            requests[e.rank as usize].push(GenRequest {
                prompt: e.prompt,
                sample: e.sample,
                prompt_ids: ids.into(),
                seed: seed_of(e.seed, u64::from(e.trace.turns), 0),
            });
            e.stage = Stage::Generating;
        }
        self.wave = Some(id);
        self.waves += 1;
        let asked = requests
            .iter()
            .map(|rs| rs.iter().map(|q| (q.prompt, q.sample)).collect())
            .collect();
        (asked, requests)
    }

    /// The ended episodes as completions to score, in (prompt, sample)
    /// order of the round.
    pub fn into_completions(self) -> Vec<GenCompletion> {
        self.list
            .into_iter()
            .map(|e| GenCompletion {
                prompt: e.prompt,
                sample: e.sample,
                token_ids: e.tokens,
                logprobs: e.logprobs,
                finish: e.finish.unwrap_or(Finish::Length),
                routing: Vec::new(),
                trace: Some(Box::new(e.trace)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(line: u64) -> DocId {
        DocId { file: 0, line }
    }

    fn completion(line: u64, sample: u32, tokens: &[u32], finish: Finish) -> GenCompletion {
        GenCompletion {
            prompt: id(line),
            sample,
            token_ids: tokens.to_vec(),
            logprobs: tokens.iter().map(|&t| -(t as f32)).collect(),
            finish,
            routing: Vec::new(),
            trace: None,
        }
    }

    fn request(line: u64, sample: u32) -> GenRequest {
        GenRequest {
            prompt: id(line),
            sample,
            prompt_ids: vec![100, 101].into(),
            seed: 7 + sample as u64,
        }
    }

    fn reply(line: u64, sample: u32, tokens: Vec<u32>, done: Option<Finish>) -> EnvReply {
        EnvReply {
            prompt: id(line),
            sample,
            tokens,
            tool_calls: u32::from(done.is_none()),
            done,
            score: None,
        }
    }

    /// Two ranks, three episodes: one answers at once, one calls a tool
    /// once, one is cut by max_new_tokens; the spans, log-probs and the
    /// second turn's prompts follow.
    #[test]
    fn turns_and_environment_replies_make_episodes() {
        let mut eps = Episodes::new(
            4,
            &[vec![request(1, 0), request(1, 1)], vec![request(2, 0)]],
        );
        assert_eq!(eps.wave, Some(4));
        let mut answers = BTreeMap::new();
        answers.insert(
            0,
            (
                vec![
                    completion(1, 0, &[5, 6], Finish::Stop),
                    completion(1, 1, &[7], Finish::Stop),
                ],
                1.0,
            ),
        );
        answers.insert(1, (vec![completion(2, 0, &[8, 8, 8], Finish::Length)], 2.0));
        let step = eps.absorb("j", answers);
        assert_eq!(eps.wave, None);
        assert!(!eps.over() && !eps.ready());
        assert_eq!(step.round, 4);
        assert_eq!(step.episodes.len(), 3, "a cut turn is stepped too");
        assert_eq!(step.episodes[0].turn, [5, 6]);
        assert_eq!(step.episodes[0].episode, "r4-0:1-0");
        let wrong = vec![
            reply(1, 0, vec![9], None),
            reply(1, 1, vec![], Some(Finish::Stop)),
            reply(9, 0, vec![], Some(Finish::Stop)),
        ];
        assert_eq!(
            eps.apply(wrong),
            Err(BadReply::Unasked {
                prompt: id(9),
                sample: 0
            })
        );
        let twice = vec![reply(1, 0, vec![9], None), reply(1, 0, vec![9], None)];
        assert!(eps.apply(twice).is_err(), "one reply per turn");
        assert!(!eps.ready(), "nothing of a refused batch applies");
        eps.apply(vec![
            reply(1, 0, vec![9, 9], None),
            reply(1, 1, vec![], Some(Finish::Stop)),
            reply(2, 0, vec![], Some(Finish::Stop)),
        ])
        .unwrap();
        let (asked, requests) = eps.next_wave(5, 2);
        assert_eq!(asked, vec![vec![(id(1), 0)], vec![]]);
        assert_eq!(&*requests[0][0].prompt_ids, [100, 101, 5, 6, 9, 9]);
        assert_eq!(
            requests[0][0].seed,
            seed_of(7, 1, 0),
            "each turn has its own seed"
        );
        let mut answers = BTreeMap::new();
        answers.insert(0, (vec![completion(1, 0, &[3], Finish::Stop)], 0.5));
        answers.insert(1, (vec![], 0.0));
        let step = eps.absorb("j", answers);
        assert_eq!(step.round, 4, "the round keeps its first id");
        assert_eq!(step.episodes[0].turns, 2);
        eps.apply(vec![reply(1, 0, vec![], Some(Finish::Stop))])
            .unwrap();
        assert!(eps.over());
        assert_eq!(eps.gen_seconds, 2.5);
        let cs = eps.into_completions();
        let c = &cs[0];
        assert_eq!(c.token_ids, [5, 6, 9, 9, 3]);
        assert_eq!(c.logprobs, [-5.0, -6.0, 0.0, 0.0, -3.0]);
        let t = c.trace.as_deref().unwrap();
        assert_eq!(
            t.spans,
            [
                Span {
                    policy: true,
                    len: 2
                },
                Span {
                    policy: false,
                    len: 2
                },
                Span {
                    policy: true,
                    len: 1
                }
            ]
        );
        assert_eq!((t.answer_from, t.turns, t.tool_calls), (4, 2, 1));
        assert_eq!(cs[2].finish, Finish::Length, "its last turn was cut");
        assert_eq!(cs[1].finish, Finish::Stop);
        assert_eq!(cs[1].trace.as_deref().unwrap().turns, 1);
    }

    /// Episodes answered by their environments at different times go in
    /// different waves, each with the seed of its own turn: the requests
    /// are those of turn-synchronous rounds.
    #[test]
    fn waves_carry_whichever_episodes_are_ready_with_their_turns_seeds() {
        let first = [vec![request(1, 0), request(1, 1), request(2, 0)]];
        let mut eps = Episodes::new(1, &first);
        let mut answers = BTreeMap::new();
        let turn1 = vec![
            completion(1, 0, &[5], Finish::Stop),
            completion(1, 1, &[6], Finish::Stop),
            completion(2, 0, &[7], Finish::Stop),
        ];
        answers.insert(0, (turn1, 1.0));
        eps.absorb("j", answers);
        // (1, 1)'s tool is slow: (1, 0) goes alone.
        eps.apply(vec![
            reply(1, 0, vec![9], None),
            reply(2, 0, vec![], Some(Finish::Stop)),
        ])
        .unwrap();
        let (_, wave2) = eps.next_wave(2, 1);
        assert_eq!(wave2[0].len(), 1);
        assert_eq!(wave2[0][0].seed, seed_of(7, 1, 0));
        // Its answer comes while wave 2 is out: it waits for the next.
        eps.apply(vec![reply(1, 1, vec![9], None)]).unwrap();
        assert!(eps.ready() && eps.wave == Some(2));
        let mut answers = BTreeMap::new();
        answers.insert(0, (vec![completion(1, 0, &[3], Finish::Stop)], 1.0));
        eps.absorb("j", answers);
        let (asked, wave3) = eps.next_wave(3, 1);
        assert_eq!(asked, vec![vec![(id(1), 1)]]);
        assert_eq!(wave3[0][0].seed, seed_of(8, 1, 0), "its second turn's seed");
        assert_eq!(&*wave3[0][0].prompt_ids, [100, 101, 6, 9]);
        assert_eq!(eps.waves, 3);
    }
}
