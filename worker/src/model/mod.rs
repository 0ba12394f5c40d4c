//! The decoder of every family Accrue trains, in tch: HF config and
//! safetensors compatible, padding-free packed forward, chunked LM head +
//! cross-entropy.

pub mod adapter;
pub mod attention;
pub mod config;
pub mod context;
pub mod decode;
pub mod flops;
pub mod init;
pub mod linear;
pub mod llama;
pub mod lora;
pub mod loss;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod recompute;
pub mod rope;
pub mod varlen;
pub mod weights;

pub use attention::PackedAttention;
pub use config::ModelConfig;
pub use decode::{KvCache, Prefix};
pub use init::Init;
pub use llama::Llama;
pub use moe::{Route, Routed, Routes};
