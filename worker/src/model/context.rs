//! Context parallelism's attention (issue 37, `parallel.context = C`): a
//! packed row split along the sequence over a group of C ranks, each
//! holding its queries' share, attending over the whole row's keys.
//!
//! **The split** ([`ZigZag`]): the row is cut into 2C chunks of near-equal
//! length and rank r holds chunks r and 2C−1−r, so under a causal mask
//! every rank has about the same work (an early chunk sees few keys, its
//! late partner many; Megatron's CP and ring-flash-attention's zig-zag).
//!
//! **Keys and values are all-gathered** ([`gather_slots`]) before a
//! layer's attention, and their gradients reduce-scattered back to the
//! ranks that own them ([`scatter_slots`]) after its backward — the
//! all-gather form of CP (Llama 3's), not a ring of K/V passes. Why, for
//! our two collectives: both are bandwidth-optimal ring collectives on the
//! TCP ring and on NCCL (the same bytes a ring attention sends, in a few
//! calls instead of C−1 steps the ring would have to overlap with compute
//! to pay off); with grouped-query attention k and v are a fraction of the
//! layer's activations (kv heads / query heads), and they are gathered one
//! kv head at a time (again in the backward rather than kept), so the
//! row-sized buffers are one kv head's k, v and their gradients, read in
//! place in the gather's layout (each chunk a flash block of its own); and
//! a packed row's document mask needs no per-step bookkeeping: every rank
//! sees every key. Ulysses (all-to-all over heads) would cap C at the
//! kv-head count (1–8 on the models users post-train) and needs an
//! all-to-all neither collective has.
//!
//! **Exact attention over blocks.** A rank's queries of one document,
//! global positions [a, b) of a document starting at s, see keys [s, a)
//! whole and keys [a, b) causally. Each block is one flash-attention call
//! returning its output and log-sum-exp; the two merge by their
//! log-sum-exps. The backward calls the flash backward once per block with
//! the MERGED output and log-sum-exp (the global softmax's): its
//! `P = exp(S − lse)` and `D = rowsum(dO ∘ O)` are then the whole row's, so
//! the blocks' gradients sum to exactly the unsplit attention's (the
//! identity ring attention's backward rests on).

use std::ops::Range;

use tch::{Kind, Tensor};

use crate::collective::{Collective, CollectiveError};

/// The zig-zag split of a row of `len` tokens over `ranks` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZigZag {
    pub len: i64,
    pub ranks: i64,
}

impl ZigZag {
    pub fn new(len: i64, ranks: i64) -> ZigZag {
        assert!(ranks > 0 && len >= 0);
        ZigZag { len, ranks }
    }

    /// Chunk `k` of the 2C (lengths differ by at most one token).
    pub fn chunk(&self, k: i64) -> Range<i64> {
        let n = 2 * self.ranks;
        k * self.len / n..(k + 1) * self.len / n
    }

    /// The row positions rank `rank` holds, in its local order: its early
    /// chunk then its late one.
    pub fn held(&self, rank: i64) -> [Range<i64>; 2] {
        [self.chunk(rank), self.chunk(2 * self.ranks - 1 - rank)]
    }

    /// How many tokens rank `rank` holds.
    pub fn count(&self, rank: i64) -> i64 {
        self.held(rank).iter().map(|r| r.end - r.start).sum()
    }

    /// Every rank's count at most this (the gather's slot).
    pub fn slot(&self) -> i64 {
        (0..self.ranks).map(|r| self.count(r)).max().unwrap_or(0)
    }

    /// Rank `rank`'s positions, in its local order.
    pub fn positions(&self, rank: i64) -> Vec<i64> {
        self.held(rank).into_iter().flatten().collect()
    }

    /// The rows of the gathered buffer (rank r's rows at r × slot, in
    /// its local order) that hold row positions `r`, in row order: one
    /// range per chunk `r` meets.
    pub fn segments(&self, r: &Range<i64>) -> Vec<Range<i64>> {
        let (n, slot) = (2 * self.ranks, self.slot());
        (0..n)
            .filter_map(|k| {
                let c = self.chunk(k);
                let (a, b) = (r.start.max(c.start), r.end.min(c.end));
                if a >= b {
                    return None;
                }
                // Chunk k's owner holds it first (k < C) or after its
                // early chunk.
                let owner = if k < self.ranks { k } else { n - 1 - k };
                let first = self.chunk(owner);
                let offset = if k < self.ranks {
                    0
                } else {
                    first.end - first.start
                };
                let base = owner * slot + offset - c.start;
                Some(base + a..base + b)
            })
            .collect()
    }

    /// For each row position, its row in the gathered buffer (rank r's
    /// rows start at r × slot).
    fn gathered_rows(&self) -> Vec<i64> {
        let slot = self.slot();
        let mut rows = vec![0; self.len as usize];
        for r in 0..self.ranks {
            for (i, p) in self.positions(r).into_iter().enumerate() {
                rows[p as usize] = r * slot + i as i64;
            }
        }
        rows
    }
}

/// One run of a rank's queries inside one document: local rows `local`
/// (global positions `diag`) see keys `before` whole and `diag` causally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub local: Range<i64>,
    pub before: Range<i64>,
    pub diag: Range<i64>,
}

/// Rank `rank`'s pieces of a row whose documents are `cu_seq_lens`
/// (cumulative, from 0 to the row's length).
pub fn pieces(split: &ZigZag, rank: i64, cu_seq_lens: &[i64]) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut offset = 0;
    for held in split.held(rank) {
        for w in cu_seq_lens.windows(2) {
            let (s, e) = (w[0], w[1]);
            let (a, b) = (held.start.max(s), held.end.min(e));
            if a < b {
                let local = offset + (a - held.start)..offset + (b - held.start);
                out.push(Piece {
                    local,
                    before: s..a,
                    diag: a..b,
                });
            }
        }
        offset += held.end - held.start;
    }
    out
}

/// Every rank's `rows` (`[count, W]`, its positions in local order) in
/// the gathered layout `[ranks · slot, W]` (float32, on the collective's
/// device): rank r's rows at r × slot, in its local order. Attention reads
/// the row's ranges in place through [`ZigZag::segments`], so the whole
/// row is never copied into row order.
pub fn gather_slots(
    coll: &mut dyn Collective,
    split: &ZigZag,
    rows: &Tensor,
) -> Result<Tensor, CollectiveError> {
    let width = rows.size()[1];
    let (slot, ranks) = (split.slot(), split.ranks);
    let rank = coll.rank() as i64;
    let device = coll.device();
    let mut buf = Tensor::zeros([ranks * slot * width], (Kind::Float, device));
    let count = split.count(rank);
    buf.narrow(0, rank * slot * width, count * width)
        .copy_(&rows.to_device(device).to_kind(Kind::Float).reshape([-1]));
    coll.all_gather(&mut buf)?;
    Ok(buf.view([ranks * slot, width]))
}

/// The gradient of [`gather_slots`]: `full` (`[ranks · slot, W]` float32,
/// this rank's gradient of the gathered rows, reduced in place) summed over
/// the ranks, this rank's rows of it in local order.
pub fn scatter_slots(
    coll: &mut dyn Collective,
    split: &ZigZag,
    full: Tensor,
) -> Result<Tensor, CollectiveError> {
    let width = full.size()[1];
    let rank = coll.rank() as i64;
    let mut buf = full.to_device(coll.device()).reshape([-1]);
    coll.reduce_scatter_sum(&mut buf)?;
    let count = split.count(rank);
    Ok(buf
        .narrow(0, rank * split.slot() * width, count * width)
        .view([count, width]))
}

/// Every rank's `rows` (`[count, W]`, its positions in local order) as the
/// whole row `[len, W]`, in row order (per-token values; attention's keys
/// stay in the gathered layout, [`gather_slots`]).
pub fn gather_rows(
    coll: &mut dyn Collective,
    shard: &RowShard,
    rows: &Tensor,
) -> Result<Tensor, CollectiveError> {
    let buf = gather_slots(coll, &shard.split, rows)?;
    let index = shard.gathered.to_device(buf.device());
    Ok(buf
        .index_select(0, &index)
        .to_device(rows.device())
        .to_kind(rows.kind()))
}

/// A rank's share of one packed row under context parallelism.
#[derive(Debug)]
pub struct RowShard {
    pub split: ZigZag,
    pub rank: i64,
    pub pieces: Vec<Piece>,
    /// The row positions of the local rows, in local order.
    pub held: Vec<i64>,
    /// Each local row's position in its document (RoPE's).
    pub positions: Vec<i64>,
    /// For each row position, its row in a gathered buffer (int64, built
    /// once per row for every layer's gathers and scatters).
    gathered: Tensor,
}

impl Clone for RowShard {
    fn clone(&self) -> RowShard {
        RowShard {
            split: self.split,
            rank: self.rank,
            pieces: self.pieces.clone(),
            held: self.held.clone(),
            positions: self.positions.clone(),
            gathered: self.gathered.shallow_clone(),
        }
    }
}

impl RowShard {
    /// Rank `rank`'s share of a row of documents `cu_seq_lens` split over
    /// `ranks`.
    pub fn new(cu_seq_lens: &[i64], ranks: i64, rank: i64) -> RowShard {
        let len = *cu_seq_lens.last().unwrap_or(&0);
        let split = ZigZag::new(len, ranks);
        let held = split.positions(rank);
        let in_doc = super::llama::positions(cu_seq_lens);
        let positions = held.iter().map(|&p| in_doc[p as usize]).collect();
        RowShard {
            split,
            rank,
            pieces: pieces(&split, rank, cu_seq_lens),
            held,
            positions,
            gathered: Tensor::from_slice(&split.gathered_rows()),
        }
    }

    /// This rank's values of a per-token row (ids, labels, weights).
    pub fn take<T: Copy>(&self, row: &[T]) -> Vec<T> {
        self.held.iter().map(|&p| row[p as usize]).collect()
    }
}

/// A layer's attention over the group, from this rank's q `[heads, n, d]`,
/// k and v `[kv_heads, n, d]` (RoPE applied): the heads' outputs
/// `[n, heads · d]` and what the backward needs. One kv head at a time:
/// its keys and values gathered, its query heads' attention, the gathered
/// rows dropped — so the row-sized buffers are one kv head's (and
/// [`group_attention_backward`] gathers them again the same way: the whole
/// row's are never held through a layer's backward).
pub fn group_attention(
    coll: &mut dyn Collective,
    shard: &RowShard,
    scale: Option<f64>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Saved), CollectiveError> {
    let (heads, n, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let kv = k.size()[0];
    let groups = heads / kv;
    let split = &shard.split;
    let out = Tensor::zeros([n, heads, d], (q.kind(), q.device()));
    let mut saved = Saved {
        lse: Vec::with_capacity(kv as usize),
    };
    tch::no_grad(|| -> Result<(), CollectiveError> {
        let q = q.detach();
        for h in 0..kv {
            let kf = gather_heads(coll, split, &k.narrow(0, h, 1))?;
            let vf = gather_heads(coll, split, &v.narrow(0, h, 1))?;
            let q_h = q.narrow(0, h * groups, groups);
            let (out_h, lse) = attend(&q_h, &kf, &vf, split, &shard.pieces, scale);
            out.narrow(1, h * groups, groups).copy_(&out_h);
            saved.lse.push(lse);
        }
        Ok(())
    })?;
    Ok((out.reshape([n, heads * d]), saved))
}

/// The gathered layout (`[ranks · slot, kv, d]`, [`gather_slots`]) of every
/// rank's `t` (`[kv, n, d]`), in `t`'s kind and device.
fn gather_heads(
    coll: &mut dyn Collective,
    split: &ZigZag,
    t: &Tensor,
) -> Result<Tensor, CollectiveError> {
    let (kv, n, d) = (t.size()[0], t.size()[1], t.size()[2]);
    let rows = t.transpose(0, 1).reshape([n, kv * d]);
    Ok(gather_slots(coll, split, &rows)?
        .view([-1, kv, d])
        .to_device(t.device())
        .to_kind(t.kind()))
}

/// The gradients of [`group_attention`]'s q, k and v (this rank's, in their
/// `[heads, n, d]` layout) from its output `out` and the output's gradient
/// `dout` (both `[n, heads · d]`). One kv head at a time: its keys and
/// values gathered again, its query heads' attention backward, its keys'
/// and values' gradients summed over the group (reduce-scattered) — so
/// the row-sized buffers are one kv head's (the all-gather form's memory
/// cost, `1/kv_heads` of it), for one more gather of k and v per layer.
#[allow(clippy::too_many_arguments)]
pub fn group_attention_backward(
    coll: &mut dyn Collective,
    shard: &RowShard,
    scale: Option<f64>,
    out: &Tensor,
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    saved: &Saved,
) -> Result<(Tensor, Tensor, Tensor), CollectiveError> {
    let (heads, n, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let kv = k.size()[0];
    let groups = heads / kv;
    let split = &shard.split;
    tch::no_grad(|| {
        let (dout, out) = (dout.view([n, heads, d]), out.detach().view([n, heads, d]));
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let dq = Tensor::zeros([n, heads, d], (q.kind(), q.device()));
        let (dk, dv) = (k.zeros_like(), v.zeros_like());
        for h in 0..kv {
            let (g0, kh, vh) = (h * groups, k.narrow(0, h, 1), v.narrow(0, h, 1));
            let kf = gather_heads(coll, split, &kh)?;
            let vf = gather_heads(coll, split, &vh)?;
            let (dq_h, dk_h, dv_h) = attend_backward(
                &dout.narrow(1, g0, groups),
                &q.narrow(0, g0, groups),
                &out.narrow(1, g0, groups),
                &kf,
                &vf,
                split,
                &shard.pieces,
                &saved.lse[h as usize],
                scale,
            );
            drop((kf, vf));
            dq.narrow(1, g0, groups).copy_(&dq_h);
            let mine = |full: Tensor, coll: &mut dyn Collective| {
                scatter_slots(coll, split, full.view([-1, d])).map(|t| t.view([1, n, d]))
            };
            dk.narrow(0, h, 1).copy_(&mine(dk_h, coll)?);
            dv.narrow(0, h, 1).copy_(&mine(dv_h, coll)?);
        }
        Ok((dq.transpose(0, 1), dk, dv))
    })
}

/// Every rank's per-token `values` (its positions in local order) as the
/// whole row's, in row order. Float64 carried exactly enough over the
/// float32 collective as a (high, low) pair of float32s.
pub fn gather_values(
    coll: &mut dyn Collective,
    shard: &RowShard,
    values: &[f64],
) -> Result<Vec<f64>, CollectiveError> {
    let pairs = Tensor::from_slice(&to_pairs(values)).view([-1, 2]);
    let full = gather_rows(coll, shard, &pairs)?.to_device(tch::Device::Cpu);
    let flat = Vec::<f32>::try_from(full.reshape([-1])).expect("float32 values");
    Ok(from_pairs(&flat))
}

/// Float64 values as (high, low) float32 pairs, flat: what the float32
/// collectives carry exactly enough (`from_pairs` inverts it).
fn to_pairs(values: &[f64]) -> Vec<f32> {
    values
        .iter()
        .flat_map(|&x| {
            let hi = x as f32;
            [hi, (x - f64::from(hi)) as f32]
        })
        .collect()
}

/// [`to_pairs`]' inverse.
fn from_pairs(flat: &[f32]) -> Vec<f64> {
    flat.chunks_exact(2)
        .map(|p| f64::from(p[0]) + f64::from(p[1]))
        .collect()
}

/// Each rank's `values` summed over the group in float64, the same sums on
/// every rank: each rank's values travel as float32 pairs in a slot of
/// their own (a reduction that adds only zeros to them is exact), and
/// every rank adds the slots in rank order.
pub fn sum_values(coll: &mut dyn Collective, values: &[f64]) -> Result<Vec<f64>, CollectiveError> {
    let (n, ranks, rank) = (values.len(), coll.world_size(), coll.rank());
    let mut slots = vec![0f32; 2 * n * ranks];
    slots[2 * n * rank..2 * n * (rank + 1)].copy_from_slice(&to_pairs(values));
    let mut t = Tensor::from_slice(&slots).to_device(coll.device());
    coll.all_reduce_sum(&mut t)?;
    let all = Vec::<f32>::try_from(t.to_device(tch::Device::Cpu)).expect("float32 values");
    let all = from_pairs(&all);
    Ok((0..n)
        .map(|i| (0..ranks).map(|r| all[r * n + i]).sum())
        .collect())
}

/// The gathered-layout rows of `p`'s causal block: one segment, since a
/// piece lies in one of this rank's chunks.
fn diag_segment(split: &ZigZag, p: &Piece) -> Range<i64> {
    let mut s = split.segments(&p.diag);
    assert_eq!(s.len(), 1, "a piece lies in one chunk");
    s.pop().expect("one segment")
}

/// What the backward of [`attend`] needs besides its inputs and output: each piece's
/// merged output and log-sum-exp.
pub struct Saved {
    /// Per kv head, each piece's merged log-sum-exp over its query heads
    /// (its merged output is the attention's output itself, which the
    /// caller keeps).
    lse: Vec<Vec<Tensor>>,
}

/// `[n, heads, d]` rows as SDPA's `[1, heads, n, d]`.
fn heads_first(t: &Tensor) -> Tensor {
    t.transpose(0, 1).unsqueeze(0)
}

/// A block of keys every query sees whole (no mask) reads each kv head
/// in place: the query heads of a kv head's group are laid end to end
/// along the sequence (`[1, heads, n, ·]` → `[1, kv, groups · n, ·]`,
/// head h = kv head h / groups, as `repeat_kv` orders them), so the long
/// prefix of keys a late chunk sees is never repeated per query head.
fn fold(t: &Tensor, kv: i64) -> Tensor {
    let s = t.size();
    let mut shape = vec![1, kv, s[1] / kv * s[2]];
    shape.extend_from_slice(&s[3..]);
    t.reshape(shape.as_slice())
}

/// [`fold`]'s inverse, to `[1, heads, n, ·]`.
fn unfold(t: &Tensor, heads: i64) -> Tensor {
    let s = t.size();
    let mut shape = vec![1, heads, s[2] * s[1] / heads];
    shape.extend_from_slice(&s[3..]);
    t.reshape(shape.as_slice())
}

/// Attention of this rank's queries `q` (`[heads, count, d]`, local order)
/// over the whole row's keys and values (`[ranks · slot, kv_heads, d]`,
/// [`gather_slots`]' layout, read through `split`'s segments), causal
/// within each document: `[count, heads, d]`, and each piece's
/// log-sum-exp (what the backward needs besides the output).
/// The keys a piece sees whole are one block per chunk they lie in, each
/// merged by log-sum-exp (so no block is larger than a chunk). No autograd
/// (the caller's backward is [`attend_backward`]).
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    split: &ZigZag,
    pieces: &[Piece],
    scale: Option<f64>,
) -> (Tensor, Vec<Tensor>) {
    let (heads, count, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let kv = k.size()[1];
    let out = Tensor::zeros([count, heads, d], (q.kind(), q.device()));
    let mut saved = Vec::with_capacity(pieces.len());
    tch::no_grad(|| {
        for p in pieces {
            let n = p.local.end - p.local.start;
            let qp = q.narrow(1, p.local.start, n).unsqueeze(0).contiguous();
            // The causal block: the kernel reads each kv head for its
            // query heads in place (grouped-query attention).
            let r = diag_segment(split, p);
            let kd = heads_first(&k.narrow(0, r.start, n));
            let vd = heads_first(&v.narrow(0, r.start, n));
            let (mut o, mut lse) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
                &qp,
                &kd,
                &vd,
                0.0,
                true,
                None::<Tensor>,
                scale,
            );
            let before = split.segments(&p.before);
            let folded = (!before.is_empty()).then(|| fold(&qp, kv));
            for r in before {
                let kb = heads_first(&k.narrow(0, r.start, r.end - r.start));
                let vb = heads_first(&v.narrow(0, r.start, r.end - r.start));
                let (o1, l1) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
                    folded.as_ref().expect("folded when any block"),
                    &kb,
                    &vb,
                    0.0,
                    false,
                    None::<Tensor>,
                    scale,
                );
                let (mut o1, l1) = (unfold(&o1, heads), unfold(&l1, heads));
                let merged = l1.logaddexp(&lse);
                // In place: a block's output is the size of the piece's.
                let _ = o.g_mul_(&(&lse - &merged).exp().unsqueeze(-1));
                let _ = o1.g_mul_(&(&l1 - &merged).exp().unsqueeze(-1));
                let _ = o.g_add_(&o1);
                lse = merged;
            }
            out.narrow(0, p.local.start, n)
                .copy_(&o.squeeze_dim(0).transpose(0, 1));
            saved.push(lse);
        }
    });
    (out, saved)
}

/// The gradients of [`attend`]'s inputs given its output `out` and the
/// output's gradient `dout` (both `[count, heads, d]`): `dq` (this rank's
/// rows, `[count, heads, d]`), `dk` and `dv` (float32, in `k`'s gathered
/// layout, this rank's queries' part: [`scatter_slots`] sums them over
/// the group in place).
#[allow(clippy::too_many_arguments)]
pub fn attend_backward(
    dout: &Tensor,
    q: &Tensor,
    out: &Tensor,
    k: &Tensor,
    v: &Tensor,
    split: &ZigZag,
    pieces: &[Piece],
    lse: &[Tensor],
    scale: Option<f64>,
) -> (Tensor, Tensor, Tensor) {
    let (heads, count, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let kv = k.size()[1];
    let dq = Tensor::zeros([count, heads, d], (q.kind(), q.device()));
    let dk = Tensor::zeros(k.size(), (Kind::Float, k.device()));
    let dv = Tensor::zeros(v.size(), (Kind::Float, v.device()));
    // `[1, kv, n, d]` to `[n, kv, d]`.
    let rows = |t: &Tensor| t.squeeze_dim(0).transpose(0, 1).to_kind(Kind::Float);
    tch::no_grad(|| {
        for (i, p) in pieces.iter().enumerate() {
            let n = p.local.end - p.local.start;
            let qp = q.narrow(1, p.local.start, n).unsqueeze(0).contiguous();
            let dop = heads_first(&dout.narrow(0, p.local.start, n)).contiguous();
            let o = heads_first(&out.narrow(0, p.local.start, n)).contiguous();
            let lse = &lse[i];
            // The causal block, each kv head read in place.
            let r = diag_segment(split, p);
            let kb = heads_first(&k.narrow(0, r.start, n));
            let vb = heads_first(&v.narrow(0, r.start, n));
            let (mut dqp, gk, gv) =
                Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
                    &dop,
                    &qp,
                    &kb,
                    &vb,
                    &o,
                    lse,
                    0.0,
                    true,
                    None::<Tensor>,
                    scale,
                );
            let _ = dk.narrow(0, r.start, n).g_add_(&rows(&gk));
            let _ = dv.narrow(0, r.start, n).g_add_(&rows(&gv));
            // The blocks seen whole, their query heads folded (see [`fold`]).
            let before = split.segments(&p.before);
            if !before.is_empty() {
                let (fdo, fq, fo, flse) =
                    (fold(&dop, kv), fold(&qp, kv), fold(&o, kv), fold(lse, kv));
                for r in before {
                    let len = r.end - r.start;
                    let kb = heads_first(&k.narrow(0, r.start, len));
                    let vb = heads_first(&v.narrow(0, r.start, len));
                    let (gq, gk, gv) =
                        Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
                            &fdo,
                            &fq,
                            &kb,
                            &vb,
                            &fo,
                            &flse,
                            0.0,
                            false,
                            None::<Tensor>,
                            scale,
                        );
                    dqp += unfold(&gq, heads);
                    let _ = dk.narrow(0, r.start, len).g_add_(&rows(&gk));
                    let _ = dv.narrow(0, r.start, len).g_add_(&rows(&gv));
                }
            }
            dq.narrow(0, p.local.start, n)
                .copy_(&dqp.squeeze_dim(0).transpose(0, 1));
        }
    });
    (dq, dk, dv)
}

#[cfg(test)]
mod tests;
