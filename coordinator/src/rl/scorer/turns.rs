//! The environment's half of a multi-turn round (issue 36, `[rl.env]`
//! kind = "tools"): for each open episode, the policy turn's text, its
//! tool calls ([`crate::rl::tools`]), their results rendered as the next
//! environment turn and tokenized — or the end of the episode. Runs in the
//! shell off the state lock, like scoring.
//!
//! Rendering: after a chat prompt (messages the template rendered), the
//! tool results are `tool` messages
//! rendered by the template after the assistant's turn, with the
//! generation prompt (what the model would see in a chat): the text the
//! template puts after the assistant's content, less the end-of-turn token
//! the policy already sampled. After a text prompt (`prompt` as a string,
//! `question`), which no template rendered, each result is
//! `<tool_response>RESULT</tool_response>`, the Hermes tags, with nothing
//! around them.

use super::{LoopError, Scorer};
use crate::job::environment::EnvSection;
use crate::rl::episode::{EnvReply, EpisodesToStep, TurnToStep};
use crate::rl::rounds::Finish;
use crate::rl::tools;

/// Stands for the assistant's content in a render, to find where the
/// template's text after it starts.
const SENTINEL: &str = "\u{10FFFE}accrue-turn\u{10FFFE}";

impl Scorer {
    /// Steps the environment of every open episode of a round.
    pub fn step(&self, s: &EpisodesToStep) -> Result<Vec<EnvReply>, LoopError> {
        let env = self.env.as_ref().ok_or_else(|| LoopError::Env {
            round: s.round,
            episode: String::new(),
            message: "the job has no [rl.env]".into(),
        })?;
        s.episodes
            .iter()
            .map(|t| {
                self.step_one(env, t).map_err(|message| LoopError::Env {
                    round: s.round,
                    episode: format!("{} sample {}", t.prompt, t.sample),
                    message,
                })
            })
            .collect()
    }

    fn step_one(&self, env: &EnvSection, t: &TurnToStep) -> Result<EnvReply, String> {
        let reply = |tokens, tool_calls, done| EnvReply {
            prompt: t.prompt,
            sample: t.sample,
            tokens,
            tool_calls,
            done,
        };
        let text = self.enc.tok.decode(&t.turn)?;
        let calls = tools::parse_calls(&text);
        if calls.is_empty() {
            return Ok(reply(Vec::new(), 0, Some(Finish::Stop)));
        }
        let n = calls.len() as u32;
        if t.turns >= env.max_turns {
            return Ok(reply(Vec::new(), n, Some(Finish::Length)));
        }
        let results: Vec<String> = calls.iter().map(|c| tools::run(c, &env.tools)).collect();
        let ended = t.turn.last().is_some_and(|&id| id == self.enc.eos_id);
        let chat = self.prompt(t.prompt).is_some_and(|p| p.chat);
        let text = self.render_results(&results, chat, ended)?;
        let tokens = self.enc.tok.ids(&text, false)?;
        // The next policy turn needs room for at least one token.
        if u64::from(t.episode_tokens) + tokens.len() as u64 >= u64::from(env.max_episode_tokens) {
            return Ok(reply(Vec::new(), n, Some(Finish::Length)));
        }
        Ok(reply(tokens, n, None))
    }

    /// The environment turn's text carrying `results` (see the module
    /// docs): by the chat template when the prompt was `chat`; `ended`:
    /// the policy's turn ended with the end-of-turn token.
    fn render_results(&self, results: &[String], chat: bool, ended: bool) -> Result<String, String> {
        let t = &self.enc.template;
        if !chat {
            return Ok(results
                .iter()
                .map(|r| format!("<tool_response>{r}</tool_response>"))
                .collect());
        }
        let mut msgs = vec![
            serde_json::json!({"role": "user", "content": "-"}),
            serde_json::json!({"role": "assistant", "content": SENTINEL}),
        ];
        msgs.extend(
            results
                .iter()
                .map(|r| serde_json::json!({"role": "tool", "content": r})),
        );
        let text = t.render(&msgs, None, true)?;
        let at = text.rfind(SENTINEL).ok_or_else(|| {
            format!(
                "chat template ({}) does not render the assistant's content as given, so the tool results cannot follow the policy's turn",
                t.source
            )
        })?;
        let tail = &text[at + SENTINEL.len()..];
        Ok(match tail.strip_prefix(t.eos_token.as_str()) {
            Some(rest) if ended && !t.eos_token.is_empty() => rest.to_string(),
            _ => tail.to_string(),
        })
    }
}
