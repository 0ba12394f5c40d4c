//! Step metrics: workers report sums, the coordinator turns the sums of all
//! ranks into the step's weighted means (DESIGN.md "The math": means only
//! after summing over every microbatch and rank).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::stream::cursor::Cursor;

/// One rank's metric sums for one step (mirror of `accrue.v1.MetricSums`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MetricSums {
    pub loss_sum: f64,
    pub loss_tokens: u64,
    pub tokens: u64,
    pub documents: u64,
    pub padding_tokens: u64,
    pub microbatches: u32,
    pub compute_s: f64,
    pub collective_s: f64,
    pub optimizer_s: f64,
    pub idle_s: f64,
    pub grad_norm: f64,
    /// Preference pairs trained (DPO): when any rank reports some, the
    /// step's loss and extras are means per pair, else per loss token.
    #[serde(default)]
    pub pairs: u64,
    /// Objective metrics as sums, each a mean over the step's denominator
    /// once every rank's are added (`rewards/chosen`, `kl`, …).
    pub extra: BTreeMap<String, f64>,
    /// Training FLOPs of the tokens this rank processed.
    #[serde(default)]
    pub model_flops: f64,
    /// GPU workers: the rank's peak GPU memory during the step (bytes its
    /// tensors held, and bytes the device had in use for it); 0 on CPU.
    #[serde(default)]
    pub gpu_memory_peak_allocated_bytes: u64,
    #[serde(default)]
    pub gpu_memory_peak_reserved_bytes: u64,
    /// The same sums per source (by the job's source index).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<u32, SourceSums>,
}

/// One source's sums on one rank.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SourceSums {
    pub loss_sum: f64,
    pub loss_tokens: u64,
    pub tokens: u64,
    pub documents: u64,
    /// Preference pairs among them (see [`MetricSums::pairs`]).
    #[serde(default)]
    pub pairs: u64,
    /// Objective metrics as sums over the same denominator as the loss.
    #[serde(default)]
    pub extra: BTreeMap<String, f64>,
    /// Evaluations of rollouts: their rewards' sum and how many, the mean
    /// reward being per rollout (not per loss token).
    #[serde(default)]
    pub reward_sum: f64,
    #[serde(default)]
    pub rollouts: u64,
}

impl SourceSums {
    /// Adds `o`'s sums to these.
    pub fn add(&mut self, o: &SourceSums) {
        self.loss_sum += o.loss_sum;
        self.loss_tokens += o.loss_tokens;
        self.tokens += o.tokens;
        self.documents += o.documents;
        self.pairs += o.pairs;
        self.reward_sum += o.reward_sum;
        self.rollouts += o.rollouts;
        for (k, v) in &o.extra {
            *self.extra.entry(k.clone()).or_default() += v;
        }
    }

    /// The source's means, formed as the step's are (per loss token, or
    /// per pair when it holds pairs); an evaluation of rollouts adds their
    /// mean `reward` and `count/rollouts`.
    pub fn means(&self) -> SourceMetrics {
        let (loss, mut extra) = means(self.loss_sum, self.loss_tokens, self.pairs, &self.extra);
        if self.rollouts > 0 {
            extra.insert("reward".into(), self.reward_sum / self.rollouts as f64);
            extra.insert(count_name("rollouts"), self.rollouts as f64);
        }
        SourceMetrics {
            loss,
            loss_tokens: self.loss_tokens,
            tokens: self.tokens,
            docs: self.documents,
            extra,
        }
    }
}

/// One source's part of a step (or of an evaluation).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SourceMetrics {
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub loss: f64,
    pub loss_tokens: u64,
    pub tokens: u64,
    pub docs: u64,
    #[serde(default, deserialize_with = "crate::core::nonfinite::map")]
    pub extra: BTreeMap<String, f64>,
}

/// The weighted means of `loss_sum` and of each of `extra`'s sums: per
/// pair when there are `pairs`, else per loss token. The pairs themselves
/// are reported as a count (`pairs`).
pub fn means(
    loss_sum: f64,
    loss_tokens: u64,
    pairs: u64,
    extra: &BTreeMap<String, f64>,
) -> (f64, BTreeMap<String, f64>) {
    let denom = match pairs {
        0 => loss_tokens as f64,
        p => p as f64,
    };
    let mean = |v: f64| if denom > 0.0 { v / denom } else { 0.0 };
    let mut out: BTreeMap<String, f64> = extra.iter().map(|(k, &v)| (k.clone(), mean(v))).collect();
    if pairs > 0 {
        out.insert("pairs".into(), pairs as f64);
    }
    (mean(loss_sum), out)
}

impl MetricSums {
    /// Whether the loss and gradient norm are finite (what a step needs to
    /// commit; objective extras may legitimately be undefined).
    pub fn is_finite(&self) -> bool {
        self.loss_sum.is_finite() && self.grad_norm.is_finite()
    }
}

/// A committed step as written to metrics.jsonl and sent to watchers.
/// Non-finite values are written as JSON `null` and read back as NaN
/// (`crate::core::nonfinite`), so the record always stays readable.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub loss: f64,
    pub tokens: u64,
    pub loss_tokens: u64,
    pub docs: u64,
    pub microbatches: u32,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub lr: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub grad_norm: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub tokens_per_s_per_worker: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub padding_fraction: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub step_time_s: f64,
    pub world_size: u32,
    pub generation: u64,
    /// Per-rank time split, summed over ranks.
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub compute_s: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub collective_s: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub optimizer_s: f64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub idle_s: f64,
    pub cursor: Cursor,
    /// Objective-specific metrics: means over pairs (DPO) or loss tokens
    /// (PG); `pairs` and the counts the coordinator adds (`count/*`) are
    /// sums.
    #[serde(deserialize_with = "crate::core::nonfinite::map")]
    pub extra: BTreeMap<String, f64>,
    pub unix_ms: i64,
    /// Σ training FLOPs of the ranks.
    #[serde(default, deserialize_with = "crate::core::nonfinite::f64")]
    pub model_flops: f64,
    /// Model FLOPs utilisation, `model_flops / (step_time_s · peak_flops)`
    /// (0 when the peak is unknown).
    #[serde(default, deserialize_with = "crate::core::nonfinite::f64")]
    pub mfu: f64,
    /// Per source name: its documents' loss, tokens and documents. Their
    /// sums add up to the step's (the loss: Σ loss·loss_tokens / Σ
    /// loss_tokens is the step's loss).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, SourceMetrics>,
    /// The largest rank's peak GPU memory in the step (0 on CPU: not
    /// written then).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_memory_peak_allocated_bytes: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_memory_peak_reserved_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A count's name among a step's metrics (`count/...`): a sum, never a
/// mean, whatever the step's denominator.
pub fn count_name(what: &str) -> String {
    format!("count/{what}")
}

impl StepMetrics {
    /// Records a count the coordinator keeps (not the workers' sums).
    pub fn count(&mut self, what: &str, n: u64) {
        self.extra.insert(count_name(what), n as f64);
    }
}

/// What the plan says about a step, independent of the workers' reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepFacts<'a> {
    pub step: u64,
    pub lr: f64,
    pub world_size: u32,
    pub generation: u64,
    /// Microbatches over all ranks, padding ones included.
    pub microbatches: u32,
    pub step_time_s: f64,
    pub unix_ms: i64,
    /// Σ peak FLOP/s of the generation's workers; 0 when any is unknown.
    pub peak_flops: f64,
    /// The job's source names by index (what `MetricSums::sources` keys).
    pub source_names: &'a [String],
}

/// Combines the ranks' sums into the step's metrics. `loss` is Σ loss /
/// Σ loss tokens (a token-weighted mean); objectives whose loss is per pair
/// report their `pairs` and are normalised by that instead.
pub fn aggregate(facts: StepFacts<'_>, cursor: Cursor, ranks: &[MetricSums]) -> StepMetrics {
    let mut total = MetricSums::default();
    for r in ranks {
        for (s, v) in &r.sources {
            total.sources.entry(*s).or_default().add(v);
        }
        total.loss_sum += r.loss_sum;
        total.loss_tokens += r.loss_tokens;
        total.tokens += r.tokens;
        total.documents += r.documents;
        total.padding_tokens += r.padding_tokens;
        total.compute_s += r.compute_s;
        total.collective_s += r.collective_s;
        total.optimizer_s += r.optimizer_s;
        total.idle_s += r.idle_s;
        total.model_flops += r.model_flops;
        // Memory is per device: the largest rank is the one that runs out.
        total.gpu_memory_peak_allocated_bytes = total
            .gpu_memory_peak_allocated_bytes
            .max(r.gpu_memory_peak_allocated_bytes);
        total.gpu_memory_peak_reserved_bytes = total
            .gpu_memory_peak_reserved_bytes
            .max(r.gpu_memory_peak_reserved_bytes);
        total.pairs += r.pairs;
        for (k, v) in &r.extra {
            *total.extra.entry(k.clone()).or_default() += v;
        }
    }
    // Every rank computes the same global norm; take the largest so a
    // disagreeing rank cannot hide a spike.
    let grad_norm = ranks.iter().map(|r| r.grad_norm).fold(0.0, |a: f64, b| {
        if a.is_nan() || b.is_nan() {
            f64::NAN
        } else {
            a.max(b)
        }
    });
    // Means over the step's one denominator: pairs (DPO), else loss tokens.
    let (loss, extra) = means(total.loss_sum, total.loss_tokens, total.pairs, &total.extra);
    let tokens_per_s = if facts.step_time_s > 0.0 {
        total.tokens as f64 / facts.step_time_s
    } else {
        0.0
    };
    let padded = total.tokens + total.padding_tokens;
    let mfu = if facts.step_time_s > 0.0 && facts.peak_flops > 0.0 {
        total.model_flops / (facts.step_time_s * facts.peak_flops)
    } else {
        0.0
    };
    StepMetrics {
        step: facts.step,
        loss,
        tokens: total.tokens,
        loss_tokens: total.loss_tokens,
        docs: total.documents,
        microbatches: facts.microbatches,
        lr: facts.lr,
        grad_norm,
        tokens_per_s,
        tokens_per_s_per_worker: tokens_per_s / facts.world_size.max(1) as f64,
        padding_fraction: if padded > 0 {
            total.padding_tokens as f64 / padded as f64
        } else {
            0.0
        },
        step_time_s: facts.step_time_s,
        world_size: facts.world_size,
        generation: facts.generation,
        compute_s: total.compute_s,
        collective_s: total.collective_s,
        optimizer_s: total.optimizer_s,
        idle_s: total.idle_s,
        cursor,
        extra,
        unix_ms: facts.unix_ms,
        model_flops: total.model_flops,
        mfu,
        sources: total
            .sources
            .iter()
            .map(|(s, v)| {
                (
                    facts
                        .source_names
                        .get(*s as usize)
                        .cloned()
                        .unwrap_or_else(|| format!("source-{s}")),
                    v.means(),
                )
            })
            .collect(),
        gpu_memory_peak_allocated_bytes: total.gpu_memory_peak_allocated_bytes,
        gpu_memory_peak_reserved_bytes: total.gpu_memory_peak_reserved_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> StepFacts<'static> {
        StepFacts {
            source_names: &[],
            step: 3,
            lr: 1e-3,
            world_size: 2,
            generation: 1,
            microbatches: 4,
            step_time_s: 2.0,
            unix_ms: 0,
            peak_flops: 0.0,
        }
    }

    #[test]
    fn loss_is_token_weighted_not_mean_of_rank_means() {
        // Rank 0: 10 tokens at loss 1.0; rank 1: 30 tokens at loss 3.0.
        let a = MetricSums {
            loss_sum: 10.0,
            loss_tokens: 10,
            tokens: 12,
            ..Default::default()
        };
        let b = MetricSums {
            loss_sum: 90.0,
            loss_tokens: 30,
            tokens: 28,
            padding_tokens: 10,
            ..Default::default()
        };
        let m = aggregate(facts(), Cursor::default(), &[a, b]);
        assert!((m.loss - 2.5).abs() < 1e-12, "Σℓ/ΣT = 100/40, not (1+3)/2");
        assert_eq!(m.tokens, 40);
        assert!((m.tokens_per_s - 20.0).abs() < 1e-12);
        assert!((m.tokens_per_s_per_worker - 10.0).abs() < 1e-12);
        assert!((m.padding_fraction - 0.2).abs() < 1e-12);
    }

    #[test]
    fn mfu_is_summed_flops_over_step_time_and_summed_peak() {
        let a = MetricSums {
            model_flops: 3e12,
            ..Default::default()
        };
        let b = MetricSums {
            model_flops: 1e12,
            ..Default::default()
        };
        let mut f = facts();
        f.peak_flops = 2.0 * 5e12; // two workers of 5 TFLOP/s
        let m = aggregate(f, Cursor::default(), &[a.clone(), b.clone()]);
        assert_eq!(m.model_flops, 4e12);
        // 4e12 FLOPs in 2 s on 10 TFLOP/s of peak.
        assert!((m.mfu - 0.2).abs() < 1e-12, "{}", m.mfu);
        // Unknown peak: no MFU rather than a division by zero.
        let m = aggregate(facts(), Cursor::default(), &[a, b]);
        assert_eq!(m.mfu, 0.0);
    }

    #[test]
    fn pair_objectives_normalise_by_pairs() {
        let mut a = MetricSums {
            loss_sum: 3.0,
            loss_tokens: 100,
            ..Default::default()
        };
        a.pairs = 2;
        let mut b = a.clone();
        b.loss_sum = 1.0;
        b.pairs = 2;
        let m = aggregate(facts(), Cursor::default(), &[a, b]);
        assert!((m.loss - 1.0).abs() < 1e-12);
        assert_eq!(m.extra["pairs"], 4.0);
    }

    #[test]
    fn objective_extras_are_means_over_pairs_counts_stay_sums() {
        let mut a = MetricSums {
            loss_sum: 2.0,
            pairs: 3,
            ..Default::default()
        };
        a.extra.insert("rewards/accuracy".into(), 3.0);
        let mut b = MetricSums {
            pairs: 1,
            ..Default::default()
        };
        b.extra.insert("rewards/accuracy".into(), 0.0);
        let m = aggregate(facts(), Cursor::default(), &[a, b]);
        assert_eq!(m.extra["rewards/accuracy"], 0.75);
        assert_eq!(m.extra["pairs"], 4.0);
    }

    /// Issue 16: the per-source sums add up to the step's, and the step's
    /// loss is exactly the loss-token-weighted mean of the sources' losses.
    #[test]
    fn per_source_sums_add_up_to_the_step() {
        let src = |loss_sum: f64, loss_tokens: u64, docs: u64| SourceSums {
            loss_sum,
            loss_tokens,
            tokens: loss_tokens + 3,
            documents: docs,
            ..Default::default()
        };
        let rank = |parts: Vec<(u32, SourceSums)>| {
            let mut m = MetricSums::default();
            for (_, p) in &parts {
                m.loss_sum += p.loss_sum;
                m.loss_tokens += p.loss_tokens;
                m.tokens += p.tokens;
                m.documents += p.documents;
            }
            m.sources = parts.into_iter().collect();
            m
        };
        let a = rank(vec![(0, src(12.0, 10, 2)), (2, src(4.5, 3, 1))]);
        let b = rank(vec![(0, src(30.0, 20, 3)), (1, src(7.0, 7, 2))]);
        let names = ["chat".to_string(), "code".into(), "math".into()];
        let mut f = facts();
        f.source_names = &names;
        let m = aggregate(f, Cursor::default(), &[a, b]);
        assert_eq!(
            m.sources.keys().collect::<Vec<_>>(),
            ["chat", "code", "math"]
        );
        let tokens: u64 = m.sources.values().map(|s| s.loss_tokens).sum();
        let docs: u64 = m.sources.values().map(|s| s.docs).sum();
        let all: u64 = m.sources.values().map(|s| s.tokens).sum();
        assert_eq!((tokens, docs, all), (m.loss_tokens, m.docs, m.tokens));
        let weighted: f64 = m
            .sources
            .values()
            .map(|s| s.loss * s.loss_tokens as f64)
            .sum::<f64>()
            / tokens as f64;
        assert!(
            (weighted - m.loss).abs() < 1e-12,
            "{weighted} vs {}",
            m.loss
        );
        assert!((m.sources["chat"].loss - 42.0 / 30.0).abs() < 1e-12);
    }
}
