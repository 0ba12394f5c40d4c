//! `accrue watch JOB`: follows a job's `WatchJob` stream until the job ends.
//! A progress bar on stderr shows the step and the latest loss and
//! throughput; events (generations, checkpoints, aborts, state changes) are
//! printed above it. With `--json` every stream item is one JSON line on
//! stdout instead. Exit 0 when the job completed, 1 when it failed or was
//! cancelled.

use std::process::ExitCode;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};

use super::client::{connect, rpc_error};
use super::output::outln;
use super::render;
use crate::args::Conn;
use accrue_coordinator::wire::{
    watch_job_response::Item, GetJobRequest, JobState, WatchJobRequest,
};

/// The exit code for a job in `state`: `Some` once the job has ended.
pub fn exit_for(state: i32) -> Option<ExitCode> {
    match JobState::try_from(state).ok()? {
        JobState::Completed => Some(ExitCode::SUCCESS),
        JobState::Failed | JobState::Cancelled => Some(ExitCode::FAILURE),
        JobState::Unspecified | JobState::Pending | JobState::Running | JobState::Paused => None,
    }
}

/// The job state the stream has shown last: each event with a state
/// replaces it; steps leave it alone.
pub fn next_state(current: i32, item: &Item) -> i32 {
    match item {
        Item::Event(e) if e.state != JobState::Unspecified as i32 => e.state,
        _ => current,
    }
}

/// Where human output goes: above the bar when it is drawn, else plain
/// stdout (so piping `watch` into a file still logs every step).
struct Progress {
    bar: ProgressBar,
}

impl Progress {
    fn new(total_steps: u64) -> Self {
        let bar = if total_steps > 0 {
            let bar = ProgressBar::new(total_steps);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:40.cyan/blue} step {pos}/{len} · {msg} [{elapsed_precise}, eta {eta}]",
            ) {
                bar.set_style(style);
            }
            bar
        } else {
            let bar = ProgressBar::no_length();
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} step {pos} · {msg} [{elapsed_precise}]")
            {
                bar.set_style(style);
            }
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            bar
        };
        bar.set_message("waiting for the first step");
        Self { bar }
    }

    fn line(&self, s: &str) -> std::io::Result<()> {
        if self.bar.is_hidden() {
            outln!("{s}")?;
        } else {
            self.bar.println(s);
        }
        Ok(())
    }

    fn show(&self, item: &Item) -> std::io::Result<()> {
        match item {
            Item::Step(s) => {
                self.bar.set_position(s.step);
                self.bar.set_message(render::bar_message(s));
                if self.bar.is_hidden() {
                    outln!("{}", render::step_line(s))?;
                }
                Ok(())
            }
            Item::Event(e) => self.line(&render::event_line(e)),
            Item::Eval(e) => self.line(&render::eval_line(e)),
        }
    }
}

/// Runs `accrue watch`.
pub async fn run(
    conn: &Conn,
    job_id: &str,
    from_step: u64,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut c = connect(conn).await?;
    let get = GetJobRequest {
        job_id: job_id.into(),
    };
    // Learn the total (for the bar) and that the job exists.
    let job = c
        .get_job(get.clone())
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("get job {job_id}"))?
        .into_inner()
        .job
        .with_context(|| format!("get job {job_id}: the reply has no job summary"))?;
    let mut state = job.state;
    let mut stream = c
        .watch_job(WatchJobRequest {
            job_id: job_id.into(),
            from_step,
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("watch job {job_id}"))?
        .into_inner();

    let progress = (!json).then(|| Progress::new(job.total_steps));
    if let Some(p) = &progress {
        p.bar.set_position(job.step);
    }
    loop {
        let msg = stream
            .message()
            .await
            .map_err(|s| rpc_error(&s, &conn.coordinator))
            .with_context(|| format!("watch job {job_id}"));
        let item = match msg {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                if let Some(p) = &progress {
                    p.bar.abandon();
                }
                return Err(e);
            }
        };
        if json {
            if let Some(v) = render::watch_item_json(&item) {
                outln!("{v}")?;
            }
        }
        if let Some(item) = &item.item {
            if let Some(p) = &progress {
                p.show(item)?;
            }
            state = next_state(state, item);
        }
    }
    if let Some(p) = &progress {
        p.bar.finish_and_clear();
    }

    // The stream ended without a final state event: ask once more.
    if exit_for(state).is_none() {
        if let Ok(r) = c.get_job(get).await {
            if let Some(j) = r.into_inner().job {
                state = j.state;
            }
        }
    }
    let name = render::job_state_name(state);
    match exit_for(state) {
        Some(code) => {
            if !json {
                outln!("job {job_id} {name}")?;
            }
            Ok(code)
        }
        None => {
            anyhow::bail!("the watch stream of job {job_id} ended while the job is still {name}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accrue_coordinator::wire::{EventKind, JobEvent, StepMetrics};

    fn event(state: JobState) -> Item {
        Item::Event(JobEvent {
            kind: EventKind::State as i32,
            state: state as i32,
            ..Default::default()
        })
    }

    #[test]
    fn only_ended_jobs_have_an_exit_code() {
        assert_eq!(
            exit_for(JobState::Completed as i32),
            Some(ExitCode::SUCCESS)
        );
        assert_eq!(exit_for(JobState::Failed as i32), Some(ExitCode::FAILURE));
        assert_eq!(
            exit_for(JobState::Cancelled as i32),
            Some(ExitCode::FAILURE)
        );
        for s in [
            JobState::Unspecified,
            JobState::Pending,
            JobState::Running,
            JobState::Paused,
        ] {
            assert_eq!(exit_for(s as i32), None, "{s:?}");
        }
        assert_eq!(exit_for(99), None);
    }

    #[test]
    fn the_last_event_with_a_state_decides() {
        let items = [
            event(JobState::Running),
            Item::Step(StepMetrics::default()),
            event(JobState::Paused),
            Item::Event(JobEvent {
                kind: EventKind::Checkpoint as i32,
                ..Default::default()
            }),
            event(JobState::Running),
            event(JobState::Failed),
            Item::Step(StepMetrics::default()),
        ];
        let state = items.iter().fold(JobState::Pending as i32, next_state);
        assert_eq!(state, JobState::Failed as i32);
    }
}
