//! The one-shot admin commands (`submit`, `jobs`, `status`, `cancel`,
//! `pause`, `resume`, `workers`, `drain`, `checkpoint`): each connects, makes
//! one call and prints the reply through [`super::render`].

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use tonic::Code;

use super::client::{check_request_size, connect, rpc_error, AdminConn};
use super::output::{errln, out, outln};
use super::render;
use crate::args::Conn;
use accrue_coordinator::wire::{
    CancelJobRequest, DrainWorkerRequest, GetJobRequest, JobSummary, ListJobsRequest,
    ListWorkersRequest, PauseJobRequest, ResumeJobRequest, SubmitJobRequest,
    TriggerCheckpointRequest,
};

async fn client(conn: &Conn) -> anyhow::Result<AdminConn> {
    connect(conn).await
}

fn print_json(v: &serde_json::Value) -> anyhow::Result<ExitCode> {
    outln!("{}", serde_json::to_string_pretty(v)?)?;
    Ok(ExitCode::SUCCESS)
}

/// `accrue submit`: prints the new job's id alone on stdout. A spec the
/// coordinator rejects (InvalidArgument) prints its problems and exits 1.
pub async fn submit(conn: &Conn, path: &Path, new_job: bool) -> anyhow::Result<ExitCode> {
    let spec_toml = accrue_coordinator::job::input::read_spec(
        path,
        accrue_coordinator::job::input::MAX_CONFIG_BYTES,
    )?;
    let base_dir = std::env::current_dir().context("cannot determine the current directory")?;
    let base_dir = std::path::absolute(&base_dir).unwrap_or(base_dir);
    let req = SubmitJobRequest {
        spec_toml,
        base_dir: base_dir.display().to_string(),
        new_job,
    };
    let what = format!("the submit request of {}", path.display());
    check_request_size(conn, &what, prost::Message::encoded_len(&req))?;
    let mut c = client(conn).await?;
    match c.submit_job(req).await {
        Ok(r) => {
            let r = r.into_inner();
            if r.existing {
                errln!(
                    "a job of this name and spec is already live: {} (nothing new started; --new starts another)",
                    r.job_id
                );
            }
            outln!("{}", r.job_id)?;
            Ok(ExitCode::SUCCESS)
        }
        Err(s) if s.code() == Code::AlreadyExists => {
            errln!("error: {}", s.message());
            Ok(ExitCode::FAILURE)
        }
        Err(s) if s.code() == Code::InvalidArgument => {
            errln!("error: the coordinator rejected {}:", path.display());
            for line in s.message().lines() {
                errln!("{line}");
            }
            Ok(ExitCode::FAILURE)
        }
        Err(s) => Err(rpc_error(&s, &conn.coordinator))
            .with_context(|| format!("submit {}", path.display())),
    }
}

/// `accrue jobs`.
pub async fn jobs(conn: &Conn, json: bool) -> anyhow::Result<ExitCode> {
    let r = client(conn)
        .await?
        .list_jobs(ListJobsRequest {})
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .context("list jobs")?
        .into_inner();
    if json {
        return print_json(&render::jobs_json(&r.jobs));
    }
    out!("{}", render::jobs_table(&r.jobs))?;
    Ok(ExitCode::SUCCESS)
}

/// `accrue status JOB`.
pub async fn status(conn: &Conn, job_id: &str, json: bool) -> anyhow::Result<ExitCode> {
    let r = client(conn)
        .await?
        .get_job(GetJobRequest {
            job_id: job_id.into(),
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("get job {job_id}"))?
        .into_inner();
    if json {
        return print_json(&render::job_detail_json(&r));
    }
    out!("{}", render::job_detail(&r, now_unix_ms()))?;
    Ok(ExitCode::SUCCESS)
}

/// A job state change requested by an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Cancel,
    Pause,
    Resume,
}

/// `accrue cancel|pause|resume JOB`: prints `<job>: <new state>`.
pub async fn transition(conn: &Conn, job_id: &str, t: Transition) -> anyhow::Result<ExitCode> {
    let mut c = client(conn).await?;
    let job_id = job_id.to_string();
    let (verb, reply) = match t {
        Transition::Cancel => (
            "cancel",
            c.cancel_job(CancelJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .map(|r| r.into_inner().job),
        ),
        Transition::Pause => (
            "pause",
            c.pause_job(PauseJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .map(|r| r.into_inner().job),
        ),
        Transition::Resume => (
            "resume",
            c.resume_job(ResumeJobRequest {
                job_id: job_id.clone(),
            })
            .await
            .map(|r| r.into_inner().job),
        ),
    };
    let job: Option<JobSummary> = reply
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("{verb} job {job_id}"))?;
    let job = job.with_context(|| format!("{verb} job {job_id}: the reply has no job summary"))?;
    outln!("{}: {}", job.job_id, render::job_state_name(job.state))?;
    Ok(ExitCode::SUCCESS)
}

/// `accrue workers`.
pub async fn workers(conn: &Conn, json: bool) -> anyhow::Result<ExitCode> {
    let r = client(conn)
        .await?
        .list_workers(ListWorkersRequest {})
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .context("list workers")?
        .into_inner();
    if json {
        return print_json(&render::workers_json(&r.workers));
    }
    out!("{}", render::workers_table(&r.workers))?;
    Ok(ExitCode::SUCCESS)
}

/// `accrue drain WORKER`: prints `<worker>: <new state>`.
pub async fn drain(conn: &Conn, worker_id: &str) -> anyhow::Result<ExitCode> {
    let w = client(conn)
        .await?
        .drain_worker(DrainWorkerRequest {
            worker_id: worker_id.into(),
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("drain worker {worker_id}"))?
        .into_inner()
        .worker
        .with_context(|| format!("drain worker {worker_id}: the reply has no worker"))?;
    outln!("{}: {}", w.worker_id, render::worker_state_name(w.state))?;
    Ok(ExitCode::SUCCESS)
}

/// `accrue checkpoint JOB`: prints the step at whose boundary the checkpoint
/// will be written, alone on stdout.
pub async fn checkpoint(conn: &Conn, job_id: &str) -> anyhow::Result<ExitCode> {
    let r = client(conn)
        .await?
        .trigger_checkpoint(TriggerCheckpointRequest {
            job_id: job_id.into(),
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("checkpoint job {job_id}"))?
        .into_inner();
    outln!("{}", r.step)?;
    Ok(ExitCode::SUCCESS)
}

/// Wall-clock time for "submitted … ago"; the CLI's only clock read.
pub(crate) fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
