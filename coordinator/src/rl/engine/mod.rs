//! The engine: where a job's rounds are generated apart from its trainers,
//! an external inference server (`[rl.engine]`) or the job's own generator
//! workers (`rl.generators`). [`tick`] is the core's side (what to start
//! next, and the answers); [`wire`] and [`client`] are the shell's (the
//! server's HTTP API and the calls).

pub mod client;
pub mod tick;
pub mod wire;
