//! The flat layout of all parameters that the data-parallel trainers keep
//! their master weights, gradients and AdamW moments in, and reduce, shard
//! and gather through a [`Collective`](crate::collective::Collective):
//! parameter `i` occupies `offsets[i] .. offsets[i] + numels[i]`, and a
//! rank's shard is [`shard_range`](crate::collective::shard_range) of the
//! total, which may cut through parameters (ZeRO-2 shards are element
//! ranges, not tensors). Parameters that decay come first, then those
//! that do not (each group in name order), so the optimizer updates each
//! weight-decay group as one contiguous run.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::optim::Segment;

/// Where each parameter lives in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    pub offsets: Vec<usize>,
    pub numels: Vec<usize>,
    pub shapes: Vec<Vec<i64>>,
    pub total: usize,
    /// Parameter indices in flat order.
    order: Vec<usize>,
    /// Whether each parameter takes weight decay.
    decay: Vec<bool>,
}

impl FlatLayout {
    /// Every parameter in index order, all decaying.
    pub fn new(params: &[Tensor]) -> FlatLayout {
        FlatLayout::grouped(params, &vec![true; params.len()])
    }

    /// Decaying parameters first, then the others, each in index order.
    pub fn grouped(params: &[Tensor], decay: &[bool]) -> FlatLayout {
        assert_eq!(params.len(), decay.len(), "one decay flag per parameter");
        let order: Vec<usize> = (0..params.len())
            .filter(|&i| decay[i])
            .chain((0..params.len()).filter(|&i| !decay[i]))
            .collect();
        let mut offsets = vec![0; params.len()];
        let mut total = 0;
        for &i in &order {
            offsets[i] = total;
            total += params[i].numel();
        }
        FlatLayout {
            offsets,
            numels: params.iter().map(Tensor::numel).collect(),
            shapes: params.iter().map(Tensor::size).collect(),
            total,
            order,
            decay: decay.to_vec(),
        }
    }

    /// The weight-decay runs of the elements `range`, relative to its start.
    pub fn segments(&self, range: Range<usize>) -> Vec<Segment> {
        let runs: Vec<Segment> = self
            .order
            .iter()
            .map(|&i| Segment {
                range: self.offsets[i]..self.offsets[i] + self.numels[i],
                decay: self.decay[i],
            })
            .collect();
        super::optim::segments_within(&runs, range)
    }

    /// One f32 buffer holding `tensors[i]` at parameter `i`'s place;
    /// undefined tensors (a parameter without a gradient on this rank)
    /// contribute zeros.
    pub fn flatten(&self, tensors: &[Tensor], device: Device) -> Tensor {
        let parts: Vec<Tensor> = self
            .order
            .iter()
            .map(|&i| {
                let t = &tensors[i];
                if t.defined() {
                    t.detach().reshape([-1]).to_kind(Kind::Float)
                } else {
                    Tensor::zeros([self.numels[i] as i64], (Kind::Float, device))
                }
            })
            .collect();
        if parts.is_empty() {
            return Tensor::zeros([0], (Kind::Float, device));
        }
        Tensor::cat(&parts, 0)
    }

    /// Per-parameter views (shaped like the parameters) into `flat`.
    pub fn views(&self, flat: &Tensor) -> Vec<Tensor> {
        self.offsets
            .iter()
            .zip(&self.numels)
            .zip(&self.shapes)
            .map(|((&o, &n), shape)| flat.narrow(0, o as i64, n as i64).view(shape.as_slice()))
            .collect()
    }

    /// The elements `range` of the flat layout of `tensors`, as a new f32
    /// tensor (the pieces of every parameter the range overlaps).
    pub fn slice(&self, tensors: &[Tensor], range: Range<usize>, device: Device) -> Tensor {
        let parts: Vec<Tensor> = self
            .pieces(range)
            .map(|(i, within)| {
                tensors[i]
                    .detach()
                    .reshape([-1])
                    .narrow(0, within.start as i64, within.len() as i64)
                    .to_kind(Kind::Float)
            })
            .collect();
        if parts.is_empty() {
            return Tensor::zeros([0], (Kind::Float, device));
        }
        // `copy` so the result never aliases a parameter.
        Tensor::cat(&parts, 0).copy()
    }

    /// `(parameter, element range within it)` for every parameter that
    /// `range` of the flat layout overlaps, in flat order.
    pub fn pieces(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.order.iter().filter_map(move |&i| {
            let (o, n) = (self.offsets[i], self.numels[i]);
            let lo = range.start.max(o);
            let hi = range.end.min(o + n);
            (lo < hi).then(|| (i, lo - o..hi - o))
        })
    }

    /// Writes the elements `range` of the flat layout of `tensors` into
    /// `dst[0 .. range.len()]` (cast to its dtype); pieces of undefined or
    /// missing tensors are left as they are.
    pub fn copy_range_into(&self, dst: &Tensor, tensors: &[Tensor], range: Range<usize>) {
        tch::no_grad(|| {
            for (i, within) in self.pieces(range.clone()) {
                let Some(t) = tensors.get(i).filter(|t| t.defined()) else {
                    continue;
                };
                let at = self.offsets[i] + within.start - range.start;
                dst.narrow(0, at as i64, within.len() as i64).copy_(
                    &t.detach()
                        .reshape([-1])
                        .narrow(0, within.start as i64, within.len() as i64),
                );
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_through_parameters() {
        let params = [
            Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)),
            Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        ];
        let l = FlatLayout::new(&params);
        assert_eq!(l.total, 11);
        let p: Vec<_> = l.pieces(4..8).collect();
        assert_eq!(p, vec![(0, 4..6), (1, 0..2)]);
        let p: Vec<_> = l.pieces(10..11).collect();
        assert_eq!(p, vec![(2, 0..1)]);
        assert_eq!(l.pieces(5..5).count(), 0);
    }

    #[test]
    fn slice_and_flatten_agree() {
        let a = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        let b = Tensor::arange(4, (Kind::Float, Device::Cpu)) + 100.0;
        let params = [a, b];
        let l = FlatLayout::new(&params);
        let flat = l.flatten(&params, Device::Cpu);
        let s = l.slice(&params, 3..8, Device::Cpu);
        assert_eq!(
            Vec::<f32>::try_from(&s).unwrap(),
            Vec::<f32>::try_from(&flat.narrow(0, 3, 5)).unwrap()
        );
        let v = l.views(&flat);
        assert_eq!(v[0].size(), vec![2, 3]);
        assert_eq!(f32::try_from(v[1].get(2)).unwrap(), 102.0);
        let none = l.flatten(&[Tensor::new(), params[1].shallow_clone()], Device::Cpu);
        assert_eq!(f32::try_from(none.sum(Kind::Float)).unwrap(), 406.0);
    }
}
