//! What a rank's training state costs in memory, by kind (the memory
//! table of issues 4 and 15).

/// Bytes of training state one rank holds (the memory table of issues 4
/// and 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    /// Master parameters (model dtype).
    pub params: u64,
    /// Gradients held between microbatches and at the boundary (float32:
    /// the whole gradient at ddp, this rank's shard at zero2).
    pub grads: u64,
    /// AdamW moments (f32).
    pub optimizer: u64,
    /// Mixed precision: the compute-dtype copy of the parameters.
    pub compute_copy: u64,
    /// Transient, per microbatch: the gradients autograd hands over when a
    /// backward returns (compute dtype), before they are summed or
    /// reduce-scattered.
    pub backward: u64,
    /// Transient, at the boundary or per reduction: the largest extra
    /// buffer a collective needs (zero2: one reduce-scatter round).
    pub boundary: u64,
    /// Parameters held that do not train (a LoRA job's frozen base, in
    /// the compute dtype).
    pub frozen: u64,
}

impl StateBytes {
    /// What a rank holds between steps: parameters (frozen ones too) +
    /// gradients + optimizer state + the compute copy.
    pub fn total(&self) -> u64 {
        self.params + self.frozen + self.grads + self.optimizer + self.compute_copy
    }
}
