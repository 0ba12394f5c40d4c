//! Objective math on per-sequence and per-token scalars (no tensors): the
//! DPO family over pairs and the policy-gradient loss over rollouts. Each
//! returns the loss and its derivative with respect to the log-probs, which
//! the trainer turns into per-token weights for the chunked LM head (the
//! gradient of `Σ_t w_t·nll_t` with respect to `logp_t` is `−w_t`), so the
//! `[tokens, vocab]` logits are never materialised for these objectives
//! either.

pub mod dpo;
pub mod head;
pub mod microbatch;
pub mod pg;

/// Numerically stable log σ(x).
pub fn log_sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

/// σ(x).
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sigmoid_is_stable_at_the_extremes() {
        assert!((log_sigmoid(0.0) - 0.5f64.ln()).abs() < 1e-15);
        assert!((log_sigmoid(-800.0) + 800.0).abs() < 1e-9);
        assert!(log_sigmoid(800.0).abs() < 1e-300);
        assert!((sigmoid(3.0) + sigmoid(-3.0) - 1.0).abs() < 1e-15);
    }
}

/// The job's objective, resolved from `[objective]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Sft,
    Dpo {
        params: dpo::DpoParams,
        /// Reference log-probs from a frozen model on the worker rather
        /// than from the plan's cached pass.
        live: bool,
    },
    Pg {
        params: pg::PgParams,
        norm: microbatch::Normalization,
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
