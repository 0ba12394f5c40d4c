//! Runs the coordinator's work on a dedicated thread: step plans, aborts and
//! checkpoints, against a [`Trainer`](crate::train::Trainer) (the libtorch trainers in the real
//! worker, a fake in tests).
//!
//! Why a std thread: a step is seconds to minutes of CPU/GPU work, and the
//! session's heartbeats must keep flowing on the tokio runtime meanwhile. The
//! thread owns the trainer (libtorch state is not shared), takes [`Work`]
//! from a queue in order, and sends its answers as ready-made
//! `WorkerMessage`s on an unbounded channel the session forwards.
//!
//! On `Configure` the thread joins the generation's collective (world 1:
//! [`Solo`](crate::collective::Solo); more ranks: through the injected [`Connector`], the CPU TCP
//! ring in the real worker, in-process ranks in tests) and hands it to the
//! trainer; a re-configure rebuilds the collective and keeps the replica
//! when it is at the configured step (and its shards still fit).
//!
//! A step's metrics are *sums* (DESIGN.md "The math"): Σ loss over loss
//! tokens, tokens, documents, padding, and the time split; the coordinator
//! forms the means after summing over ranks.
//!
//! Recovery (issue 6): `configure` restores from a verified checkpoint or
//! takes the state from the live members that hold it (state sync, no
//! disk); an abort interrupts the in-flight step's collective from the
//! session's thread ([`Runner::submit`]); `checkpoint` snapshots state
//! on this thread and writes it on a background one while training goes
//! on; [`fault`] stops the process at named points for fault-injection
//! tests.

mod checkpoint;
mod configure;
mod context;
pub mod fault;
mod generate;
mod handle;
mod probe;
mod publish;
mod reference;
mod step;
mod thread;
mod weight_server;
mod weights;
mod work;
mod writer;

pub use handle::Runner;
pub use step::{run_step, StepOutcome};
pub use weights::WEIGHT_RING_TAG;
pub use work::{
    collective_timeout, default_connector, default_factory, Connector, Factory, Progress,
    RunnerConfig, Work,
};
pub use writer::write_checkpoint;

#[cfg(test)]
mod recovery_tests;
#[cfg(test)]
mod tests;
