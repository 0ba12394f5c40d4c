//! Token-level policy-gradient loss over rollouts (GRPO family). For a loss
//! token with current log-prob `π`, advantage `A` (per sequence, from the
//! coordinator), optional generating-policy log-prob `π_old` and reference
//! log-prob `ρ`:
//! - ratio `r = exp(π − π_old)` (1 when no old log-prob is given: on-policy);
//! - clipped surrogate `−min(r·A, clip(r, 1−ε, 1+ε)·A)`;
//! - plus `kl_coef · (exp(ρ − π) − (ρ − π) − 1)` (the k3 estimator) when a
//!   reference is given.
//!
//! With `off_policy = "tis"` (token-level truncated importance sampling,
//! for stale rollouts) the surrogate is instead `−w·A` with
//! `w = min(exp(π − π_old), C)` held constant: the REINFORCE gradient
//! `−w·A·∇π` weighted by the truncated ratio. This is verl's
//! `compute_policy_loss_vanilla` with `tis_imp_ratio_cap = C` (Yao et al.
//! 2025, "Your efficient RL framework secretly brings you off-policy RL
//! training"; AIPO in Llama-RL) where the trainer's own `old_log_prob` is
//! the current weights' (one optimizer step per batch of rollouts: its
//! PPO ratio is 1 with gradient `∇π`) and `rollout_log_probs` are `π_old`.
//!
//! The step's loss is the sum of token losses divided by the normaliser
//! the spec chooses (T, sequences, or a constant) — never by the number of
//! microbatches or ranks.

/// One token's inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenIn {
    pub logp: f64,
    pub old_logp: Option<f64>,
    pub ref_logp: Option<f64>,
    pub advantage: f64,
}

/// One token's loss (before normalisation) and `∂loss/∂logp`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenOut {
    pub loss: f64,
    pub d_logp: f64,
    pub clipped: bool,
    pub kl: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PgParams {
    pub clip_ratio: f64,
    pub kl_coef: f64,
    pub off_policy: OffPolicy,
}

/// How the ratio to the rollout's policy enters a token's loss.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum OffPolicy {
    /// PPO's clipped ratio.
    #[default]
    Clip,
    /// Truncated importance weight `min(ratio, cap)`, held constant.
    Tis { cap: f64 },
}

pub fn token(t: &TokenIn, k: &PgParams) -> TokenOut {
    let ratio = t.old_logp.map_or(1.0, |old| (t.logp - old).exp());
    let a = t.advantage;
    let (surrogate, d_surrogate, was_clipped) = match k.off_policy {
        OffPolicy::Clip => clipped_surrogate(ratio, a, k.clip_ratio),
        // The weight is data: no gradient through it (verl multiplies
        // by the detached ratio).
        OffPolicy::Tis { cap } => {
            let w = ratio.min(cap);
            (-w * a, -w * a, ratio > cap)
        }
    };
    let (kl, d_kl) = match t.ref_logp {
        Some(r) if k.kl_coef != 0.0 => {
            let x = r - t.logp;
            (x.exp() - x - 1.0, 1.0 - x.exp())
        }
        _ => (0.0, 0.0),
    };
    TokenOut {
        loss: surrogate + k.kl_coef * kl,
        d_logp: d_surrogate + k.kl_coef * d_kl,
        clipped: was_clipped,
        kl,
    }
}

/// PPO's `−min(r·A, clip(r, 1−ε, 1+ε)·A)`, its derivative with respect
/// to the log-prob, and whether the clipped term was taken.
fn clipped_surrogate(ratio: f64, a: f64, eps: f64) -> (f64, f64, bool) {
    let unclipped = ratio * a;
    let clipped = ratio.clamp(1.0 - eps, 1.0 + eps) * a;
    // −min(u, c): the gradient flows through the unclipped term only when
    // it is the smaller one (or the ratio is inside the interval).
    if unclipped <= clipped {
        (-unclipped, -a * ratio, false)
    } else {
        (-clipped, 0.0, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivative_matches_finite_differences_in_every_regime() {
        let k = PgParams {
            clip_ratio: 0.2,
            kl_coef: 0.05,
            off_policy: OffPolicy::Clip,
        };
        for (old, a) in [(-1.0, 1.5), (-1.3, 1.5), (-0.7, -2.0), (-1.05, -0.5)] {
            let t = TokenIn {
                logp: -1.0,
                old_logp: Some(old),
                ref_logp: Some(-0.8),
                advantage: a,
            };
            let out = token(&t, &k);
            let e = 1e-6;
            let f = |d: f64| {
                token(
                    &TokenIn {
                        logp: t.logp + d,
                        ..t
                    },
                    &k,
                )
                .loss
            };
            let num = (f(e) - f(-e)) / (2.0 * e);
            assert!(
                (num - out.d_logp).abs() < 1e-6,
                "{old} {a}: {num} vs {out:?}"
            );
        }
    }

    #[test]
    fn on_policy_is_reinforce_and_clipping_stops_the_gradient() {
        let k = PgParams {
            clip_ratio: 0.2,
            kl_coef: 0.0,
            off_policy: OffPolicy::Clip,
        };
        let on = token(
            &TokenIn {
                logp: -2.0,
                old_logp: None,
                ref_logp: None,
                advantage: 0.7,
            },
            &k,
        );
        assert_eq!((on.loss, on.d_logp, on.clipped), (-0.7, -0.7, false));
        // ratio e^0.5 > 1.2 with A > 0: clipped, no gradient.
        let off = token(
            &TokenIn {
                logp: -1.5,
                old_logp: Some(-2.0),
                ref_logp: None,
                advantage: 1.0,
            },
            &k,
        );
        assert!(off.clipped);
        assert_eq!(off.d_logp, 0.0);
        assert!((off.loss + 1.2).abs() < 1e-12);
    }

    #[test]
    fn tis_weights_the_reinforce_gradient_by_the_truncated_ratio() {
        let k = PgParams {
            clip_ratio: 0.2,
            kl_coef: 0.0,
            off_policy: OffPolicy::Tis { cap: 2.0 },
        };
        let at = |logp: f64, old: Option<f64>, a: f64| {
            token(
                &TokenIn {
                    logp,
                    old_logp: old,
                    ref_logp: None,
                    advantage: a,
                },
                &k,
            )
        };
        // ratio e^0.5 ≈ 1.65 < 2: weight is the ratio; PPO would clip it.
        let w = 0.5f64.exp();
        let inside = at(-1.5, Some(-2.0), 1.0);
        assert!((inside.d_logp + w).abs() < 1e-12 && !inside.clipped);
        // ratio e^2 > 2: weight 2, flagged.
        let capped = at(-1.0, Some(-3.0), -0.5);
        assert!((capped.d_logp - 1.0).abs() < 1e-12 && capped.clipped);
        assert!((capped.loss - 1.0).abs() < 1e-12);
        // Small ratios are not raised (truncation is one-sided).
        let low = at(-3.0, Some(-1.0), 1.0);
        assert!((low.d_logp + (-2.0f64).exp()).abs() < 1e-12);
        // On-policy it is plain REINFORCE, as the clipped objective.
        let on = at(-2.0, None, 0.7);
        assert_eq!((on.loss, on.d_logp), (-0.7, -0.7));
    }
}
