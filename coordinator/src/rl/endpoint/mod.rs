//! A served job's episodes as its OpenAI-compatible endpoint records them
//! (`[rl.serve]`, issue 36): each chat-completion call is rendered into
//! the policy's prompt tokens, and the calls of one episode (named by the
//! `x-accrue-episode` header or the `user` field) are stitched into ONE
//! token sequence — the sequence the policy was really conditioned on —
//! so that the harness's reward report admits exactly what was generated.
//!
//! Stitching (token in, token out): an episode's first call is rendered
//! whole by the chat template. A later call must repeat the episode's
//! messages so far and the assistant's replies as they were returned
//! (compared by role, content, tool calls and call ids); only the new
//! messages after the last reply are rendered, by the template's text
//! that follows an assistant turn ([`ChatTemplate::render_followup`]),
//! and appended to the recorded tokens. A call that edits the history is
//! refused (naming the first message that differs): the harness starts a
//! new episode for another conversation. So re-rendering never changes
//! an earlier turn's tokens (templates that drop earlier reasoning, for
//! instance, would otherwise train on text the policy never saw).
//!
//! The rollout: the episode's tokens, loss on the policy's sampled tokens
//! only (the prompt and every inserted message are context), each with
//! the log-prob its sampling policy gave it; its policy version is its
//! oldest call's (staleness is judged against the oldest policy that
//! sampled any of it). Its group is the report's `group`, else the
//! first call's prompt: episodes of one prompt form a group.
//!
//! Pure state behind one mutex (the shell calls it off the core's state
//! lock); bounded by `rl.serve.max_open_episodes`. Nothing is persisted:
//! a coordinator restart loses the episodes not yet reported (their
//! rollouts were never admitted), never an admitted one.
//!
//! [`ChatTemplate::render_followup`]: crate::stream::data::template::ChatTemplate::render_followup

pub mod chat;

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::{json, Value as Json};

use self::chat::{assistant_message, render_message, same_message, ApiError, ChatRequest};
use crate::job::rl::SamplingSection;
use crate::job::spec::JobSpec;
use crate::rl::generation::Finish;
use crate::rl::serve::Served;
use crate::stream::data::format::Encoder;
use crate::stream::doc::{Rollout, Sequence, IGNORE_INDEX};

/// Reported episodes whose answers are kept for a repeated report.
const KEPT_REPORTS: usize = 16_384;

/// One call to generate: the episode's tokens so far and how to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub episode: String,
    /// 1-based.
    pub turn: u32,
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingSection,
    pub seed: Option<u64>,
    pub stop_ids: Vec<u32>,
    request: ChatRequest,
}

/// A reward report (`POST …/episodes/{id}/reward`).
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub reward: f64,
    pub group: Option<String>,
}

impl Report {
    pub fn parse(body: &Json) -> Result<Report, ApiError> {
        let o = body
            .as_object()
            .ok_or_else(|| ApiError::bad("body", "must be a JSON object"))?;
        for k in o.keys() {
            if !["reward", "group"].contains(&k.as_str()) {
                return Err(ApiError::bad(
                    k,
                    "is not a field of a reward report (reward, group)",
                ));
            }
        }
        let reward = o
            .get("reward")
            .and_then(Json::as_f64)
            .filter(|r| r.is_finite())
            .ok_or_else(|| ApiError::bad("reward", "required: a finite number"))?;
        let group = match o.get("group") {
            None | Some(Json::Null) => None,
            Some(Json::String(g)) if !g.is_empty() => Some(g.clone()),
            Some(_) => return Err(ApiError::bad("group", "must be a non-empty string")),
        };
        Ok(Report { reward, group })
    }
}

/// One episode's record.
#[derive(Debug, Clone, Default)]
struct Episode {
    /// Every token so far (prompt, replies, inserted messages).
    ids: Vec<u32>,
    /// Per token: sampled by the policy (trained on).
    policy: Vec<bool>,
    /// Per token: its sampling log-prob (0 where not sampled).
    logprobs: Vec<f32>,
    prompt_len: usize,
    /// The conversation so far, the last reply included, as returned.
    messages: Vec<Json>,
    tools: Option<Json>,
    turns: u32,
    tool_calls: u32,
    /// The oldest policy version of its calls.
    version: Option<u64>,
    /// The last reply ended with the end-of-turn token.
    ended: bool,
    /// A call or a report is in flight.
    busy: bool,
    /// Tokens before the call in flight's new messages.
    call_from: usize,
}

#[derive(Default)]
struct Book {
    open: HashMap<String, Episode>,
    /// Answers of reported episodes, for a repeated report (oldest first).
    reported: HashMap<String, Json>,
    reported_order: VecDeque<String>,
    next_anonymous: u64,
}

/// A served job's tokenizer, template and episodes.
pub struct Endpoint {
    enc: Encoder,
    defaults: SamplingSection,
    /// `data.max_tokens`: an episode's whole length.
    max_tokens: u32,
    max_open: usize,
    book: Mutex<Book>,
}

impl Endpoint {
    /// The job's tokenizer and chat template (one is required: calls are
    /// chat messages).
    pub fn load(spec: &JobSpec, model_vocab: u32) -> Result<Endpoint, String> {
        let enc =
            crate::stream::data::encoder(&spec.data, model_vocab).map_err(|e| e.to_string())?;
        enc.template.require().map_err(|e| e.to_string())?;
        let serve = spec.rl.serve.clone().unwrap_or_default();
        Ok(Endpoint::new(
            enc,
            spec.rl.sampling.clone().unwrap_or_default(),
            spec.data.max_tokens,
            serve.max_open_episodes,
        ))
    }

    /// An endpoint rendering with `enc`, sampling with `defaults` where a
    /// call names nothing, episodes of at most `max_tokens` tokens and at
    /// most `max_open` of them open.
    pub fn new(
        enc: Encoder,
        defaults: SamplingSection,
        max_tokens: u32,
        max_open: u32,
    ) -> Endpoint {
        Endpoint {
            enc,
            defaults,
            max_tokens,
            max_open: max_open as usize,
            book: Mutex::new(Book::default()),
        }
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks and renders a call; `episode` is the header's id, if any.
    /// The episode is busy until [`Self::finish`] or [`Self::abandon`].
    pub fn begin(&self, body: &Json, episode: Option<String>) -> Result<Turn, ApiError> {
        let request = ChatRequest::parse(body, &self.defaults)?;
        let mut book = self.book();
        let id = match episode.or_else(|| request.user.clone()) {
            Some(id) => id,
            None => {
                book.next_anonymous += 1;
                format!("anon-{}", book.next_anonymous)
            }
        };
        if id.len() > 256 {
            return Err(ApiError::bad("user", "an episode id is at most 256 bytes"));
        }
        if book.reported.contains_key(&id) {
            return Err(ApiError::status(
                409,
                format!("episode {id} was reported: it takes no more calls (use a new id)"),
            ));
        }
        let open = book.open.len();
        if !book.open.contains_key(&id) {
            if open >= self.max_open {
                return Err(ApiError::status(
                    429,
                    format!("{open} episodes are open (rl.serve.max_open_episodes): report some before starting more"),
                ));
            }
            book.open.insert(id.clone(), Episode::default());
        }
        let ep = book.open.get_mut(&id).expect("inserted above");
        if ep.busy {
            return Err(ApiError::status(
                409,
                format!("episode {id} has a call or report in flight"),
            ));
        }
        let fresh = ep.turns == 0;
        let ids = match self.render(ep, &request, &id) {
            Ok(ids) => ids,
            Err(e) => {
                // A refused first call opens nothing.
                if fresh {
                    book.open.remove(&id);
                }
                return Err(e);
            }
        };
        let ep = book.open.get_mut(&id).expect("inserted above");
        let room = self.max_tokens as usize - (ep.ids.len() + ids.len());
        if fresh {
            ep.prompt_len = ids.len();
            ep.tools = request.tools.clone();
        }
        ep.call_from = ep.ids.len();
        ep.ids.extend(&ids);
        ep.policy.extend(std::iter::repeat_n(false, ids.len()));
        ep.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        ep.busy = true;
        let mut sampling = request.sampling.clone();
        // The episode's whole length is bounded by data.max_tokens: a
        // reply is cut there (finish_reason "length").
        sampling.max_new_tokens = request
            .max_tokens
            .unwrap_or(sampling.max_new_tokens)
            .min(room.min(u32::MAX as usize) as u32);
        Ok(Turn {
            episode: id,
            turn: ep.turns + 1,
            prompt_ids: ep.ids.clone(),
            sampling,
            seed: request.seed,
            stop_ids: vec![self.enc.eos_id],
            request,
        })
    }

    /// A call's new tokens (the whole prompt for an episode's first call),
    /// leaving room for at least one token of reply.
    fn render(&self, ep: &Episode, r: &ChatRequest, id: &str) -> Result<Vec<u32>, ApiError> {
        let ids = match ep.turns {
            0 => self.first(r)?,
            _ => self.next(ep, r, id)?,
        };
        let total = ep.ids.len() + ids.len();
        if total >= self.max_tokens as usize {
            return Err(ApiError::bad(
                "messages",
                format!("episode {id} would be {total} tokens before its reply, and data.max_tokens = {} bounds a whole episode", self.max_tokens),
            ));
        }
        Ok(ids)
    }

    /// The first call's prompt: the whole conversation rendered.
    fn first(&self, r: &ChatRequest) -> Result<Vec<u32>, ApiError> {
        if r.messages.last().and_then(|m| m["role"].as_str()) == Some("assistant") {
            return Err(ApiError::bad(
                &format!("messages[{}]", r.messages.len() - 1),
                "the last message is the assistant's: continuing a reply is not served",
            ));
        }
        let msgs: Vec<Json> = r.messages.iter().map(render_message).collect();
        let text = self
            .enc
            .template
            .render(&msgs, r.tools.as_ref(), true)
            .map_err(|e| ApiError::bad("messages", e))?;
        self.enc
            .tok
            .ids(&text, false)
            .map_err(|e| ApiError::status(500, e))
    }

    /// A later call's new tokens: the messages after the episode's last
    /// reply, rendered as what follows an assistant turn.
    fn next(&self, ep: &Episode, r: &ChatRequest, id: &str) -> Result<Vec<u32>, ApiError> {
        if r.tools != ep.tools {
            return Err(ApiError::bad(
                "tools",
                format!(
                    "differ from episode {id}'s first call (its prompt was rendered with them)"
                ),
            ));
        }
        let known = ep.messages.len();
        if let Some(i) = (0..known.min(r.messages.len()))
            .find(|&i| !same_message(&r.messages[i], &ep.messages[i]))
            .or((r.messages.len() <= known).then_some(r.messages.len()))
        {
            return Err(ApiError::bad(
                &format!("messages[{i}]"),
                format!(
                    "episode {id} recorded {known} messages (the assistant's last reply included) and this call does not extend them: {}; a call must repeat an episode's messages and replies as returned — start a new episode for another conversation",
                    if i < r.messages.len() { "this one differs" } else { "nothing new follows them" }
                ),
            ));
        }
        let new = &r.messages[known..];
        if let Some(k) = new
            .iter()
            .position(|m| m["role"].as_str() == Some("assistant"))
        {
            return Err(ApiError::bad(
                &format!("messages[{}]", known + k),
                "an assistant message the policy did not sample cannot join an episode",
            ));
        }
        let msgs: Vec<Json> = new.iter().map(render_message).collect();
        let text = self
            .enc
            .template
            .render_followup(&msgs, ep.ended)
            .map_err(|e| ApiError::bad("messages", e))?;
        self.enc
            .tok
            .ids(&text, false)
            .map_err(|e| ApiError::status(500, e))
    }

    /// A call that will not complete (its generation failed or its caller
    /// went away): its episode takes calls again, from before it.
    pub fn abandon(&self, turn: &Turn) {
        let mut book = self.book();
        let Some(ep) = book.open.get_mut(&turn.episode) else {
            return;
        };
        if ep.turns == 0 {
            book.open.remove(&turn.episode);
            return;
        }
        let before = ep.call_from;
        ep.ids.truncate(before);
        ep.policy.truncate(before);
        ep.logprobs.truncate(before);
        ep.busy = false;
    }

    /// Records the call's completion and builds the response.
    pub fn finish(&self, turn: Turn, served: &Served, created: u64) -> Result<Json, ApiError> {
        let c = &served.completion;
        let eos = self.enc.eos_id;
        let ended = c.finish == Finish::Stop && c.token_ids.last() == Some(&eos);
        let body_ids = if ended {
            &c.token_ids[..c.token_ids.len() - 1]
        } else {
            &c.token_ids[..]
        };
        let text = self
            .enc
            .tok
            .decode(body_ids)
            .map_err(|e| ApiError::status(500, e))?;
        let (message, calls) =
            assistant_message(&text, &format!("{}_{}", short(&turn.episode), turn.turn));
        let mut book = self.book();
        let Some(ep) = book.open.get_mut(&turn.episode) else {
            return Err(ApiError::status(
                409,
                format!("episode {} was forgotten while its call ran", turn.episode),
            ));
        };
        ep.ids.extend(&c.token_ids);
        ep.policy
            .extend(std::iter::repeat_n(true, c.token_ids.len()));
        ep.logprobs.extend(&c.logprobs);
        ep.turns = turn.turn;
        ep.tool_calls += calls as u32;
        ep.version = Some(
            ep.version
                .map_or(served.policy_version, |v| v.min(served.policy_version)),
        );
        ep.ended = ended;
        ep.messages = turn.request.messages.clone();
        ep.messages.push(message.clone());
        ep.busy = false;
        drop(book);
        let finish = match (c.finish, calls) {
            (Finish::Length, _) => "length",
            (Finish::Stop, 0) => "stop",
            (Finish::Stop, _) => "tool_calls",
        };
        let r = &turn.request;
        let logprobs = r.logprobs.then(|| {
            let content: Vec<Json> = c
                .token_ids
                .iter()
                .zip(&c.logprobs)
                .map(|(&t, &lp)| {
                    let token = if r.tokens_as_ids {
                        format!("token_id:{t}")
                    } else {
                        self.enc.tok.decode_all(&[t]).unwrap_or_default()
                    };
                    let bytes: Vec<u8> = token.as_bytes().to_vec();
                    json!({"token": token, "logprob": lp, "bytes": bytes, "top_logprobs": []})
                })
                .collect();
            json!({"content": content})
        });
        let mut choice =
            json!({"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs});
        let mut out = json!({
            "id": format!("chatcmpl-{}-{}", short(&turn.episode), turn.turn),
            "object": "chat.completion",
            "created": created,
            "model": r.model,
            "choices": [],
            "usage": {"prompt_tokens": turn.prompt_ids.len(), "completion_tokens": c.token_ids.len(),
                      "total_tokens": turn.prompt_ids.len() + c.token_ids.len()},
            "accrue": {"episode": turn.episode, "turn": turn.turn, "policy_version": served.policy_version},
        });
        if r.return_token_ids {
            choice["token_ids"] = json!(c.token_ids);
            out["prompt_token_ids"] = json!(turn.prompt_ids);
        }
        out["choices"] = json!([choice]);
        Ok(out)
    }

    /// Takes an episode's reward: its rollout, to be admitted; the
    /// episode stays busy until [`Self::reported`] or [`Self::unreport`].
    /// `Ok(Err(answer))`: it was reported before (the first answer).
    pub fn report(&self, id: &str, r: &Report) -> Result<Result<(Rollout, Stats), Json>, ApiError> {
        let mut book = self.book();
        if let Some(answer) = book.reported.get(id) {
            return Ok(Err(answer.clone()));
        }
        let Some(ep) = book.open.get_mut(id) else {
            return Err(ApiError::status(
                404,
                format!("episode {id} is unknown: no call named it (or its coordinator restarted, which loses unreported episodes)"),
            ));
        };
        if ep.busy {
            return Err(ApiError::status(
                409,
                format!("episode {id} has a call or report in flight"),
            ));
        }
        if ep.turns == 0 {
            return Err(ApiError::status(
                409,
                format!("episode {id} has no completed call"),
            ));
        }
        ep.busy = true;
        let labels = ep
            .ids
            .iter()
            .zip(&ep.policy)
            .map(|(&t, &p)| if p { t as i32 } else { IGNORE_INDEX })
            .collect();
        let group = r.group.clone().unwrap_or_else(|| {
            format!(
                "prompt-{:016x}",
                fnv(ep.ids[..ep.prompt_len].iter().copied())
            )
        });
        let stats = Stats {
            turns: ep.turns,
            tool_calls: ep.tool_calls,
            policy_tokens: ep.policy.iter().filter(|&&p| p).count(),
            tokens: ep.ids.len(),
        };
        Ok(Ok((
            Rollout {
                seq: Sequence::new(ep.ids.clone(), labels),
                reward: r.reward,
                group,
                policy_version: ep.version.unwrap_or(0),
                old_logprobs: Some(ep.logprobs.clone()),
                routing: None,
            },
            stats,
        )))
    }

    /// The episode's rollout was admitted (`answer` is what the reporter
    /// got): it is closed, and a repeated report gets the same answer.
    pub fn reported(&self, id: &str, answer: Json) {
        let mut book = self.book();
        book.open.remove(id);
        book.reported.insert(id.to_string(), answer);
        book.reported_order.push_back(id.to_string());
        while book.reported_order.len() > KEPT_REPORTS {
            if let Some(old) = book.reported_order.pop_front() {
                book.reported.remove(&old);
            }
        }
    }

    /// The rollout was not admitted (refused): the episode may be
    /// reported again.
    pub fn unreport(&self, id: &str) {
        if let Some(ep) = self.book().open.get_mut(id) {
            ep.busy = false;
        }
    }

    /// Episodes recorded and not yet reported.
    pub fn open_episodes(&self) -> usize {
        self.book().open.len()
    }
}

/// What a report's answer tells about its episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub turns: u32,
    pub tool_calls: u32,
    pub policy_tokens: usize,
    pub tokens: usize,
}

/// An id's FNV-1a, short: response and tool-call ids (each byte hashed
/// as a little-endian u32, as token ids are).
fn short(id: &str) -> String {
    format!("{:08x}", fnv(id.bytes().map(u32::from)) as u32)
}

/// FNV-1a of token ids, each as its 4 little-endian bytes.
fn fnv(ids: impl IntoIterator<Item = u32>) -> u64 {
    ids.into_iter()
        .flat_map(u32::to_le_bytes)
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
}

#[cfg(test)]
mod tests;
