//! Training on packed microbatches: the wire batch, the trainer (SFT
//! objective, exact accumulation), AdamW and checkpoints.

pub mod batch;
pub mod checkpoint;
pub mod flat;
pub mod fsdp;
pub mod optim;
pub mod trainer;

pub use batch::PackedBatch;
pub use trainer::{MicrobatchSums, Sharding, StateBytes, StepStats, Trainer};
