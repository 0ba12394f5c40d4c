//! Where the replicated trainer's gradients accumulate between the
//! microbatches of a step (DESIGN.md "Accumulation boundary"). Each
//! microbatch's backward hands over its gradients (in the compute dtype,
//! one tensor per parameter); they are summed in float32 here:
//!
//! - ddp ([`Grads::Full`]): into one flat float32 buffer of the whole
//!   gradient, all-reduced once at the boundary;
//! - zero2 ([`Grads::Sharded`], ZeRO stage 2, Rajbhandari et al. 2020):
//!   reduce-scattered at the end of every microbatch into this rank's
//!   float32 shard of the flat layout, so no rank holds the whole gradient
//!   between microbatches or at the boundary. Per microbatch rather than
//!   per bucket during the backward because tch exposes no gradient hooks
//!   (autograd hands the whole gradient over when the backward returns);
//!   per microbatch rather than once at the boundary because holding the
//!   whole gradient through the step is exactly what ZeRO-2 saves. The
//!   reduce-scatter runs in rounds of at most [`BUCKET_ELEMENTS`]: round
//!   `c` carries elements `c·S .. (c+1)·S` of every rank's shard, so the
//!   transient buffer is one bucket while the shards stay the flat
//!   layout's [`shard_range`]s (what optimizer state, checkpoints and state
//!   sync use). Every rank must hand over every microbatch, padding ones
//!   included (`Passes::collective_per_microbatch`).
//!
//! Sums are float32 whatever the compute dtype; `precision.reduce =
//! "bfloat16"` rounds each rank's contribution and the reduced sum to
//! bfloat16 (the values a bfloat16 reduction carries; the backends here
//! move float32).

use anyhow::Context;
use tch::{Device, Kind, Tensor};

use crate::collective::{shard_range, Collective};
use crate::train::flat::FlatLayout;

/// Elements of the transient buffer of one zero2 reduce-scatter round
/// (over all ranks): 16 MiB of float32, past which NCCL and the ring are
/// at full bandwidth, and small beside a model's whole gradient. Which
/// round carries an element never changes its rank's order of summation.
pub const BUCKET_ELEMENTS: usize = 4 << 20;

/// A replica's accumulated gradient.
pub enum Grads {
    /// The whole gradient in the flat layout. `touched[i]`: parameter `i`
    /// received a gradient this step (the first copies, later ones add;
    /// untouched ranges are zeroed at the boundary).
    Full { acc: Tensor, touched: Vec<bool> },
    /// This rank's shard of the summed gradient; `bucket`: elements of
    /// one reduce-scatter round.
    Sharded { shard: Tensor, bucket: usize },
}

impl Grads {
    /// The accumulator for `layout` at `sharding` level on `device`.
    pub fn new(layout: &FlatLayout, zero2: bool, coll: &dyn Collective, device: Device) -> Grads {
        if zero2 {
            let r = shard_range(layout.total, coll.world_size(), coll.rank());
            Grads::Sharded {
                shard: Tensor::zeros([r.len() as i64], (Kind::Float, device)),
                bucket: BUCKET_ELEMENTS,
            }
        } else {
            Grads::Full {
                acc: Tensor::zeros([layout.total as i64], (Kind::Float, device)),
                touched: vec![false; layout.numels.len()],
            }
        }
    }

    /// Takes one microbatch's gradients (`grads[i]` for parameter `i`,
    /// undefined where none). zero2: a collective every rank joins.
    pub fn absorb(
        &mut self,
        layout: &FlatLayout,
        grads: &[Tensor],
        coll: &mut dyn Collective,
        reduce: Kind,
    ) -> anyhow::Result<()> {
        match self {
            Grads::Full { acc, touched } => {
                tch::no_grad(|| {
                    for (i, g) in grads.iter().enumerate() {
                        if !g.defined() {
                            continue;
                        }
                        let mut dst = acc
                            .narrow(0, layout.offsets[i] as i64, layout.numels[i] as i64)
                            .view(layout.shapes[i].as_slice());
                        if touched[i] {
                            let _ = dst.g_add_(g);
                        } else {
                            dst.copy_(g);
                            touched[i] = true;
                        }
                    }
                });
                Ok(())
            }
            Grads::Sharded { shard, bucket } => {
                scatter_into(shard, *bucket, layout, grads, coll, reduce)
            }
        }
    }

    /// The accumulated gradient at the boundary: ddp the whole flat buffer
    /// (untouched parameters zeroed), zero2 this rank's shard.
    pub fn take_flat(&mut self, layout: &FlatLayout) -> Tensor {
        match self {
            Grads::Full { acc, touched } => {
                tch::no_grad(|| {
                    for (i, t) in touched.iter().enumerate() {
                        if !t {
                            let _ = acc
                                .narrow(0, layout.offsets[i] as i64, layout.numels[i] as i64)
                                .zero_();
                        }
                    }
                });
                touched.iter_mut().for_each(|t| *t = true);
                acc.shallow_clone()
            }
            Grads::Sharded { shard, .. } => shard.shallow_clone(),
        }
    }

    /// Drops the accumulated gradient (a step's end, an abort).
    pub fn zero(&mut self) {
        match self {
            // Nothing to write: the next microbatch copies over it.
            Grads::Full { touched, .. } => touched.iter_mut().for_each(|t| *t = false),
            Grads::Sharded { shard, .. } => {
                let _ = shard.zero_();
            }
        }
    }

    /// Whether what is accumulated is finite (no collective).
    pub fn finite(&self, layout: &FlatLayout) -> bool {
        match self {
            Grads::Full { acc, touched } => {
                let parts: Vec<Tensor> = (0..touched.len())
                    .filter(|&i| touched[i])
                    .map(|i| acc.narrow(0, layout.offsets[i] as i64, layout.numels[i] as i64))
                    .collect();
                crate::train::finite::all_finite(&parts)
            }
            Grads::Sharded { shard, .. } => crate::train::finite::all_finite([shard]),
        }
    }

    /// Bytes held between microbatches.
    pub fn bytes(&self) -> u64 {
        match self {
            Grads::Full { acc, .. } => acc.numel() as u64 * 4,
            Grads::Sharded { shard, .. } => shard.numel() as u64 * 4,
        }
    }
}

/// Rounds `t` to bfloat16 in place when the reduction is bfloat16.
pub(super) fn round_to(t: &mut Tensor, reduce: Kind) {
    if reduce != Kind::Float {
        tch::no_grad(|| t.copy_(&t.to_kind(reduce)));
    }
}

/// The rounds of one zero2 reduce-scatter (see the module docs): rank
/// `k`'s shard `shards[k]`, `s` elements of it per round.
fn rounds(
    total: usize,
    world: usize,
    bucket: usize,
) -> (Vec<std::ops::Range<usize>>, usize, usize) {
    let shards: Vec<_> = (0..world).map(|k| shard_range(total, world, k)).collect();
    let longest = shards.iter().map(|r| r.len()).max().unwrap_or(0);
    let per_rank = (bucket / world.max(1)).clamp(1, longest.max(1));
    (shards, longest, per_rank)
}

/// Reduce-scatters one microbatch's gradients into this rank's shard.
fn scatter_into(
    shard: &mut Tensor,
    bucket: usize,
    layout: &FlatLayout,
    grads: &[Tensor],
    coll: &mut dyn Collective,
    reduce: Kind,
) -> anyhow::Result<()> {
    let (world, rank) = (coll.world_size(), coll.rank());
    if world == 1 {
        // The shard is the whole layout and there is nothing to reduce.
        let acc = Tensor::zeros_like(shard);
        layout.copy_range_into(&acc, grads, 0..layout.total);
        tch::no_grad(|| {
            let _ = shard.g_add_(&acc);
        });
        return Ok(());
    }
    // The collective's device (the model's, or the host for a CPU
    // collective under test).
    let device = coll.device();
    let (shards, longest, s) = rounds(layout.total, world, bucket);
    let mut start = 0;
    while start < longest {
        let mut buf = Tensor::zeros([(s * world) as i64], (Kind::Float, device));
        for (k, r) in shards.iter().enumerate() {
            let lo = (r.start + start).min(r.end);
            let hi = (r.start + start + s).min(r.end);
            let dst = buf.narrow(0, (k * s) as i64, (hi - lo) as i64);
            layout.copy_range_into(&dst, grads, lo..hi);
        }
        round_to(&mut buf, reduce);
        coll.reduce_scatter_sum(&mut buf)
            .with_context(|| format!("zero2: reduce_scatter of gradient round at {start}"))?;
        let mine = shards[rank].len().saturating_sub(start).min(s);
        if mine > 0 {
            let mut got = buf
                .narrow(0, (rank * s) as i64, mine as i64)
                .to_device(shard.device());
            round_to(&mut got, reduce);
            tch::no_grad(|| {
                let _ = shard.narrow(0, start as i64, mine as i64).g_add_(&got);
            });
        }
        start += s;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local::LocalGroup;

    /// Three ranks hand over different gradients of a layout whose shards
    /// cut through parameters; each ends with its shard of the sum, as a
    /// whole-buffer reduce-scatter would give, in several rounds too.
    #[test]
    fn zero2_rounds_deliver_each_rank_its_shard_of_the_sum() {
        let shapes: [&[i64]; 3] = [&[5, 3], &[7], &[2, 2]];
        let params: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::zeros(*s, (Kind::Float, Device::Cpu)))
            .collect();
        let layout = FlatLayout::grouped(&params, &[true, false, true]);
        let grads_of = |rank: usize| -> Vec<Tensor> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let n: i64 = s.iter().product();
                    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * (rank + 1) as f64 + i as f64)
                        .view(*s)
                })
                .collect()
        };
        let world = 3;
        let expected: Vec<Tensor> = {
            let sum: Vec<Tensor> = (0..3)
                .map(|i| {
                    (0..world)
                        .map(|r| grads_of(r)[i].shallow_clone())
                        .sum::<Tensor>()
                })
                .collect();
            let flat = layout.flatten(&sum, Device::Cpu);
            (0..world)
                .map(|r| {
                    let sr = shard_range(layout.total, world, r);
                    flat.narrow(0, sr.start as i64, sr.len() as i64).copy()
                })
                .collect()
        };
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|mut c| {
                let layout = layout.clone();
                let grads = grads_of(c.rank());
                std::thread::spawn(move || {
                    let mut g = Grads::new(&layout, true, &c, Device::Cpu);
                    if let Grads::Sharded { bucket, .. } = &mut g {
                        // Rounds of 2 elements per rank.
                        *bucket = 2 * world;
                    }
                    // Twice: the shard accumulates.
                    for _ in 0..2 {
                        g.absorb(&layout, &grads, &mut c, Kind::Float).unwrap();
                    }
                    (c.rank(), g.take_flat(&layout))
                })
            })
            .collect();
        for h in handles {
            let (r, got) = h.join().unwrap();
            assert!(got.equal(&(&expected[r] * 2.0)), "rank {r}");
        }
        let (_, longest, s) = rounds(10 * BUCKET_ELEMENTS, 4, BUCKET_ELEMENTS);
        assert_eq!(
            (longest, s),
            (10 * BUCKET_ELEMENTS / 4, BUCKET_ELEMENTS / 4)
        );
    }
}
