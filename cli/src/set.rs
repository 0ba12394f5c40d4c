//! `accrue set JOB --docs-per-step N --tokens-per-step T --max-tokens M --lr X`:
//! changes step settings of a running job from its next new step on. The
//! coordinator validates like a spec (InvalidArgument naming the field,
//! nothing changed); on success this prints the step the change starts at.

use std::process::ExitCode;

use anyhow::Context as _;

use super::client::{connect, rpc_error};
use super::output::outln;
use crate::args::Conn;
use accrue_coordinator::wire::UpdateJobRequest;

/// The settings `accrue set` can change; unset ones stay as they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SetArgs {
    pub job: String,
    pub docs_per_step: Option<u64>,
    pub tokens_per_step: Option<u64>,
    pub max_tokens: Option<u32>,
    pub lr: Option<f64>,
    /// Mixture weights by source name.
    pub weights: Vec<(String, f64)>,
}

/// The request `args` stands for.
pub fn request(args: &SetArgs) -> UpdateJobRequest {
    UpdateJobRequest {
        job_id: args.job.clone(),
        docs_per_step: args.docs_per_step,
        tokens_per_step: args.tokens_per_step,
        max_tokens: args.max_tokens,
        lr: args.lr,
        weights: args.weights.iter().cloned().collect(),
    }
}

/// `accrue set`: prints `<job>: from step <n>`.
pub async fn run(conn: &Conn, args: &SetArgs) -> anyhow::Result<ExitCode> {
    let r = connect(conn)
        .await?
        .update_job(request(args))
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("update job {}", args.job))?
        .into_inner();
    outln!("{}: from step {}", args.job, r.from_step)?;
    Ok(ExitCode::SUCCESS)
}
