//! `accrue completions SHELL` and `accrue man`: generated from the CLI's
//! own definition (clap_complete, clap_mangen), so they cannot drift.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

/// Writes the completion script for `shell` to `out`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn Write) -> anyhow::Result<ExitCode> {
    clap_complete::generate(shell, &mut crate::args::command(), "accrue", out);
    Ok(ExitCode::SUCCESS)
}

/// Writes `accrue.1` and one `accrue-SUB.1` per subcommand into `dir`, or
/// the top page to `out` without one.
pub fn man(dir: Option<&Path>, out: &mut dyn Write) -> anyhow::Result<ExitCode> {
    let cmd = crate::args::command();
    let Some(dir) = dir else {
        clap_mangen::Man::new(cmd).render(out)?;
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, page: clap::Command| -> anyhow::Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut buf = Vec::new();
        clap_mangen::Man::new(page).render(&mut buf)?;
        std::fs::write(&path, buf).with_context(|| format!("writing {}", path.display()))
    };
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("accrue-{}", sub.get_name());
        write(&name, sub.clone().name(name.clone()))?;
    }
    write("accrue", cmd)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_name_every_subcommand() {
        for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh] {
            let mut out = Vec::new();
            completions(shell, &mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            for sub in crate::args::command().get_subcommands() {
                assert!(
                    text.contains(sub.get_name()),
                    "{shell}: no {}",
                    sub.get_name()
                );
            }
        }
    }

    #[test]
    fn man_pages_are_written_for_the_command_and_each_subcommand() {
        let dir = tempfile::tempdir().unwrap();
        man(Some(dir.path()), &mut std::io::sink()).unwrap();
        let top = std::fs::read_to_string(dir.path().join("accrue.1")).unwrap();
        assert!(
            top.starts_with(".ie") || top.contains(".TH accrue"),
            "{top}"
        );
        let submit = std::fs::read_to_string(dir.path().join("accrue-submit.1")).unwrap();
        assert!(submit.contains("\\-\\-new"), "{submit}");
    }
}
