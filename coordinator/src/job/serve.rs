//! `[rl.serve]`: a streamed policy-gradient job whose rollouts come from
//! an agent harness driving the job's own policy through an
//! OpenAI-compatible chat-completions endpoint (issue 36). The harness
//! (the `verifiers` library, the `openai` client in a user's loop) calls
//! `/v1/chat/completions` on the coordinator's `--serve-listen`; the job's
//! workers generate between training steps; each episode's calls are
//! stitched into one rollout that the harness's reward report admits into
//! the job's stream. The endpoint is `crate::shell::openai`, the episode
//! record `crate::rl::endpoint`, the core's queue `crate::rl::serve`.

use serde::{Deserialize, Serialize};

/// `[rl.serve]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSection {
    /// Chat-completion calls waiting for a generation round at once; one
    /// more is answered 429 (the harness retries).
    #[serde(default = "default_max_waiting")]
    pub max_waiting: u32,
    /// Episodes recorded and not yet reported at once; a call opening one
    /// more is answered 429.
    #[serde(default = "default_max_open_episodes")]
    pub max_open_episodes: u32,
    /// Calls decoded together in one round on each worker (0: the
    /// worker's default).
    #[serde(default)]
    pub max_batch: u32,
}

fn default_max_waiting() -> u32 {
    256
}

fn default_max_open_episodes() -> u32 {
    4096
}

impl Default for ServeSection {
    fn default() -> Self {
        ServeSection {
            max_waiting: default_max_waiting(),
            max_open_episodes: default_max_open_episodes(),
            max_batch: 0,
        }
    }
}

impl ServeSection {
    /// Reports every problem as (field, message).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.max_waiting == 0 {
            bad("rl.serve.max_waiting", "must be at least 1".into());
        }
        if self.max_open_episodes == 0 {
            bad("rl.serve.max_open_episodes", "must be at least 1".into());
        }
    }
}
