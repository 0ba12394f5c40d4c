//! The job's objective as the worker trains it (resolved by the
//! coordinator, converted by `crate::convert`).

use super::dpo::DpoParams;
use super::pg::PgParams;

/// What the step's policy-gradient loss is divided by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Normalization {
    /// The step's loss tokens T (from the plan).
    Token,
    /// Each sequence's mean over its tokens, divided by the step's sequences.
    Sequence,
    /// A constant (Dr. GRPO).
    Constant(f64),
}

/// The job's objective, resolved from `[objective]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Sft,
    Dpo {
        params: DpoParams,
        /// Reference log-probs from a frozen model on the worker rather
        /// than from the plan's cached pass.
        live: bool,
    },
    Pg {
        params: PgParams,
        norm: Normalization,
        live: bool,
    },
}

impl Objective {
    /// Whether the worker keeps a frozen copy of the initial model.
    pub fn live_reference(&self) -> bool {
        matches!(
            self,
            Objective::Dpo { live: true, .. } | Objective::Pg { live: true, .. }
        )
    }
}
