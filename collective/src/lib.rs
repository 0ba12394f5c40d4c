//! Collectives between the worker processes of one generation (DESIGN.md
//! "Ranks and collectives"): a bandwidth-optimal ring over TCP, pure Rust,
//! no libtorch, so the worker (CPU training), the coordinator's benchmark and
//! the NCCL bootstrap all share it.
//!
//! - [`shard_range`]: how a flat buffer is split among ranks (the layout the
//!   trainers, reduce-scatter and all-gather agree on).
//! - [`plan`]: the ring schedules as data (which byte ranges each rank sends
//!   and receives at each step, and what each piece waits for), with no I/O.
//! - [`TcpRing`]: runs those schedules over two TCP connections per rank
//!   (to the next rank, from the previous one) with a sender thread so that
//!   sending and receiving overlap, per-message generation/sequence checks,
//!   and a deadline on every operation.
//! - [`LinkKey`]: the generation's secret that authenticates the ring's
//!   connections and, with TLS, seals every piece (`link`).
//!
//! The algorithm is the ring all-reduce of Patarasuk & Yuan, "Bandwidth
//! optimal all-reduce algorithms for clusters of workstations" (2009), as
//! used by Horovod and NCCL's ring: reduce-scatter then all-gather, each
//! rank sending 2·(n−1)/n of the buffer in total.

mod config;
mod connect;
mod error;
pub mod link;
pub mod plan;
mod ring;
mod shard;
mod wire;

pub use config::RingConfig;
pub use error::{CollectiveError, CollectiveResult};
pub use link::{LinkKey, Sealing};
pub use ring::{RingAbort, TcpRing};
pub use shard::shard_range;
pub use wire::Op;
