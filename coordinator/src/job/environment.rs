//! `[rl.env]`: the environment a multi-turn episode runs against (issue
//! 36), and its checks. The episodes themselves are `crate::rl::episode`;
//! the tools and tool-call parsing `crate::rl::tools`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::job::env_names;
use crate::job::section::check_seconds;

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
    /// A program of the user's speaking the JSON-lines episode protocol
    /// (`crate::rl::env_command`): one process per job, its episodes
    /// multiplexed by id.
    Command,
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
    /// `command`: the program and its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// `command`: seconds the program has to answer a turn's steps (all
    /// of the round's open episodes; default 60, at most a day).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// `command`: the coordinator's environment variables the program
    /// sees besides the fixed few (as `rl.verifier.env`); never `ACCRUE_*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// `command`: the directory the program runs in; relative to the
    /// spec's, which it is by default (set at submit, so a restarted
    /// coordinator runs it in the same place).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<PathBuf>,
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
            command: Vec::new(),
            timeout_s: None,
            env: Vec::new(),
            workdir: None,
        }
    }
}

impl EnvSection {
    /// `command`: makes the program's directory absolute, the spec's
    /// directory `base` when unset.
    pub fn resolve_paths(&mut self, base: &Path) {
        if self.kind == EnvKind::Command {
            self.workdir = Some(match self.workdir.take() {
                Some(d) if d.is_relative() => base.join(d),
                Some(d) => d,
                None => base.to_path_buf(),
            });
        }
    }

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
        match self.kind {
            EnvKind::Command if self.command.is_empty() => bad(
                "rl.env.command",
                "required for kind = \"command\": the program and its arguments".into(),
            ),
            EnvKind::Tools => {
                for (field, given) in [
                    ("rl.env.command", !self.command.is_empty()),
                    ("rl.env.timeout_s", self.timeout_s.is_some()),
                    ("rl.env.env", !self.env.is_empty()),
                    ("rl.env.workdir", self.workdir.is_some()),
                ] {
                    if given {
                        bad(field, "only applies to kind = \"command\"".into());
                    }
                }
            }
            EnvKind::Command => {}
        }
        for (i, name) in self.env.iter().enumerate() {
            if let Some(message) = env_names::refused(name) {
                bad(&format!("rl.env.env[{i}]"), message);
            }
        }
        if let Some(t) = self.timeout_s {
            check_seconds(bad, "rl.env.timeout_s", t);
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
        let out = problems("kind = \"command\"\nenv = [\"ACCRUE_ADMIN_TOKEN\"]\ntimeout_s = -1");
        assert_eq!(out.len(), 3, "{out:?}");
        assert!(out[0].starts_with("rl.env.command: required"));
        assert!(out[1].starts_with("rl.env.env[0]:"));
        assert!(out[2].starts_with("rl.env.timeout_s:"));
        let out = problems("command = [\"x\"]");
        assert_eq!(out, ["rl.env.command: only applies to kind = \"command\""]);
    }
}
