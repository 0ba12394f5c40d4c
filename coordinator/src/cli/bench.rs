//! `accrue bench …`: benchmarks run in-process, without a coordinator.

use std::process::ExitCode;

use super::PackingArgs;

/// `accrue bench packing`.
pub fn packing(args: &PackingArgs) -> anyhow::Result<ExitCode> {
    // TODO(lead): wire to crate::bench::packing (written on another branch):
    // run it on `args.data` and print its report as a table, or as JSON when
    // `args.json` is set.
    let _ = (args.json, &args.data);
    anyhow::bail!("not wired yet: accrue bench packing")
}
