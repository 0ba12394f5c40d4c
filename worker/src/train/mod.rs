//! Training on packed microbatches: the [`Trainer`] interface and its two
//! implementations ([`ReplicatedTrainer`] for ddp and zero2,
//! [`FsdpTrainer`] for fsdp), AdamW, and checkpoints.

mod build;
pub mod checkpoint;
pub mod finite;
pub mod flat;
pub mod fsdp;
pub mod generator;
pub mod memory;
pub mod optim;
pub mod policy_sync;
pub mod replicated;
pub mod routing;
pub mod source;
pub mod trainer;

pub use build::build;
pub use fsdp::FsdpTrainer;
pub use generator::Generator;
pub use memory::StateBytes;
pub use replicated::{ReplicatedTrainer, Sharding};
pub use trainer::{CheckpointWrite, Checkpointing, Membership, Passes, Policy, StepStats, Trainer};
