//! Names of the coordinator's environment variables a spec may ask for:
//! the ones `rl.verifier.env` passes to the verifier program, and the one
//! `rl.engine.api_key_env` reads the engine's key from. A spec is written
//! by whoever may submit a job, and what it reaches is shown back to them
//! (the verifier's output, the engine's requests), so it may never name
//! Accrue's own settings and secrets: every `ACCRUE_*` variable, the admin
//! and worker tokens among them.

/// The prefix of Accrue's own variables, refused in any case.
pub const ACCRUE_PREFIX: &str = "ACCRUE_";

/// Why a spec may not name variable `name`, or None when it may: a
/// portable name (`[A-Za-z_][A-Za-z0-9_]*`) outside Accrue's own.
pub fn refused(name: &str) -> Option<String> {
    let mut chars = name.chars();
    let portable = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !portable {
        return Some(format!(
            "{name:?} is not an environment variable name (letters, digits and _, not starting with a digit)"
        ));
    }
    let upper = name.to_ascii_uppercase();
    upper.starts_with(ACCRUE_PREFIX).then(|| {
        format!(
            "{name:?} is one of Accrue's own variables ({ACCRUE_PREFIX}*, which hold its tokens and settings): a spec may not read them"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_names_outside_accrue_s_own_pass() {
        for ok in ["PATH", "_X", "hf_token", "OPENAI_API_KEY", "A1", "ACCRUE"] {
            assert_eq!(refused(ok), None, "{ok}");
        }
        for no in [
            "",
            "1A",
            "A-B",
            "A B",
            "A=B",
            "É",
            "ACCRUE_ADMIN_TOKEN",
            "Accrue_x",
        ] {
            assert!(refused(no).is_some(), "{no:?}");
        }
    }
}
