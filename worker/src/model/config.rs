//! The model's `config.json` and the variants of its family: the
//! `accrue-arch` crate, shared with the coordinator's admission check.

pub use accrue_arch::{
    Act, Arch, AttnBias, BlockNorms, Family, LayerSpec, ModelConfig, MoeSpec, QkNorm, RopeScaling,
    RopeSpec,
};
