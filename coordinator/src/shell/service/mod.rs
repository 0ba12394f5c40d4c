//! The gRPC shell around the pure coordinator: decode a request, feed the
//! state machine, carry out its effects (persist first, then send and
//! publish), encode the reply. One `std::sync::Mutex` guards the state and
//! is never held across an `.await` (`shared`).

mod admin;
mod calls;
mod carry_out;
pub mod convert;
mod engine;
mod generate;
mod markers;
mod model_folder;
mod push_room;
mod rollouts;
mod serving;
mod shared;
mod tracking;
mod validate;
mod watch;
mod worker;

pub use admin::AdminService;
pub use rollouts::RolloutsService;
pub use shared::{core_status, now_ms, LockStats, SessionTx, Shared};
pub use worker::WorkerServiceImpl;
