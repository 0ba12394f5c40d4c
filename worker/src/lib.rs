//! Accrue worker. This crate is the only one that will link libtorch; until
//! the worker issue lands it only pins the wire contract it builds on.

pub use accrue_proto::v1 as wire;
