//! `[rl.env]`: the environment a multi-turn episode runs against (issue
//! 36), and its checks. The episodes themselves are `crate::rl::episode`;
//! the tools and tool-call parsing `crate::rl::tools`.

use serde::{Deserialize, Serialize};

/// Which environment answers the policy's turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EnvKind {
    /// Built-in tools: a policy turn with tool calls
    /// (`<tool_call>{"name": …, "arguments": …}</tool_call>`) gets their
    /// results as the next environment turn; a turn without one ends the
    /// episode and is the answer the verifier scores.
    #[default]
    Tools,
}

/// `[rl.env]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    #[serde(default)]
    pub kind: EnvKind,
    /// `tools`: the tools the policy may call (`"calculator"`); all the
    /// built-in ones by default.
    #[serde(default = "default_tools")]
    pub tools: Vec<String>,
    /// Policy turns per episode: an episode still calling tools after
    /// this many ends there (counted as truncated).
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Tokens of an episode after its prompt (policy and environment
    /// turns): a turn that would pass it ends the episode (truncated).
    /// Per-turn length is `rl.sampling.max_new_tokens`.
    #[serde(default = "default_max_episode_tokens")]
    pub max_episode_tokens: u32,
}

/// The built-in tools (`crate::rl::tools`).
pub const TOOLS: [&str; 1] = ["calculator"];

fn default_tools() -> Vec<String> {
    TOOLS.iter().map(|t| t.to_string()).collect()
}

fn default_max_turns() -> u32 {
    4
}

fn default_max_episode_tokens() -> u32 {
    4096
}

impl Default for EnvSection {
    fn default() -> Self {
        EnvSection {
            kind: EnvKind::Tools,
            tools: default_tools(),
            max_turns: default_max_turns(),
            max_episode_tokens: default_max_episode_tokens(),
        }
    }
}

impl EnvSection {
    /// Reports every problem as (field, message).
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if self.max_turns == 0 {
            bad("rl.env.max_turns", "must be at least 1".into());
        }
        if self.max_episode_tokens == 0 {
            bad("rl.env.max_episode_tokens", "must be at least 1".into());
        }
        if self.tools.is_empty() {
            bad(
                "rl.env.tools",
                format!(
                    "must name at least one tool (built in: {})",
                    TOOLS.join(", ")
                ),
            );
        }
        for (i, t) in self.tools.iter().enumerate() {
            if !TOOLS.contains(&t.as_str()) {
                bad(
                    &format!("rl.env.tools[{i}]"),
                    format!(
                        "{t:?} is not a built-in tool (built in: {})",
                        TOOLS.join(", ")
                    ),
                );
            } else if self.tools[..i].contains(t) {
                bad(
                    &format!("rl.env.tools[{i}]"),
                    format!("{t:?} is listed twice"),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(toml_text: &str) -> Vec<String> {
        let s: EnvSection = toml::from_str(toml_text).unwrap();
        let mut out = Vec::new();
        s.validate(&mut |f: &str, m: String| out.push(format!("{f}: {m}")));
        out
    }

    #[test]
    fn defaults_pass_and_bad_fields_are_named() {
        assert!(problems("").is_empty());
        let out = problems("max_turns = 0\ntools = [\"calculator\", \"search\", \"calculator\"]\n");
        assert_eq!(
            out,
            [
                "rl.env.max_turns: must be at least 1",
                "rl.env.tools[1]: \"search\" is not a built-in tool (built in: calculator)",
                "rl.env.tools[2]: \"calculator\" is listed twice",
            ]
        );
        assert!(toml::from_str::<EnvSection>("kind = \"sandbox\"").is_err());
    }
}
