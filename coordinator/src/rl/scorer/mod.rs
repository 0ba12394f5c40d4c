//! The shell's half of the RL loop (issue 17): what needs the job's
//! tokenizer and verifier, which the pure core has neither of. At submit
//! and restore it loads the prompts ([`Scorer::load`]); for each generated
//! round ([`crate::rl::rounds::RoundToScore`]) it decodes the
//! completions, cuts them at the stop strings, scores them and builds the
//! rollouts the core admits. Runs off the state lock (a `command` verifier
//! is a subprocess).

use std::collections::HashMap;
use std::path::Path;

use crate::job::environment::{EnvKind, EnvSection};
use crate::job::spec::JobSpec;
use crate::rl::env_command::CommandEnv;
use crate::rl::generation::Span;
use crate::rl::generation::{Finish, GenCompletion};
use crate::rl::prompts::{self, Prompt};
use crate::rl::rounds::{LoopInputs, RoundStats, RoundToScore};
use crate::rl::verify::{self, Sample, Score, Verifier};
use crate::stream::data::format::{join, Encoder};
use crate::stream::doc::{DocId, Rollout, Sequence, IGNORE_INDEX};

/// Why a generating job could not be set up or a round scored.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error(transparent)]
    Data(#[from] crate::stream::data::DataError),
    #[error(transparent)]
    Verify(#[from] verify::VerifyError),
    #[error("rl.sampling.stop[{index}]: {message}")]
    Stop { index: usize, message: String },
    #[error("round {round}: prompt {prompt}: {message}")]
    Round {
        round: u64,
        prompt: DocId,
        message: String,
    },
    /// An episode's environment could not be stepped.
    #[error("round {round}: episode {episode}: {message}")]
    Env {
        round: u64,
        episode: String,
        message: String,
    },
    /// The verifier failed on a round; `rollout` names the completion it
    /// failed on when it names one (`<prompt>@<position> sample <k>`).
    #[error("round {round}: {}{error}", at_rollout(.rollout))]
    Scoring {
        round: u64,
        rollout: Option<String>,
        error: verify::VerifyError,
    },
}

fn at_rollout(rollout: &Option<String>) -> String {
    rollout
        .as_ref()
        .map_or_else(String::new, |r| format!("rollout {r}: "))
}

/// A generating job's tokenizer, prompts and verifier.
pub struct Scorer {
    enc: Encoder,
    verifier: Verifier,
    by_id: HashMap<DocId, Prompt>,
    stop: Vec<String>,
    inputs: LoopInputs,
    vocab: u32,
    /// `[rl.env]`: the rollouts are multi-turn episodes ([`turns`]).
    env: Option<EnvSection>,
    /// `[rl.env] kind = "command"`: the job's environment program.
    command_env: Option<CommandEnv>,
}

impl Scorer {
    /// Loads the job's prompts (`data.train`) with its tokenizer, and its
    /// verifier; `base` is where relative paths of the spec resolve.
    pub fn load(
        spec: &JobSpec,
        model_vocab: u32,
        base: Option<&Path>,
    ) -> Result<Scorer, LoopError> {
        let enc = crate::stream::data::encoder(&spec.data, model_vocab)?;
        let files = spec.data.files();
        // A chat prompt of a job with built-in tools is rendered with
        // their definitions, where the chat template renders tools.
        let tools = spec
            .rl
            .env
            .as_ref()
            .filter(|e| e.kind == EnvKind::Tools)
            .map(|e| crate::rl::tools::definitions(&e.tools));
        let prompts = prompts::load(&enc, &files, 0, tools.as_ref())?;
        // Eval prompts' ids follow the training files'.
        let eval = match spec.rl.eval_prompts.as_slice() {
            [] => None,
            f => Some(prompts::load(&enc, f, files.len() as u32, tools.as_ref())?),
        };
        let section = spec.rl.verifier.clone().unwrap_or_default();
        let mut verifier = Verifier::new(&section)?;
        verifier.base_dir = base.map(Path::to_path_buf);
        let stop = spec
            .rl
            .sampling
            .as_ref()
            .map(|s| s.stop.clone())
            .unwrap_or_default();
        let stop_sequences = stop
            .iter()
            .enumerate()
            .map(|(index, s)| {
                enc.tok
                    .ids(s, false)
                    .map_err(|message| LoopError::Stop { index, message })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let inputs = LoopInputs {
            prompts: prompts.clone(),
            stop_ids: vec![enc.eos_id],
            stop_sequences,
            eval: eval.clone(),
            record_routing: spec.rl.routing_replay == Some(true),
            episodes: spec.rl.env.is_some(),
        };
        let by_id = prompts
            .prompts
            .iter()
            .chain(eval.iter().flat_map(|e| e.prompts.iter()))
            .map(|p| (p.id, p.clone()))
            .collect();
        Ok(Scorer {
            enc,
            verifier,
            by_id,
            stop,
            inputs,
            vocab: model_vocab,
            env: spec.rl.env.clone(),
            command_env: spec
                .rl
                .env
                .as_ref()
                .filter(|e| e.kind == EnvKind::Command)
                .map(|e| CommandEnv::new(e, base.map(Path::to_path_buf))),
        })
    }

    /// The model's vocab size: every generated token id is below it.
    pub fn vocab(&self) -> u32 {
        self.vocab
    }

    /// What the core needs (`Event::LoadPrompts`).
    pub fn inputs(&self) -> LoopInputs {
        self.inputs.clone()
    }

    fn prompt(&self, id: DocId) -> Option<&Prompt> {
        self.by_id.get(&id)
    }

    /// Scores a round: one rollout per completion, groups in round order,
    /// each group named by its prompt and stream position.
    pub fn score(&self, r: &RoundToScore) -> Result<(Vec<Rollout>, RoundStats), LoopError> {
        let mut texts = Vec::new();
        for g in &r.groups {
            let p = self.prompt(g.prompt).ok_or_else(|| LoopError::Round {
                round: r.round,
                prompt: g.prompt,
                message: "not a prompt of this job".into(),
            })?;
            for c in &g.completions {
                // An episode's answer is its last policy turn.
                let from = c.trace.as_ref().map_or(0, |t| t.answer_from);
                let text = self
                    .enc
                    .tok
                    .decode(&c.token_ids[from..])
                    .map_err(|message| LoopError::Round {
                        round: r.round,
                        prompt: g.prompt,
                        message,
                    })?;
                texts.push((p, verify::truncate_at_stop(&text, &self.stop).to_string()));
            }
        }
        let logged = tracing::enabled!(tracing::Level::DEBUG);
        if let (true, Some(g), Some((_, answer))) = (logged, r.groups.first(), texts.first()) {
            // One whole rollout per round, to see what the policy writes.
            if let Some(c) = g.completions.first() {
                let whole = self.enc.tok.decode_all(&c.token_ids).unwrap_or_default();
                tracing::debug!(round = r.round, prompt = %g.prompt, completion = ?whole, answer = ?answer, "a completion of the round");
            }
        }
        // An episode its environment scored skips the verifier.
        let env_scores: Vec<Option<Score>> = r
            .groups
            .iter()
            .flat_map(|g| g.completions.iter())
            .map(|c| c.trace.as_ref().and_then(|t| t.score.clone()))
            .collect();
        let judged: Vec<usize> = (0..texts.len())
            .filter(|&i| env_scores[i].is_none())
            .collect();
        let batch: Vec<Sample> = judged
            .iter()
            .map(|&i| {
                let (p, t) = &texts[i];
                Sample {
                    prompt: &p.text,
                    completion: t,
                    reference: &p.reference,
                }
            })
            .collect();
        let verified = self.verifier.score(&batch).map_err(|error| {
            // The batch is the round's unscored completions in order.
            let rollout = error.sample().and_then(|i| {
                r.groups
                    .iter()
                    .flat_map(|g| g.completions.iter().map(move |c| (g, c)))
                    .nth(judged[i])
                    .map(|(g, c)| format!("{}@{} sample {}", g.prompt, g.position, c.sample))
            });
            LoopError::Scoring {
                round: r.round,
                rollout,
                error,
            }
        })?;
        let mut verified = verified.into_iter();
        let scores: Vec<Score> = env_scores
            .into_iter()
            .map(|s| s.unwrap_or_else(|| verified.next().expect("one per judged completion")))
            .collect();
        let mut stats = RoundStats {
            gen_seconds: r.seconds,
            ..Default::default()
        };
        let mut rollouts = Vec::with_capacity(scores.len());
        let completions = r
            .groups
            .iter()
            .flat_map(|g| g.completions.iter().map(move |c| (g, c)));
        for ((g, c), sc) in completions.zip(&scores) {
            let p = self.prompt(g.prompt).expect("checked above");
            stats.completions += 1;
            stats.reward_sum += sc.reward;
            stats.reward_sq_sum += sc.reward * sc.reward;
            stats.completion_tokens += policy_tokens(c) as u64;
            if let Some(t) = &c.trace {
                stats.episodes += 1;
                stats.turns += u64::from(t.turns);
                stats.tool_calls += u64::from(t.tool_calls);
                stats.env_tokens += (c.token_ids.len() - policy_tokens(c)) as u64;
            }
            stats.truncated += u64::from(c.finish == Finish::Length);
            if let Some(ok) = sc.correct {
                stats.judged += 1;
                stats.correct += u64::from(ok);
            }
            for (k, v) in &sc.components {
                *stats.components.entry(k.clone()).or_default() += v;
            }
            let mut old = vec![0.0f32; p.ids.len()];
            old.extend(&c.logprobs);
            let routing =
                replay_rows(&c.routing, p.ids.len(), c.token_ids.len()).map_err(|message| {
                    LoopError::Round {
                        round: r.round,
                        prompt: g.prompt,
                        message: format!("sample {}: routing: {message}", c.sample),
                    }
                })?;
            let seq = match &c.trace {
                Some(t) => episode_seq(&p.ids, &c.token_ids, &t.spans),
                None => join(p.ids.clone(), c.token_ids.clone()),
            };
            rollouts.push(Rollout {
                seq,
                reward: sc.reward,
                // Unique per position: a prompt seen again next epoch is a
                // new group; the prompt id stays readable in it.
                group: format!("{}@{}", g.prompt, g.position),
                policy_version: r.policy_version,
                old_logprobs: Some(old),
                routing,
            });
        }
        Ok((rollouts, stats))
    }
}

/// Tokens the policy sampled in a completion (all but an episode's
/// environment turns).
fn policy_tokens(c: &GenCompletion) -> usize {
    match &c.trace {
        Some(t) => t
            .spans
            .iter()
            .filter(|s| s.policy)
            .map(|s| s.len as usize)
            .sum(),
        None => c.token_ids.len(),
    }
}

/// An episode as one sequence: the prompt, then its turns; loss on the
/// policy's tokens only (the prompt and environment turns are context).
fn episode_seq(prompt: &[u32], tokens: &[u32], spans: &[Span]) -> Sequence {
    let mut input_ids = prompt.to_vec();
    let mut labels = vec![IGNORE_INDEX; prompt.len()];
    let mut at = 0;
    for s in spans {
        let run = &tokens[at..at + s.len as usize];
        labels.extend(
            run.iter()
                .map(|&t| if s.policy { t as i32 } else { IGNORE_INDEX }),
        );
        at += s.len as usize;
    }
    debug_assert_eq!(at, tokens.len(), "spans cover the episode");
    input_ids.extend(tokens);
    Sequence::new(input_ids, labels)
}

/// A completion's routing as its rollout keeps it: aligned with the
/// rollout's tokens (`prompt + completion`), the last one — never run —
/// left to the router; `None` without routing.
fn replay_rows(
    routing: &[u16],
    prompt: usize,
    completion: usize,
) -> Result<Option<Vec<u16>>, String> {
    if routing.is_empty() {
        return Ok(None);
    }
    let ran = prompt + completion - 1;
    if ran == 0 || !routing.len().is_multiple_of(ran) {
        return Err(format!(
            "{} expert ids for the {ran} tokens the generator ran (the same number for each)",
            routing.len()
        ));
    }
    let width = routing.len() / ran;
    let mut rows = routing.to_vec();
    rows.extend(std::iter::repeat_n(accrue_proto::NO_EXPERT, width));
    Ok(Some(rows))
}

#[cfg(test)]
mod tests;
mod turns;

#[cfg(test)]
mod replay_tests {
    use super::replay_rows;

    /// A completion's routing covers the tokens the generator ran; the
    /// rollout's gets a router-decided row for the last token.
    #[test]
    fn routing_rows_cover_every_token() {
        assert_eq!(replay_rows(&[], 3, 2), Ok(None));
        // 3 prompt + 2 completion tokens: 4 ran, 2 ids each.
        let r: Vec<u16> = (0..8).collect();
        let rows = replay_rows(&r, 3, 2).unwrap().unwrap();
        assert_eq!(rows.len(), 10);
        assert_eq!(&rows[..8], &r[..]);
        assert_eq!(&rows[8..], [accrue_proto::NO_EXPERT; 2]);
        let e = replay_rows(&r[..7], 3, 2).unwrap_err();
        assert!(e.contains("7 expert ids for the 4 tokens"), "{e}");
    }
}
