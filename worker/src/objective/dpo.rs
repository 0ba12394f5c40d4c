//! The DPO family for one preference pair, as TRL's `DPOTrainer` computes
//! it (`dpo_loss`), plus open-instruct's length-normalised `dpo_norm`.
//!
//! With `π` and `ρ` the policy and reference log-probs of a sequence
//! (summed over its loss tokens; averaged per token for `ipo` and
//! `dpo_norm`, as TRL and open-instruct do) and
//! `h = (π_c − π_r) − (ρ_c − ρ_r)`:
//! - sigmoid: `−(1−ε)·log σ(βh) − ε·log σ(−βh)` (ε = label smoothing);
//! - ipo: `(h − 1/(2β))²`;
//! - rewards: `β·(π − ρ)` per sequence over SUMMED log-probs whatever the
//!   loss (as TRL 1.x logs them), accuracy `1[r_c > r_r]`; `logps/*` are
//!   the summed policy log-probs.
//!
//! TRL 1.x names `dpo_norm` `sigmoid_norm`, and dropped label smoothing from
//! `sigmoid`; we keep the conservative-DPO smoothing open-instruct and
//! earlier TRL apply (ε = 0 is plain DPO).

use super::math::{log_sigmoid, sigmoid};

/// Which loss (mirror of the spec's `objective.loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    Sigmoid,
    Ipo,
    DpoNorm,
}

impl DpoLoss {
    /// Whether log-probs are averaged over the sequence's loss tokens.
    pub fn averages(self) -> bool {
        matches!(self, DpoLoss::Ipo | DpoLoss::DpoNorm)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoParams {
    pub beta: f64,
    pub loss: DpoLoss,
    pub label_smoothing: f64,
}

/// One pair's inputs: summed log-probs and loss-token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairLogps {
    pub policy_chosen: f64,
    pub policy_rejected: f64,
    pub ref_chosen: f64,
    pub ref_rejected: f64,
    pub chosen_tokens: u64,
    pub rejected_tokens: u64,
}

/// One pair's loss, metrics, and the derivative of the loss with respect
/// to the SUMMED policy log-probs of each sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairOut {
    pub loss: f64,
    pub d_chosen: f64,
    pub d_rejected: f64,
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    /// Summed policy log-probs.
    pub logp_chosen: f64,
    pub logp_rejected: f64,
}

impl PairOut {
    pub fn margin(&self) -> f64 {
        self.reward_chosen - self.reward_rejected
    }

    pub fn correct(&self) -> bool {
        self.reward_chosen > self.reward_rejected
    }
}

/// The loss of one pair (not yet divided by the step's pair count P).
pub fn pair(p: &PairLogps, k: &DpoParams) -> PairOut {
    let (sc, sr) = if k.loss.averages() {
        (
            1.0 / p.chosen_tokens.max(1) as f64,
            1.0 / p.rejected_tokens.max(1) as f64,
        )
    } else {
        (1.0, 1.0)
    };
    let (pc, pr) = (p.policy_chosen * sc, p.policy_rejected * sr);
    let (rc, rr) = (p.ref_chosen * sc, p.ref_rejected * sr);
    let h = (pc - pr) - (rc - rr);
    let (loss, d_h) = match k.loss {
        DpoLoss::Sigmoid | DpoLoss::DpoNorm => {
            let z = k.beta * h;
            let ls = k.label_smoothing;
            let loss = -(1.0 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z);
            // d/dz of −log σ(z) is −σ(−z); of −log σ(−z) is σ(z).
            let d_z = -(1.0 - ls) * sigmoid(-z) + ls * sigmoid(z);
            (loss, d_z * k.beta)
        }
        DpoLoss::Ipo => {
            let t = h - 1.0 / (2.0 * k.beta);
            (t * t, 2.0 * t)
        }
    };
    PairOut {
        loss,
        d_chosen: d_h * sc,
        d_rejected: -d_h * sr,
        reward_chosen: k.beta * (p.policy_chosen - p.ref_chosen),
        reward_rejected: k.beta * (p.policy_rejected - p.ref_rejected),
        logp_chosen: p.policy_chosen,
        logp_rejected: p.policy_rejected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logps() -> PairLogps {
        PairLogps {
            policy_chosen: -12.0,
            policy_rejected: -15.5,
            ref_chosen: -12.5,
            ref_rejected: -14.0,
            chosen_tokens: 6,
            rejected_tokens: 9,
        }
    }

    /// The analytic derivatives agree with central differences.
    #[test]
    fn derivatives_match_finite_differences() {
        for loss in [DpoLoss::Sigmoid, DpoLoss::Ipo, DpoLoss::DpoNorm] {
            let k = DpoParams {
                beta: 0.3,
                loss,
                label_smoothing: if loss == DpoLoss::Ipo { 0.0 } else { 0.1 },
            };
            let p = logps();
            let out = pair(&p, &k);
            let e = 1e-6;
            let f = |dc: f64, dr: f64| {
                let mut q = p;
                q.policy_chosen += dc;
                q.policy_rejected += dr;
                pair(&q, &k).loss
            };
            let num_c = (f(e, 0.0) - f(-e, 0.0)) / (2.0 * e);
            let num_r = (f(0.0, e) - f(0.0, -e)) / (2.0 * e);
            assert!(
                (num_c - out.d_chosen).abs() < 1e-7,
                "{loss:?} {num_c} {out:?}"
            );
            assert!(
                (num_r - out.d_rejected).abs() < 1e-7,
                "{loss:?} {num_r} {out:?}"
            );
        }
    }

    #[test]
    fn sigmoid_dpo_values() {
        let k = DpoParams {
            beta: 0.1,
            loss: DpoLoss::Sigmoid,
            label_smoothing: 0.0,
        };
        let out = pair(&logps(), &k);
        // h = (−12 + 15.5) − (−12.5 + 14) = 2; loss = −log σ(0.2).
        assert!((out.loss - (1.0 + (-0.2f64).exp()).ln()).abs() < 1e-12);
        assert!((out.reward_chosen - 0.05).abs() < 1e-12);
        assert!((out.reward_rejected + 0.15).abs() < 1e-12);
        assert!(out.correct());
        assert!((out.margin() - 0.2).abs() < 1e-12);
    }
}
