//! Picks a sequence's next token from its logits: greedy, or temperature,
//! top-k then top-p (nucleus) sampling in that order (as HF's
//! `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`), from
//! a private generator seeded per request, so a completion depends on its
//! seed, prompt and weights only, never on the batch it was decoded in.
//!
//! The log-prob reported with a token is `log_softmax` of the raw logits
//! (before temperature, top-k and top-p) at that token: the log-prob a
//! training forward of the same weights gives it, which the trainer uses
//! as `old_logprobs`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::types::SamplingParams;

/// One sequence's sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(seed: u64) -> Sampler {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next token of `logits` (one row, the whole vocabulary) and its
    /// log-prob under the raw distribution, `logits[token] − lse` with
    /// `lse` the row's log-sum-exp ([`log_sum_exp`], or libtorch's).
    pub fn sample(&mut self, params: &SamplingParams, logits: &[f32], lse: f32) -> (usize, f32) {
        let token = if params.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.draw(params, logits)
        };
        (token, logits[token] - lse)
    }

    fn draw(&mut self, params: &SamplingParams, logits: &[f32]) -> usize {
        let t = params.temperature as f64;
        let mut cand: Vec<usize> = (0..logits.len()).collect();
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let k = params.top_k as usize;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit);
            cand.truncate(k);
        }
        // Sorted only where the nucleus needs an order.
        if params.top_p < 1.0 {
            cand.sort_unstable_by(by_logit);
        }
        let max = cand
            .iter()
            .map(|&i| logits[i] as f64)
            .fold(f64::MIN, f64::max);
        let mut w: Vec<f64> = cand
            .iter()
            .map(|&i| ((logits[i] as f64 - max) / t).exp())
            .collect();
        if params.top_p < 1.0 {
            let total: f64 = w.iter().sum();
            let mut cum = 0.0;
            // The smallest prefix holding at least top_p of the mass (one
            // token at least).
            let keep = w
                .iter()
                .position(|p| {
                    cum += p / total;
                    cum >= params.top_p as f64
                })
                .map_or(w.len(), |i| i + 1);
            w.truncate(keep);
        }
        let total: f64 = w.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (i, p) in w.iter().enumerate() {
            if u < *p {
                return cand[i];
            }
            u -= p;
        }
        // Rounding left u at the end: the last kept token.
        cand[w.len() - 1]
    }
}

/// The first index of the largest logit (`torch.argmax`'s tie rule).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// `log Σ exp(logits)`, in f64 then rounded.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (sum.ln() + max) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_largest_logit_and_reports_its_raw_log_prob() {
        let logits = [0.5f32, 2.0, -1.0, 2.0];
        let (tok, lp) = Sampler::new(1).sample(&params(0.0, 0, 1.0), &logits, log_sum_exp(&logits));
        assert_eq!(tok, 1);
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (2.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_only_ever_pick_kept_tokens() {
        // Probabilities ∝ exp: token 3 holds ~0.64, token 1 ~0.24.
        let logits = [0.0f32, 2.0, -3.0, 3.0, 1.0];
        let mut s = Sampler::new(7);
        let lse = log_sum_exp(&logits);
        for _ in 0..500 {
            let (t, _) = s.sample(&params(1.0, 2, 1.0), &logits, lse);
            assert!(t == 3 || t == 1, "top-k 2 picked {t}");
            let (t, _) = s.sample(&params(1.0, 0, 0.5), &logits, lse);
            assert_eq!(t, 3, "top-p 0.5 keeps the top token only");
            let (t, _) = s.sample(&params(1.0, 0, 0.8), &logits, lse);
            assert!(t == 3 || t == 1, "top-p 0.8 picked {t}");
        }
    }

    #[test]
    fn sampling_follows_the_tempered_distribution() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut s = Sampler::new(3);
        let n = 40_000;
        let t = 2.0f64;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(&params(t as f32, 0, 1.0), &logits, 0.0).0] += 1;
        }
        let z: f64 = logits.iter().map(|&x| (x as f64 / t).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = (logits[i] as f64 / t).exp() / z;
            let got = c as f64 / n as f64;
            // ~4 standard errors.
            assert!(
                (got - p).abs() < 4.0 * (p * (1.0 - p) / n as f64).sqrt(),
                "token {i}: {got} vs {p}"
            );
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(seed);
            (0..20)
                .map(|_| s.sample(&params(0.9, 10, 0.9), &logits, 0.0).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }
}
