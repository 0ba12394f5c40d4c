//! The RL loop, its parts side by side in three layers:
//! - its state, below the core (imports `crate::job` and `crate::stream`
//!   only): policy-gradient groups and advantages ([`pg`], [`rollouts`]), a
//!   streamed job's rollout queue ([`stream`]), the loop's prompts and
//!   generation rounds ([`prompts`], [`rounds`]); and what the shell runs
//!   off the state lock: scoring a round ([`scorer`], [`verify`]) and the
//!   external engine's wire and HTTP calls ([`engine::wire`],
//!   [`engine::client`]);
//! - the core's handlers of its events (import `crate::core`, run on a
//!   job's context): rounds on the workers ([`rollout_loop`]), apart from
//!   them ([`engine::tick`]), a streamed queue's pushes ([`streamed`]), a
//!   served job's endpoint calls ([`serving`]; its queue is [`serve`]).

pub mod endpoint;
pub mod engine;
pub mod env_command;
pub mod episode;
pub mod generation;
pub mod pg;
pub mod prompts;
pub mod rollout_loop;
pub mod rollouts;
pub mod rounds;
pub mod scorer;
pub mod serve;
pub mod serving;
pub mod stream;
pub mod streamed;
pub mod tools;
pub mod verify;
