//! The job spec: the TOML a user submits, parsed section by section and
//! validated with every problem named by its field; the settings of each
//! step (the spec plus live `accrue set` changes); the job's data sources
//! and the bounds on its sizes. Pure: nothing here reads more than the
//! files a user names ([`input`]), and nothing imports a layer above.

pub mod engine;
pub mod input;
pub mod limits;
pub mod locate;
pub mod names;
pub mod objective;
pub mod settings;
pub mod sources;
pub mod spec;
pub mod verifier;
