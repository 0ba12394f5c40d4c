//! Accrue coordinator: owns the data stream, plans steps, tracks jobs and
//! workers, and serves the admin and worker gRPC APIs.
//!
//! Pure domain modules (`doc`, `cursor`, `spec`, `data`, `plan`, `core`) do
//! no network I/O; `service` and `server` adapt them to tonic.

pub mod bench;
pub mod cli;
pub mod core;
pub mod cursor;
pub mod data;
pub mod doc;
pub mod plan;
pub mod server;
pub mod service;
pub mod spec;
pub mod store;

pub use accrue_proto::v1 as wire;
