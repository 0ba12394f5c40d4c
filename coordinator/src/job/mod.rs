//! The job spec: the TOML a user submits, parsed section by section and
//! validated with every problem named by its field; the settings of each
//! step (the spec plus live `accrue set` changes); the job's data sources
//! and the bounds on its sizes. Pure: nothing here reads more than the
//! files a user names ([`input`]), and nothing imports a layer above.
//!
//! [`spec`] holds the whole ([`spec::JobSpec`]); each section has a file
//! of its own with its serde types, defaults and the checks of its own
//! fields ([`header`] is `[job]`); [`rules`] checks how sections fit
//! together; [`section`] holds what the sections share.

pub mod batch;
pub mod checkpoint;
pub mod data;
pub mod engine;
pub mod env_names;
pub mod environment;
pub mod faults;
pub mod header;
pub mod input;
pub mod limits;
pub mod locate;
pub mod lora;
pub mod model;
pub mod names;
pub mod objective;
pub mod optimizer;
pub mod parallel;
pub mod rl;
pub mod rules;
pub mod runtime;
pub mod section;
pub mod serve;
pub mod settings;
pub mod sources;
pub mod spec;
pub mod tracking;
pub mod verifier;
