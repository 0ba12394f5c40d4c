//! `accrue data …`: dataset utilities that run locally, without a coordinator.

use std::process::ExitCode;

use anyhow::Context;

use super::output::outln;
use super::{SynthArgs, SynthTask};

/// `accrue data synth`.
pub fn synth(args: &SynthArgs) -> anyhow::Result<ExitCode> {
    match args.task {
        SynthTask::Arithmetic => {
            let files = crate::data::synth_arithmetic(&args.out, args.seed, args.rows as usize)
                .with_context(|| format!("writing synthetic data to {}", args.out.display()))?;
            for f in [&files.sft, &files.dpo, &files.rollouts] {
                outln!("wrote {}", f.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SynthTask::ArithmeticRollouts => {
            let groups = (args.rows as usize).div_ceil(crate::data::synth::GROUP_SIZE);
            let file = crate::data::synth::synth_arithmetic_rollouts(&args.out, args.seed, groups)
                .with_context(|| format!("writing synthetic rollouts to {}", args.out.display()))?;
            outln!("wrote {} ({groups} groups)", file.display())?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
