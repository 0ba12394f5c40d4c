//! `accrue bench packing`: the step planner ([`accrue_coordinator::stream::plan::solve`],
//! best-fit-decreasing + rank balancing) against the open-instruct
//! collator's packing (complete documents in arrival order, a new
//! microbatch when the next does not fit, microbatches dealt round-robin to
//! ranks) on document-length distributions: real datasets' lengths passed
//! in, plus a seeded synthetic log-normal one that is always included.
//!
//! For every dataset × max_tokens × docs_per_step × world_size × packer it
//! plans consecutive steps and prints one JSON object ([`PackingRow`]) per
//! line. Documents longer than `max_tokens` are excluded up front and
//! counted (`docs_overlong_excluded`), never truncated. Dropped and
//! truncated documents are counted by auditing each solution
//! ([`accrue_coordinator::stream::plan::audit`]), not assumed.

use std::io::Write;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use accrue_coordinator::stream::plan::{
    audit, item_cost, lower_bound_per_rank, normalizers, solve, Microbatch, PackItem, PackProblem,
    PackSolution, PlanError, SeqLens,
};

/// Name of the built-in synthetic dataset.
pub const SYNTHETIC_DATASET: &str = "synthetic-lognormal";
/// Median document length of the synthetic dataset, in tokens (a typical
/// SFT chat turn).
pub const SYNTHETIC_MEDIAN: f64 = 260.0;
/// σ of ln(length): with σ = 1.1 the mean is ≈ 475 tokens, p90 ≈ 1070,
/// p99 ≈ 3350 and about 1 in 10⁴ documents passes 16k — a long tail of the
/// kind real SFT mixtures have.
pub const SYNTHETIC_SIGMA: f64 = 1.1;
/// Synthetic lengths are clipped to 1..=this.
pub const SYNTHETIC_MAX_TOKENS: u32 = 16384;

/// What to run. [`Default`] is the full grid of the issue.
#[derive(Debug, Clone)]
pub struct PackingBenchOpts {
    /// Extra datasets: a name and each document's sequence lengths (a
    /// preference pair has two). The synthetic one is always added.
    pub datasets: Vec<(String, Vec<Vec<u32>>)>,
    /// Documents drawn for the synthetic dataset.
    pub synthetic_docs: usize,
    /// Seed of the synthetic dataset.
    pub seed: u64,
    /// Steps per configuration, at most (fewer when the data ends).
    pub max_steps: usize,
    pub max_tokens: Vec<u32>,
    pub docs_per_step: Vec<usize>,
    pub world_sizes: Vec<u32>,
}

impl Default for PackingBenchOpts {
    fn default() -> Self {
        PackingBenchOpts {
            datasets: Vec::new(),
            synthetic_docs: 256_000,
            seed: 0,
            max_steps: 2000,
            max_tokens: vec![2048, 4096, 16384],
            docs_per_step: vec![2, 8, 32, 128],
            world_sizes: vec![1, 8],
        }
    }
}

/// One output line: a configuration's results over all its steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackingRow {
    pub dataset: String,
    pub max_tokens: u32,
    pub docs_per_step: usize,
    pub world_size: u32,
    /// "bfd" (ours) or "greedy" (open-instruct baseline).
    pub packer: String,
    pub steps: usize,
    /// Documents planned (after the overlong exclusion).
    pub docs: usize,
    /// Dataset documents longer than max_tokens, left out before planning.
    pub docs_overlong_excluded: usize,
    /// Mean over steps.
    pub microbatches_per_rank: f64,
    /// Mean over steps of ceil(ceil(step_tokens / max_tokens) / world_size).
    pub lower_bound_microbatches_per_rank: f64,
    /// Max over steps of microbatches_per_rank − lower bound.
    pub excess_microbatches_max: u64,
    /// Steps where microbatches_per_rank > lower bound + 1.
    pub steps_over_lower_bound_plus_one: usize,
    /// Mean over steps with ≥ 2 microbatches per rank of
    /// max rank cost / mean rank cost (cost = Σ len + len²/ATTN_SCALE);
    /// null when no step qualifies.
    pub load_imbalance: Option<f64>,
    /// Max of the same ratio over those steps.
    pub load_imbalance_max: Option<f64>,
    /// Steps with ≥ 2 microbatches per rank.
    pub load_imbalance_steps: usize,
    /// Mean over the same steps of what no assignment can beat:
    /// max(1, costliest document / mean rank cost).
    pub load_imbalance_floor: Option<f64>,
    /// Mean of the ratio over all steps (1-microbatch steps included).
    pub load_imbalance_all_steps: f64,
    /// 1 − real tokens / (all microbatches, padding ones included, × max_tokens).
    pub padding_fraction: f64,
    pub docs_dropped: usize,
    pub docs_truncated: usize,
    pub microbatches_over_budget: usize,
    /// Documents planned per second of wall time spent in the packer.
    pub plan_docs_per_s: f64,
}

/// Log-normal document lengths (median [`SYNTHETIC_MEDIAN`], σ
/// [`SYNTHETIC_SIGMA`], clipped to 1..=[`SYNTHETIC_MAX_TOKENS`]), one
/// sequence each, from a ChaCha8 stream seeded with `seed`.
pub fn synthetic_lognormal(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box–Muller: u1 in (0, 1] keeps ln finite.
            let u1 = 1.0 - rng.random::<f64>();
            let u2 = rng.random::<f64>();
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            let len = (SYNTHETIC_MEDIAN * (SYNTHETIC_SIGMA * z).exp()).round();
            vec![len.clamp(1.0, f64::from(SYNTHETIC_MAX_TOKENS)) as u32]
        })
        .collect()
}

/// The open-instruct collator's packing, as the baseline: complete
/// documents in arrival order into the current microbatch, a new one when
/// the next does not fit; microbatch i goes to rank i mod W; ranks are
/// padded to equal counts (at least `min_microbatches_per_rank`).
pub fn greedy_baseline(problem: &PackProblem) -> Result<PackSolution, PlanError> {
    if problem.world_size == 0 {
        return Err(PlanError::NoRanks);
    }
    if problem.max_tokens == 0 {
        return Err(PlanError::ZeroBudget);
    }
    let max = u64::from(problem.max_tokens);
    let w = problem.world_size as usize;
    let mut bins: Vec<Microbatch> = Vec::new();
    for (i, item) in problem.items.iter().enumerate() {
        let t = item.tokens();
        if t > max {
            return Err(PlanError::Overlong {
                doc: item.doc,
                tokens: t,
                max_tokens: problem.max_tokens,
            });
        }
        if bins.last().is_none_or(|b| b.tokens + t > max) {
            bins.push(Microbatch::default());
        }
        let b = bins.last_mut().expect("just pushed");
        b.items.push(i);
        b.tokens += t;
        b.loss_tokens += item.loss_tokens;
        b.cost += item_cost(item);
    }
    let m = bins
        .len()
        .div_ceil(w)
        .max(problem.min_microbatches_per_rank as usize);
    let mut ranks: Vec<Vec<Microbatch>> = (0..w).map(|_| Vec::with_capacity(m)).collect();
    for (i, b) in bins.into_iter().enumerate() {
        ranks[i % w].push(b);
    }
    for r in &mut ranks {
        r.resize_with(m, Microbatch::default);
    }
    Ok(PackSolution {
        ranks,
        normalizers: normalizers(&problem.items),
    })
}

type Packer = fn(&PackProblem) -> Result<PackSolution, PlanError>;

const PACKERS: [(&str, Packer); 2] = [("bfd", solve), ("greedy", greedy_baseline)];

/// Runs the benchmark grid and writes one JSON [`PackingRow`] per line.
pub fn packing(opts: &PackingBenchOpts, out: &mut impl Write) -> anyhow::Result<()> {
    let synthetic = synthetic_lognormal(opts.synthetic_docs, opts.seed);
    let datasets = std::iter::once((SYNTHETIC_DATASET, &synthetic))
        .chain(opts.datasets.iter().map(|(n, d)| (n.as_str(), d)));
    for (name, docs) in datasets {
        for &max_tokens in &opts.max_tokens {
            let kept: Vec<&Vec<u32>> = docs
                .iter()
                .filter(|d| d.iter().map(|&l| u64::from(l)).sum::<u64>() <= u64::from(max_tokens))
                .collect();
            let excluded = docs.len() - kept.len();
            for &dps in &opts.docs_per_step {
                for &world_size in &opts.world_sizes {
                    let problems = steps(&kept, dps, opts.max_steps, max_tokens, world_size);
                    for (packer, pack) in PACKERS {
                        let mut row = measure(&problems, pack)?;
                        row.dataset = name.to_string();
                        row.max_tokens = max_tokens;
                        row.docs_per_step = dps;
                        row.world_size = world_size;
                        row.packer = packer.to_string();
                        row.docs_overlong_excluded = excluded;
                        writeln!(out, "{}", serde_json::to_string(&row)?)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Consecutive steps of `dps` documents (the last may be shorter).
fn steps(
    docs: &[&Vec<u32>],
    dps: usize,
    max_steps: usize,
    max_tokens: u32,
    world_size: u32,
) -> Vec<PackProblem> {
    docs.chunks(dps.max(1))
        .take(max_steps)
        .map(|chunk| PackProblem {
            groups: Vec::new(),
            items: chunk
                .iter()
                .enumerate()
                .map(|(doc, lens)| PackItem {
                    doc,
                    seq_lens: SeqLens::from_slice(lens)
                        .expect("a document has one sequence or a pair's two"),
                    loss_tokens: lens.iter().map(|&l| u64::from(l)).sum(),
                    is_pair: lens.len() == 2,
                })
                .collect(),
            max_tokens,
            world_size,
            min_microbatches_per_rank: 1,
        })
        .collect()
}

/// Plans every step (timed as a whole), then audits and scores them.
fn measure(problems: &[PackProblem], pack: Packer) -> anyhow::Result<PackingRow> {
    let start = Instant::now();
    let solutions = problems.iter().map(pack).collect::<Result<Vec<_>, _>>()?;
    let elapsed = start.elapsed().max(Duration::from_nanos(1));

    let mut row = PackingRow {
        dataset: String::new(),
        max_tokens: 0,
        docs_per_step: 0,
        world_size: 0,
        packer: String::new(),
        steps: problems.len(),
        docs: problems.iter().map(|p| p.items.len()).sum(),
        docs_overlong_excluded: 0,
        microbatches_per_rank: 0.0,
        lower_bound_microbatches_per_rank: 0.0,
        excess_microbatches_max: 0,
        steps_over_lower_bound_plus_one: 0,
        load_imbalance: None,
        load_imbalance_max: None,
        load_imbalance_steps: 0,
        load_imbalance_floor: None,
        load_imbalance_all_steps: 0.0,
        padding_fraction: 0.0,
        docs_dropped: 0,
        docs_truncated: 0,
        microbatches_over_budget: 0,
        plan_docs_per_s: 0.0,
    };
    row.plan_docs_per_s = row.docs as f64 / elapsed.as_secs_f64();
    let (mut real, mut slots) = (0u64, 0u64);
    let (mut imb_sum, mut imb_all_sum, mut floor_sum) = (0.0, 0.0, 0.0);
    for (p, s) in problems.iter().zip(&solutions) {
        let a = audit(p, s);
        row.docs_dropped += a.missing;
        row.docs_truncated += a.truncated;
        row.microbatches_over_budget += a.over_budget;
        let m = s.microbatches_per_rank() as u64;
        let lb = lower_bound_per_rank(s.normalizers.tokens, p.max_tokens, p.world_size);
        row.microbatches_per_rank += m as f64;
        row.lower_bound_microbatches_per_rank += lb as f64;
        row.excess_microbatches_max = row.excess_microbatches_max.max(m.saturating_sub(lb));
        row.steps_over_lower_bound_plus_one += usize::from(m > lb + 1);
        real += s.ranks.iter().flatten().map(|mb| mb.tokens).sum::<u64>();
        slots += m * u64::from(p.world_size) * u64::from(p.max_tokens);
        let costs: Vec<f64> = s
            .ranks
            .iter()
            .map(|r| r.iter().map(|mb| mb.cost).sum())
            .collect();
        let mean = costs.iter().sum::<f64>() / costs.len() as f64;
        let imb = if mean > 0.0 {
            costs.iter().cloned().fold(0.0, f64::max) / mean
        } else {
            1.0
        };
        imb_all_sum += imb;
        if m >= 2 {
            row.load_imbalance_steps += 1;
            imb_sum += imb;
            let costliest = p.items.iter().map(item_cost).fold(0.0, f64::max);
            floor_sum += (costliest / mean).max(1.0);
            row.load_imbalance_max = Some(row.load_imbalance_max.map_or(imb, |x: f64| x.max(imb)));
        }
    }
    let n = problems.len().max(1) as f64;
    row.microbatches_per_rank /= n;
    row.lower_bound_microbatches_per_rank /= n;
    row.load_imbalance_all_steps = imb_all_sum / n;
    if row.load_imbalance_steps > 0 {
        row.load_imbalance = Some(imb_sum / row.load_imbalance_steps as f64);
        row.load_imbalance_floor = Some(floor_sum / row.load_imbalance_steps as f64);
    }
    row.padding_fraction = if slots > 0 {
        1.0 - real as f64 / slots as f64
    } else {
        0.0
    };
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opts: &PackingBenchOpts) -> Vec<PackingRow> {
        let mut out = Vec::new();
        packing(opts, &mut out).unwrap();
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
            .collect()
    }

    #[test]
    fn packing_bench_writes_one_row_per_configuration() {
        let opts = PackingBenchOpts {
            datasets: vec![(
                "pairs".into(),
                vec![vec![300, 200], vec![5000, 10], vec![40, 40]],
            )],
            synthetic_docs: 3000,
            max_steps: 40,
            max_tokens: vec![2048, 4096],
            docs_per_step: vec![2, 32],
            world_sizes: vec![1, 8],
            ..PackingBenchOpts::default()
        };
        let rows = run(&opts);
        assert_eq!(rows.len(), 2 * 2 * 2 * 2 * 2);
        for r in &rows {
            assert!(r.dataset == SYNTHETIC_DATASET || r.dataset == "pairs");
            assert_eq!(
                (r.docs_dropped, r.docs_truncated, r.microbatches_over_budget),
                (0, 0, 0)
            );
            assert!(r.microbatches_per_rank >= r.lower_bound_microbatches_per_rank);
            assert!(r.padding_fraction >= 0.0 && r.padding_fraction < 1.0);
            assert!(r.plan_docs_per_s > 0.0);
            if r.packer == "bfd" {
                assert!(r.excess_microbatches_max <= 1, "{r:?}");
            }
        }
        let pairs_2048 = rows
            .iter()
            .find(|r| r.dataset == "pairs" && r.max_tokens == 2048)
            .unwrap();
        assert_eq!((pairs_2048.docs_overlong_excluded, pairs_2048.docs), (1, 2));
        let syn = rows
            .iter()
            .find(|r| r.dataset == SYNTHETIC_DATASET && r.docs_per_step == 32)
            .unwrap();
        assert_eq!(syn.steps, 40);
        assert!(
            syn.docs_overlong_excluded > 0,
            "the tail passes 2048 tokens"
        );
    }

    #[test]
    fn synthetic_distribution_has_the_documented_shape() {
        let mut lens: Vec<u32> = synthetic_lognormal(100_000, 3)
            .into_iter()
            .map(|d| d[0])
            .collect();
        assert_eq!(synthetic_lognormal(10, 3), synthetic_lognormal(10, 3));
        lens.sort_unstable();
        let median = lens[lens.len() / 2];
        let p99 = lens[lens.len() * 99 / 100];
        assert!((240..280).contains(&median), "median {median}");
        assert!((2500..4500).contains(&p99), "p99 {p99}");
        assert!(*lens.last().unwrap() <= SYNTHETIC_MAX_TOKENS);
    }

    #[test]
    fn greedy_baseline_deals_round_robin() {
        let items: Vec<PackItem> = [60, 50, 40, 30]
            .iter()
            .enumerate()
            .map(|(doc, &l)| PackItem {
                doc,
                seq_lens: SeqLens::one(l),
                loss_tokens: 1,
                is_pair: false,
            })
            .collect();
        let p = PackProblem {
            groups: Vec::new(),
            items,
            max_tokens: 100,
            world_size: 2,
            min_microbatches_per_rank: 0,
        };
        let s = greedy_baseline(&p).unwrap();
        // [60], [50, 40], [30] → rank 0: [60], [30]; rank 1: [50, 40], padding.
        assert_eq!(s.ranks[0][0].items, vec![0]);
        assert_eq!(s.ranks[0][1].items, vec![3]);
        assert_eq!(s.ranks[1][0].items, vec![1, 2]);
        assert!(s.ranks[1][1].is_padding());
        assert!(audit(&p, &s).is_ok());
    }

    /// The full grid on the synthetic dataset; run in release:
    /// `cargo test --release -p accrue-coordinator packing_bench_full -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn packing_bench_full() {
        let mut out = std::io::stdout();
        packing(&PackingBenchOpts::default(), &mut out).unwrap();
    }
}
