//! Padding-free packing and rank balancing: [`solve`] turns one step's
//! documents into microbatches of at most `max_tokens` tokens
//! (best-fit-decreasing, never cutting a document) and deals them to ranks
//! so that every rank runs the same number of microbatches at about the same
//! attention-aware cost. The algorithm, its cost model and its guarantees are
//! described in README.md beside this file.

use std::cmp::Reverse;

use super::balance::{cost_key, split_for_balance, Layout};
use super::error::PlanError;
use super::free_bins::FreeBins;
use super::problem::{Microbatch, Normalizers, PackItem, PackProblem, PackSolution};

/// Attention term of the cost model: a sequence of `len` tokens costs
/// `len + len² / ATTN_SCALE`.
///
/// Per token and layer, a decoder spends ≈ 24·d² FLOPs in its dense matmuls;
/// causal attention over a sequence of `len` tokens adds ≈ 2·d·len FLOPs per
/// token. Their ratio puts the crossover at `len ≈ 12·d`, ≈ 10–25k tokens for
/// the 0.5B–2B models Accrue targets (d = 896–2048). Attention kernels reach
/// roughly a third to a half of the dense-matmul throughput at these head
/// sizes, which brings the crossover down to ≈ 4k tokens: a 4096-token
/// document costs twice its length, a 16k one five times.
pub const ATTN_SCALE: f64 = 4096.0;

/// Cost of one sequence of `len` tokens (see [`ATTN_SCALE`]).
pub fn seq_cost(len: u32) -> f64 {
    let l = f64::from(len);
    l + l * l / ATTN_SCALE
}

/// Cost of a document: the sum over its sequences (a pair's two sequences
/// attend separately).
pub fn item_cost(item: &PackItem) -> f64 {
    item.seq_lens.iter().map(|&l| seq_cost(l)).sum()
}

/// The volume lower bound on microbatches per rank:
/// `ceil(ceil(total_tokens / max_tokens) / world_size)`.
pub fn lower_bound_per_rank(total_tokens: u64, max_tokens: u32, world_size: u32) -> u64 {
    let max = u64::from(max_tokens.max(1));
    total_tokens
        .div_ceil(max)
        .div_ceil(u64::from(world_size.max(1)))
}

/// Packs a step's documents into microbatches and assigns them to ranks.
///
/// Every item lands in exactly one microbatch, whole (a pair's sequences
/// together); no microbatch holds more than `max_tokens`; every rank gets
/// `m = max(ceil(B / W), min_microbatches_per_rank)` microbatches, where B
/// is the number of bins best-fit packing needed, padded with empty ones.
/// Deterministic: ties break on item and bin indices, no randomness.
pub fn solve(problem: &PackProblem) -> Result<PackSolution, PlanError> {
    // Phase 0: validate. An overlong document is an error, never cut.
    validate(problem)?;
    let items = &problem.items;
    let max = u64::from(problem.max_tokens);
    let w = problem.world_size as usize;
    let tokens: Vec<u64> = items.iter().map(PackItem::tokens).collect();
    let costs: Vec<f64> = items.iter().map(item_cost).collect();
    let total: u64 = tokens.iter().sum();

    // Phase 1: bin packing, best-fit-decreasing by tokens. When BFD's bin
    // count would cost an extra microbatch per rank over the floor, also
    // try best fit in the given (offering) order: that replays the static
    // selector's packing, so a static step keeps exactly k per rank.
    let min_m = problem.min_microbatches_per_rank as usize;
    let floor_m =
        min_m.max(lower_bound_per_rank(total, problem.max_tokens, problem.world_size) as usize);
    let group = |i: usize| problem.groups.get(i).copied().unwrap_or(0);
    let mut bins = per_group(&tokens, &group, |t| best_fit_decreasing(t, max));
    if bins.len().div_ceil(w) > floor_m {
        let in_order = per_group(&tokens, &group, |t| best_fit_in_order(t, max));
        if in_order.len() < bins.len() {
            bins = in_order;
        }
    }
    let m = bins.len().div_ceil(w).max(min_m);

    // Phase 2: when W·m leaves empty slots, split the costliest bins so the
    // ranks have finer pieces to balance; m does not change.
    if w > 1 {
        split_for_balance(&mut bins, m * w, &costs);
    }
    // Empty padding bins so every rank has exactly m slots.
    bins.resize_with(m * w, Vec::new);

    // Phase 3: LPT with equal counts: costliest bin first, to the cheapest
    // rank that still has a free slot.
    let groups: Vec<u32> = (0..items.len()).map(group).collect();
    let mut layout = Layout::new(bins, &tokens, &costs, max, &groups);
    layout.longest_processing_time(w, m);

    // Phase 4: local search between the costliest and the cheapest rank:
    // swap two bins, move a document, or exchange two documents, whichever
    // lowers the costlier of the two most, while one does.
    layout.improve();
    let (bins, ranks) = layout.into_parts();

    // Phase 5: build the microbatches and the normalisers.
    let solution = build_solution(problem, &bins, &tokens, &costs, ranks);
    debug_assert!(
        audit(problem, &solution).is_ok(),
        "{:?}",
        audit(problem, &solution)
    );
    debug_assert!(solution.ranks.iter().all(|r| r.len() == m));
    Ok(solution)
}

/// Packs each group's items on their own with `pack` (bins of one group
/// only), groups in order of first appearance; one group packs as a whole.
fn per_group(
    tokens: &[u64],
    group: &impl Fn(usize) -> u32,
    pack: impl Fn(&[u64]) -> Vec<Vec<usize>>,
) -> Vec<Vec<usize>> {
    let mut order: Vec<u32> = Vec::new();
    for i in 0..tokens.len() {
        if !order.contains(&group(i)) {
            order.push(group(i));
        }
    }
    if order.len() <= 1 {
        return pack(tokens);
    }
    let mut bins = Vec::new();
    for g in order {
        let members: Vec<usize> = (0..tokens.len()).filter(|&i| group(i) == g).collect();
        let t: Vec<u64> = members.iter().map(|&i| tokens[i]).collect();
        bins.extend(
            pack(&t)
                .into_iter()
                .map(|b| b.into_iter().map(|j| members[j]).collect::<Vec<_>>()),
        );
    }
    bins
}

fn validate(problem: &PackProblem) -> Result<(), PlanError> {
    if problem.world_size == 0 {
        return Err(PlanError::NoRanks);
    }
    if problem.max_tokens == 0 {
        return Err(PlanError::ZeroBudget);
    }
    let max = u64::from(problem.max_tokens);
    match problem.items.iter().find(|it| it.tokens() > max) {
        Some(it) => Err(PlanError::Overlong {
            doc: it.doc,
            tokens: it.tokens(),
            max_tokens: problem.max_tokens,
        }),
        None => Ok(()),
    }
}

/// Online best fit: each item goes to the open bin with the least remaining
/// capacity that still holds it (lowest bin index on ties), else to a new
/// bin while fewer than `limit` are open.
#[derive(Debug, Clone)]
pub(super) struct BestFit {
    max: u64,
    limit: usize,
    free: FreeBins,
    bins: Vec<Vec<usize>>,
}

impl BestFit {
    pub(super) fn new(max: u64, limit: usize) -> Self {
        BestFit {
            max,
            limit,
            free: FreeBins::new(max),
            bins: Vec::new(),
        }
    }

    /// [`BestFit::new`] over the ordered set of open bins, whatever `max`
    /// (the reference the dense form is tested against).
    #[cfg(test)]
    pub(super) fn sparse(max: u64, limit: usize) -> Self {
        BestFit {
            free: FreeBins::sparse(),
            ..Self::new(max, limit)
        }
    }

    /// Places item `i` of `tokens` tokens; `None` when no bin can hold it.
    pub(super) fn place(&mut self, i: usize, tokens: u64) -> Option<usize> {
        if tokens > self.max {
            return None;
        }
        let (remaining, bin) = match self.free.take(tokens) {
            Some(key) => key,
            None if self.bins.len() < self.limit => {
                // Room for a few items before the first regrowth.
                self.bins.push(Vec::with_capacity(8));
                (self.max, self.bins.len() - 1)
            }
            None => return None,
        };
        self.bins[bin].push(i);
        self.free.put(remaining - tokens, bin);
        Some(bin)
    }

    /// True when every allowed bin is open and completely full.
    pub(super) fn is_full(&self) -> bool {
        self.bins.len() >= self.limit && self.free.all_full()
    }

    pub(super) fn into_bins(self) -> Vec<Vec<usize>> {
        self.bins
    }
}

/// Best-fit-decreasing: items by tokens, largest first (ties by index).
pub(super) fn best_fit_decreasing(tokens: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    // Keys are unique (index breaks ties), so the unstable sort is deterministic.
    order.sort_unstable_by_key(|&i| (Reverse(tokens[i]), i));
    let mut fit = BestFit::new(max, usize::MAX);
    for i in order {
        fit.place(i, tokens[i])
            .expect("validated: every item fits an empty bin");
    }
    fit.into_bins()
}

/// Best fit in the items' given order.
fn best_fit_in_order(tokens: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut fit = BestFit::new(max, usize::MAX);
    for (i, &t) in tokens.iter().enumerate() {
        fit.place(i, t)
            .expect("validated: every item fits an empty bin");
    }
    fit.into_bins()
}

fn build_solution(
    problem: &PackProblem,
    bins: &[Vec<usize>],
    tokens: &[u64],
    costs: &[f64],
    ranks: Vec<Vec<usize>>,
) -> PackSolution {
    let items = &problem.items;
    let ranks = ranks
        .into_iter()
        .map(|slots| {
            let mut mbs: Vec<Microbatch> = slots
                .into_iter()
                .map(|b| {
                    let mut members = bins[b].clone();
                    members.sort_unstable();
                    Microbatch {
                        tokens: members.iter().map(|&i| tokens[i]).sum(),
                        loss_tokens: members.iter().map(|&i| items[i].loss_tokens).sum(),
                        cost: members.iter().map(|&i| costs[i]).sum(),
                        items: members,
                    }
                })
                .collect();
            // Real microbatches first, costliest first; padding last.
            mbs.sort_by(|x, y| {
                (x.is_padding(), Reverse(cost_key(x.cost)), x.items.first()).cmp(&(
                    y.is_padding(),
                    Reverse(cost_key(y.cost)),
                    y.items.first(),
                ))
            });
            mbs
        })
        .collect();
    PackSolution {
        ranks,
        normalizers: normalizers(items),
    }
}

/// The step's global normalisers: sums over all its documents.
pub fn normalizers(items: &[PackItem]) -> Normalizers {
    let mut n = Normalizers::default();
    for it in items {
        add_item(&mut n, it);
    }
    n
}

fn add_item(n: &mut Normalizers, it: &PackItem) {
    n.loss_tokens += it.loss_tokens;
    n.pairs += u64::from(it.is_pair);
    n.documents += 1;
    n.sequences += it.seq_lens.len() as u64;
    n.tokens += it.tokens();
}

/// What a solution does wrong with respect to its problem; all zero / true
/// for a valid one. Used by the post-condition asserts, the tests and the
/// packing benchmark (which counts dropped and truncated documents with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Audit {
    /// Items in no microbatch.
    pub missing: usize,
    /// Extra occurrences of items placed more than once, plus indices that
    /// name no item.
    pub duplicated: usize,
    /// Items in a microbatch whose token count is below the sum of its
    /// items' lengths (something was cut).
    pub truncated: usize,
    /// Microbatches over `max_tokens`.
    pub over_budget: usize,
    /// Microbatches whose recorded tokens or loss tokens disagree with their items.
    pub miscounted: usize,
    /// `ranks.len() == world_size` and every rank has the same count.
    pub ranks_equal: bool,
    /// The normalisers equal the sums over the microbatches' items.
    pub normalizers_match: bool,
}

impl Audit {
    /// True when the solution has no defect.
    pub fn is_ok(&self) -> bool {
        self.missing == 0
            && self.duplicated == 0
            && self.truncated == 0
            && self.over_budget == 0
            && self.miscounted == 0
            && self.ranks_equal
            && self.normalizers_match
    }
}

/// Checks `solution` against `problem` (see [`Audit`]).
pub fn audit(problem: &PackProblem, solution: &PackSolution) -> Audit {
    let items = &problem.items;
    let mut seen = vec![0u32; items.len()];
    let mut a = Audit::default();
    let mut placed = Normalizers::default();
    for mb in solution.ranks.iter().flatten() {
        let mut full = 0u64;
        let mut loss = 0u64;
        for &i in &mb.items {
            match items.get(i) {
                Some(it) => {
                    seen[i] += 1;
                    full += it.tokens();
                    loss += it.loss_tokens;
                    add_item(&mut placed, it);
                }
                None => a.duplicated += 1,
            }
        }
        if mb.tokens < full {
            a.truncated += mb.items.len();
        }
        if mb.tokens > u64::from(problem.max_tokens) || full > u64::from(problem.max_tokens) {
            a.over_budget += 1;
        }
        if mb.tokens != full || mb.loss_tokens != loss {
            a.miscounted += 1;
        }
    }
    a.missing = seen.iter().filter(|&&c| c == 0).count();
    a.duplicated += seen
        .iter()
        .map(|&c| c.saturating_sub(1) as usize)
        .sum::<usize>();
    let m = solution.microbatches_per_rank();
    a.ranks_equal = solution.ranks.len() == problem.world_size as usize
        && solution.ranks.iter().all(|r| r.len() == m);
    a.normalizers_match = placed == solution.normalizers;
    a
}
