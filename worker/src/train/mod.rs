//! Training on packed microbatches: the [`Engine`] interface and its two
//! implementations (the replicated [`Trainer`] for ddp and zero2, the
//! sharded [`FsdpTrainer`]), AdamW, and checkpoints.

pub mod checkpoint;
pub mod engine;
pub mod finite;
pub mod flat;
pub mod fsdp;
pub mod generator;
pub mod memory;
pub mod optim;
pub mod policy_sync;
pub mod source;
pub mod trainer;

pub use engine::{build, CheckpointWrite, Engine, Policy};
pub use fsdp::FsdpTrainer;
pub use generator::Generator;
pub use memory::StateBytes;
pub use trainer::{Sharding, StepStats, Trainer};
