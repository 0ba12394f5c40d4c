//! What the replicated trainer holds, as others read it: checkpoint
//! snapshots, parameters, gradients and AdamW moments by HF name, and the
//! bytes of each (the memory table).

use tch::{Kind, Tensor};

use super::grads::{Grads, BUCKET_ELEMENTS};
use super::{Op, ReplicatedTrainer, Sharding};
use crate::train::checkpoint::{self, ShardEntry};
use crate::train::memory::StateBytes;
use crate::train::trainer::{CheckpointWrite, Checkpointing};

/// A parameter's HF name and its AdamW `(exp_avg, exp_avg_sq)`.
pub type NamedMoments = (String, Tensor, Tensor);

impl Checkpointing for ReplicatedTrainer {
    /// Copies what this rank writes of a checkpoint to CPU memory (see
    /// `checkpoint::save_shard` for the layout): the whole parameters
    /// [`checkpoint::assign_tensors`] gives it and their AdamW moments, per
    /// whole parameter so that they restore at any world size. At zero2
    /// the moment shards are all-gathered first (a collective every rank
    /// joins); nothing is written here.
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        if self.lora() {
            return self.adapter_snapshot();
        }
        let (rank, world) = (self.coll.rank(), self.coll.world_size());
        let elt = self.model.kind().elt_size_in_bytes();
        let sizes: Vec<(String, usize)> = self
            .names
            .iter()
            .zip(&self.layout.numels)
            .map(|(n, &numel)| (n.clone(), numel * elt))
            .collect();
        let (avg, avg_sq) = self.full_moments()?;
        let assigned = checkpoint::assign_tensors(&sizes, world);
        let mine: Vec<ShardEntry> = (0..self.names.len())
            .filter(|&i| assigned[&self.names[i]] == rank)
            .map(|i| self.entry(i, &avg, &avg_sq))
            .collect();
        let snap = checkpoint::Snapshot::new(
            rank,
            world,
            &self.model.raw_config,
            self.model.kind(),
            self.opt.step,
            sizes,
            mine,
        );
        Ok(Box::new(move |dir| snap.write(dir)))
    }
}

impl ReplicatedTrainer {
    /// A LoRA job's checkpoint: the adapters are small, so rank 0 writes
    /// it whole (`checkpoint::AdapterSnapshot`) and the other ranks only
    /// join the moments' gather (zero2).
    fn adapter_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        let (avg, avg_sq) = self.full_moments()?;
        if self.coll.rank() != 0 {
            return Ok(Box::new(|_| Ok(Vec::new())));
        }
        let entries: Vec<ShardEntry> = (0..self.names.len())
            .map(|i| self.entry(i, &avg, &avg_sq))
            .collect();
        let snap =
            checkpoint::AdapterSnapshot::new(&self.model, &self.init, self.opt.step, entries)?;
        Ok(Box::new(move |dir| snap.write(dir)))
    }

    /// Parameter `i` with its moments, as a checkpoint writes it.
    fn entry(&self, i: usize, avg: &[Tensor], avg_sq: &[Tensor]) -> ShardEntry {
        ShardEntry {
            name: self.names[i].clone(),
            param: self.params[i].shallow_clone(),
            exp_avg: avg[i].shallow_clone(),
            exp_avg_sq: avg_sq[i].shallow_clone(),
        }
    }

    /// AdamW moments per whole parameter (views of the flat moments at
    /// ddp; zero2: all-gathered from the ranks' shards, a collective every
    /// rank must join).
    fn full_moments(&mut self) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        if self.sharding == Sharding::Ddp {
            return Ok((
                self.layout.views(&self.opt.exp_avg[0]),
                self.layout.views(&self.opt.exp_avg_sq[0]),
            ));
        }
        let device = self.model.vs.device();
        let range = self.shard();
        let mut out = Vec::with_capacity(2);
        for which in 0..2 {
            let mut full = Tensor::zeros([self.layout.total as i64], (Kind::Float, device));
            let local = if which == 0 {
                &self.opt.exp_avg[0]
            } else {
                &self.opt.exp_avg_sq[0]
            };
            full.narrow(0, range.start as i64, range.len() as i64)
                .copy_(local);
            self.collective(Op::AllGather, &mut full)?;
            out.push(self.layout.views(&full));
        }
        let avg_sq = out.pop().unwrap_or_default();
        let avg = out.pop().unwrap_or_default();
        Ok((avg, avg_sq))
    }

    /// HF names → shallow clones of the parameters (sorted by name).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    /// HF names → full parameters (every rank holds them at ddp and zero2;
    /// the same method on the FSDP trainer gathers them).
    pub fn named_full_parameters(&mut self) -> anyhow::Result<Vec<(String, Tensor)>> {
        Ok(self.named_parameters())
    }

    /// HF names → the gradient this rank has accumulated so far (tests):
    /// at ddp each parameter's whole (unreduced) gradient, shaped like it;
    /// at zero2 the flat piece of each parameter inside this rank's shard
    /// (reduced over ranks; empty for a parameter outside it). Views: a
    /// test may write into them.
    pub fn named_grads(&mut self) -> Vec<(String, Tensor)> {
        let flat = self.grads.take_flat(&self.layout);
        let views: Vec<Tensor> = match self.sharding {
            Sharding::Ddp => self.layout.views(&flat),
            Sharding::Zero2 => {
                let shard = self.shard();
                (0..self.names.len())
                    .map(|i| {
                        let (o, n) = (self.layout.offsets[i], self.layout.numels[i]);
                        let lo = o.clamp(shard.start, shard.end);
                        let hi = (o + n).clamp(lo, shard.end);
                        flat.narrow(0, (lo - shard.start) as i64, (hi - lo) as i64)
                    })
                    .collect()
            }
        };
        self.names.iter().cloned().zip(views).collect()
    }

    /// HF names → AdamW `(exp_avg, exp_avg_sq)` per whole parameter and the
    /// optimizer step count. At zero2 this gathers the shards: every rank
    /// must call it.
    pub fn optimizer_state(&mut self) -> anyhow::Result<(u64, Vec<NamedMoments>)> {
        let (avg, avg_sq) = self.full_moments()?;
        let state = self
            .names
            .iter()
            .cloned()
            .zip(avg.into_iter().zip(avg_sq))
            .map(|(n, (a, s))| (n, a, s))
            .collect();
        Ok((self.opt.step, state))
    }

    /// Bytes of parameters, gradients and optimizer state this rank holds
    /// (see [`StateBytes`]).
    pub fn state_bytes(&self) -> StateBytes {
        let numel = self.layout.total as u64;
        let master = self.flat_params.kind().elt_size_in_bytes() as u64;
        let compute = self.net().kind().elt_size_in_bytes() as u64;
        let moments: u64 = self
            .opt
            .exp_avg
            .iter()
            .chain(&self.opt.exp_avg_sq)
            .map(|t| t.numel() as u64 * 4)
            .sum();
        let world = self.coll.world_size() as u64;
        let boundary = match (&self.grads, world) {
            (Grads::Sharded { .. }, w) if w > 1 => {
                let longest = numel.div_ceil(w);
                4 * w * longest.min(BUCKET_ELEMENTS as u64 / w).max(1)
            }
            _ => 0,
        };
        StateBytes {
            params: numel * master,
            grads: self.grads.bytes(),
            optimizer: moments,
            compute_copy: if self.compute.is_some() {
                numel * compute
            } else {
                0
            },
            backward: numel * compute,
            boundary,
            frozen: self.frozen_bytes(),
        }
    }

    /// Bytes of the variables that do not train (a LoRA job's base).
    fn frozen_bytes(&self) -> u64 {
        self.model
            .vs
            .variables()
            .iter()
            .filter(|(n, _)| self.lora() && !crate::model::lora::is_adapter(n))
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }
}
