//! The RL loop, pure half and shell half side by side: policy-gradient
//! groups and advantages ([`pg`], [`rollouts`]), a streamed job's rollout
//! queue ([`stream`]), the loop's prompts and generation rounds
//! ([`prompts`], [`rounds`]), the core's handlers for rounds on the
//! workers ([`rollout_loop`]) and apart from them ([`engine`]), and the
//! shell's scoring ([`scorer`], [`verify`]).

pub mod engine;
pub mod pg;
pub mod prompts;
pub mod rollout_loop;
pub mod rollouts;
pub mod rounds;
pub mod scorer;
pub mod stream;
pub mod streamed;
pub mod verify;
