//! The environment's half of a multi-turn round (issue 36, `[rl.env]`):
//! for each open episode, the policy turn's text goes to the environment
//! — the built-in tools ([`crate::rl::tools`]: a turn's tool calls, their
//! results as `tool` messages) or the job's program
//! ([`crate::rl::env_command`]) — and its messages come back rendered as
//! the next environment turn and tokenized, or the episode ends. Runs in
//! the shell off the state lock, like scoring.
//!
//! Rendering: after a chat prompt (messages the template rendered), the
//! environment's messages are rendered by the template after the
//! assistant's turn, with the
//! generation prompt (what the model would see in a chat): the text the
//! template puts after the assistant's content, less the end-of-turn token
//! the policy already sampled. After a text prompt (`prompt` as a string,
//! `question`), which no template rendered, a `tool` message is
//! `<tool_response>CONTENT</tool_response>`, the Hermes tags, with nothing
//! around it, and another message its content as it is.

use super::{LoopError, Scorer};
use crate::job::environment::{EnvKind, EnvSection};
use crate::rl::env_command::{StepIn, StepOut};
use crate::rl::episode::{EnvReply, EpisodesToStep, TurnToStep};
use crate::rl::generation::Finish;
use crate::rl::tools;
use crate::rl::verify::Score;

impl Scorer {
    /// Steps the environment of every episode of `s`; the replies in the
    /// same order.
    pub fn step(&self, s: &EpisodesToStep) -> Result<Vec<EnvReply>, LoopError> {
        let mut all = Vec::with_capacity(s.episodes.len());
        self.step_each(s, |mut replies| all.append(&mut replies))?;
        Ok(all)
    }

    /// Steps the environment of every episode of `s`, handing `deliver`
    /// the replies as the environment gives them (the built-in tools all
    /// at once; a program's as its answers arrive), so that an episode
    /// waiting on a slow tool holds no other.
    pub fn step_each(
        &self,
        s: &EpisodesToStep,
        mut deliver: impl FnMut(Vec<EnvReply>),
    ) -> Result<(), LoopError> {
        let env_error = |episode: String, message: String| LoopError::Env {
            round: s.round,
            episode,
            message,
        };
        let env = self
            .env
            .as_ref()
            .ok_or_else(|| env_error(String::new(), "the job has no [rl.env]".into()))?;
        let texts = s
            .episodes
            .iter()
            .map(|t| {
                self.enc
                    .tok
                    .decode(&t.turn)
                    .map_err(|m| env_error(t.episode.clone(), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The replies to some of the turns (by index), for `deliver`.
        let mut reply_to = |outs: Vec<(usize, Outcome)>| -> Result<(), LoopError> {
            let mut replies = Vec::with_capacity(outs.len());
            let mut closed = Vec::new();
            for (i, out) in outs {
                let t = &s.episodes[i];
                let reply = self
                    .reply(env, t, out)
                    .map_err(|m| env_error(t.episode.clone(), m))?;
                if reply.done.is_some() {
                    closed.push(t.episode.as_str());
                }
                replies.push(reply);
            }
            if let Some(c) = &self.command_env {
                c.close(&closed);
            }
            deliver(replies);
            Ok(())
        };
        match env.kind {
            EnvKind::Tools => reply_to(
                texts
                    .iter()
                    .map(|text| tools_outcome(env, text))
                    .enumerate()
                    .collect(),
            ),
            EnvKind::Command => self.command_outcomes(s, &texts, reply_to),
        }
    }

    /// What the job's environment program says of each turn, handed to
    /// `reply_to` as it comes.
    fn command_outcomes(
        &self,
        s: &EpisodesToStep,
        texts: &[String],
        mut reply_to: impl FnMut(Vec<(usize, Outcome)>) -> Result<(), LoopError>,
    ) -> Result<(), LoopError> {
        let env = self.command_env.as_ref().expect("built for kind = command");
        let steps = s
            .episodes
            .iter()
            .zip(texts)
            .map(|(t, text)| {
                let p = self.prompt(t.prompt);
                StepIn {
                    episode: &t.episode,
                    turn: t.turns,
                    content: text,
                    prompt: p.map_or("", |p| p.text.as_str()),
                    reference: p.map_or("", |p| p.reference.as_str()),
                }
            })
            .collect::<Vec<_>>();
        // A reply that cannot be made (its rendering) ends the stepping.
        let mut failed = None;
        let stepped = env.step_each(&steps, |batch| {
            if failed.is_some() {
                return;
            }
            let outs = batch
                .into_iter()
                .map(|(i, o)| {
                    let o = match o {
                        StepOut::Messages(m) => Outcome::Messages {
                            messages: m,
                            calls: 0,
                        },
                        StepOut::Done(score) => Outcome::Done(score),
                    };
                    (i, o)
                })
                .collect();
            if let Err(e) = reply_to(outs) {
                failed = Some(e);
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        stepped.map_err(|e| LoopError::Env {
            round: s.round,
            episode: format!("{} episodes", steps.len()),
            message: e.to_string(),
        })
    }

    /// The reply to one turn: the episode ends (the environment said so,
    /// or a limit), or the environment's messages as its next turn.
    fn reply(&self, env: &EnvSection, t: &TurnToStep, out: Outcome) -> Result<EnvReply, String> {
        let reply = |tokens, tool_calls, done, score| EnvReply {
            prompt: t.prompt,
            sample: t.sample,
            tokens,
            tool_calls,
            done,
            score,
        };
        let (messages, calls) = match out {
            Outcome::Done(score) => return Ok(reply(Vec::new(), 0, Some(Finish::Stop), score)),
            Outcome::Messages { messages, calls } => (messages, calls),
        };
        if t.turns >= env.max_turns {
            return Ok(reply(Vec::new(), calls, Some(Finish::Length), None));
        }
        let chat = self.prompt(t.prompt).is_some_and(|p| p.chat);
        let ended = t.turn.last().is_some_and(|&id| id == self.enc.eos_id);
        let text = self.render_messages(&messages, chat, ended)?;
        let tokens = self.enc.tok.ids(&text, false)?;
        // The next policy turn needs room for at least one token.
        if u64::from(t.episode_tokens) + tokens.len() as u64 >= u64::from(env.max_episode_tokens) {
            return Ok(reply(Vec::new(), calls, Some(Finish::Length), None));
        }
        Ok(reply(tokens, calls, None, None))
    }

    /// The environment turn's text carrying `messages` (role, content;
    /// see the module docs): by the chat template when the prompt was
    /// `chat`; `ended`: the policy's turn ended with the end-of-turn token.
    fn render_messages(
        &self,
        messages: &[(String, String)],
        chat: bool,
        ended: bool,
    ) -> Result<String, String> {
        let t = &self.enc.template;
        if !chat {
            return Ok(messages
                .iter()
                .map(|(role, c)| match role.as_str() {
                    "tool" => format!("<tool_response>{c}</tool_response>"),
                    _ => c.clone(),
                })
                .collect());
        }
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|(role, c)| serde_json::json!({"role": role, "content": c}))
            .collect();
        t.render_followup(&msgs, ended)
    }
}

/// What an environment made of one policy turn.
enum Outcome {
    /// The episode goes on with these messages; `calls` tool calls made.
    Messages {
        messages: Vec<(String, String)>,
        calls: u32,
    },
    /// The episode ended (with the environment's score, if any).
    Done(Option<Score>),
}

/// The built-in tools' answer: the calls' results as `tool` messages, or
/// the end of the episode for a turn without a call.
fn tools_outcome(env: &EnvSection, text: &str) -> Outcome {
    let calls = tools::parse_calls(text);
    if calls.is_empty() {
        return Outcome::Done(None);
    }
    Outcome::Messages {
        calls: calls.len() as u32,
        messages: calls
            .iter()
            .map(|c| ("tool".to_string(), tools::run(c, &env.tools)))
            .collect(),
    }
}
