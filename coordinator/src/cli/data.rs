//! `accrue data …`: dataset utilities that run locally, without a coordinator.

use std::process::ExitCode;

use super::{SynthArgs, SynthTask};

/// `accrue data synth`.
pub fn synth(args: &SynthArgs) -> anyhow::Result<ExitCode> {
    match args.task {
        SynthTask::Arithmetic => {
            // TODO(lead): wire to crate::data::synth_arithmetic(&args.out,
            // args.seed, args.rows) (written on another branch) and print
            // what it wrote.
            let _ = (&args.out, args.seed, args.rows);
            anyhow::bail!("not wired yet: accrue data synth --task arithmetic")
        }
    }
}
