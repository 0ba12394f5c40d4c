//! `[optimizer]`: AdamW's hyperparameters, gradient clipping, the
//! learning-rate schedule and which parameters take no weight decay. The
//! rate of a given step is `crate::job::settings`'s (live changes included).

use serde::{Deserialize, Serialize};

use crate::job::limits;
use crate::job::section::bound;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    #[default]
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    #[default]
    Constant,
    Linear,
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    #[serde(default)]
    pub kind: OptimizerKind,
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "default_eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
    /// Global L2 norm; 0 disables.
    #[serde(default = "default_grad_clip")]
    pub grad_clip: f64,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub schedule: Schedule,
    /// Parameters whose HF name contains one of these substrings take no
    /// weight decay (HF Trainer and open-instruct exclude biases and norm
    /// weights); `[]` decays every parameter.
    #[serde(default = "default_no_decay")]
    pub no_decay: Vec<String>,
}

fn default_no_decay() -> Vec<String> {
    vec!["bias".into(), "norm".into()]
}

fn default_lr() -> f64 {
    1e-4
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn default_eps() -> f64 {
    1e-8
}
fn default_grad_clip() -> f64 {
    1.0
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adamw,
            lr: default_lr(),
            betas: default_betas(),
            eps: default_eps(),
            weight_decay: 0.0,
            grad_clip: default_grad_clip(),
            warmup_steps: 0,
            schedule: Schedule::Constant,
            no_decay: default_no_decay(),
        }
    }
}

impl OptimizerSection {
    /// The checks of `[optimizer]` alone; a warmup longer than the job is
    /// `rules::warmup_within_steps`.
    pub fn validate(&self, bad: &mut impl FnMut(&str, String)) {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bad(
                "optimizer.lr",
                format!("must be a positive number, got {}", self.lr),
            );
        }
        for (i, beta) in self.betas.iter().enumerate() {
            if !(0.0..1.0).contains(beta) {
                bad(
                    &format!("optimizer.betas[{i}]"),
                    format!("must be in [0, 1), got {beta}"),
                );
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            bad(
                "optimizer.eps",
                format!("must be a positive number, got {}", self.eps),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            bad(
                "optimizer.weight_decay",
                format!("must be ≥ 0, got {}", self.weight_decay),
            );
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            bad(
                "optimizer.grad_clip",
                format!("must be ≥ 0 (0 disables), got {}", self.grad_clip),
            );
        }
        bound(
            bad,
            "optimizer.warmup_steps",
            self.warmup_steps,
            limits::MAX_STEPS,
            "steps",
        );
        if let Some(i) = self.no_decay.iter().position(String::is_empty) {
            bad(
                &format!("optimizer.no_decay[{i}]"),
                "an empty pattern would match every parameter; use weight_decay = 0".into(),
            );
        }
    }
}
