//! How the coordinator's metrics move: the service layer's observations
//! of state-machine effects, and the gauges read at scrape time.

use std::sync::Mutex;
use std::time::Duration;

use prometheus::{Encoder, TextEncoder};

use super::Exporter;
use crate::core::{AbortReason, Coordinator, JobState, StepMetrics, WorkerState};
use crate::rl::stream::AdmitCounts;

impl Exporter {
    /// Records a committed step of `job`.
    pub fn observe_step(&self, job: &str, m: &StepMetrics) {
        let l = &[job];
        self.steps.steps.with_label_values(l).inc();
        self.steps.tokens.with_label_values(l).inc_by(m.tokens);
        self.steps.documents.with_label_values(l).inc_by(m.docs);
        for (phase, s) in [
            ("compute", m.compute_s),
            ("collective", m.collective_s),
            ("optimizer", m.optimizer_s),
            ("idle", m.idle_s),
        ] {
            // Counters only go up: a clock step back on a worker is not a
            // reason to poison the series.
            if s.is_finite() && s > 0.0 {
                self.steps
                    .rank_seconds
                    .with_label_values(&[job, phase])
                    .inc_by(s);
            }
        }
        self.steps
            .step_duration
            .with_label_values(l)
            .observe(m.step_time_s);
        self.steps.step_time.with_label_values(l).set(m.step_time_s);
        self.steps
            .tokens_per_s
            .with_label_values(l)
            .set(m.tokens_per_s);
        self.steps.mfu.with_label_values(l).set(m.mfu);
        for (kind, bytes) in [
            ("allocated", m.gpu_memory_peak_allocated_bytes),
            ("reserved", m.gpu_memory_peak_reserved_bytes),
        ] {
            if bytes > 0 {
                self.steps
                    .gpu_memory
                    .with_label_values(&[job, kind])
                    .set(bytes as f64);
            }
        }
        self.steps
            .padding
            .with_label_values(l)
            .set(m.padding_fraction);
        self.steps.loss.with_label_values(l).set(m.loss);
        for (source, s) in &m.sources {
            let l = &[job, source.as_str()];
            self.sources.source_loss.with_label_values(l).set(s.loss);
            self.sources
                .source_tokens
                .with_label_values(l)
                .inc_by(s.tokens);
            self.sources
                .source_documents
                .with_label_values(l)
                .inc_by(s.docs);
        }
        self.steps.grad_norm.with_label_values(l).set(m.grad_norm);
        self.steps.lr.with_label_values(l).set(m.lr);
        self.steps.job_step.with_label_values(l).set(m.step as i64);
        self.steps
            .world_size
            .with_label_values(l)
            .set(i64::from(m.world_size));
        self.state
            .generation
            .with_label_values(l)
            .set(m.generation as i64);
    }

    /// Records an evaluation of `job`: its loss over all and per source.
    pub fn observe_eval(&self, job: &str, e: &crate::core::EvalMetrics) {
        self.sources
            .eval_loss
            .with_label_values(&[job, "all"])
            .set(e.loss);
        for (source, s) in &e.sources {
            self.sources
                .eval_loss
                .with_label_values(&[job, source])
                .set(s.loss);
        }
    }

    /// Records a step plan of `job` dispatched: `plan` is the wall time of
    /// the state-machine call that made it, `dispatch` the time from then
    /// until the last rank's plan was queued.
    pub fn observe_plan(&self, job: &str, plan: Duration, dispatch: Duration) {
        self.dispatch.plans.with_label_values(&[job]).inc();
        self.dispatch
            .plan_duration
            .with_label_values(&[job])
            .observe(plan.as_secs_f64());
        self.dispatch
            .dispatch_duration
            .with_label_values(&[job])
            .observe(dispatch.as_secs_f64());
    }

    /// Records the call that planned `job`'s next step while one ran
    /// (`core::ahead`): planning time, though no plan went out.
    pub fn observe_plan_ahead(&self, job: &str, plan: Duration) {
        self.dispatch
            .plan_ahead_duration
            .with_label_values(&[job])
            .observe(plan.as_secs_f64());
    }

    /// Seconds spent planning `job`'s steps so far (the state-machine
    /// calls that planned one, at dispatch or ahead), and how many were
    /// dispatched: what the control-plane benchmark reports as planning
    /// time per step.
    pub fn plan_seconds(&self, job: &str) -> (f64, u64) {
        let h = self.dispatch.plan_duration.with_label_values(&[job]);
        let ahead = self.dispatch.plan_ahead_duration.with_label_values(&[job]);
        (
            h.get_sample_sum() + ahead.get_sample_sum(),
            h.get_sample_count(),
        )
    }

    /// Records an aborted in-flight step of `job` (the `reason` label is
    /// the typed reason's name: a bounded set).
    pub fn observe_abort(&self, job: &str, reason: AbortReason) {
        self.dispatch
            .aborts
            .with_label_values(&[job, reason.name()])
            .inc();
    }

    /// Records a complete checkpoint of `job` (its newest is `step`) at
    /// `unix_ms`.
    pub fn observe_checkpoint(&self, job: &str, step: Option<u64>, unix_ms: i64) {
        self.checkpoints.checkpoints.with_label_values(&[job]).inc();
        if let Some(step) = step {
            lock(&self.checkpoint_times).insert(job.to_string(), (step, Some(unix_ms)));
        }
    }

    /// Records what one rollout push to `job` did.
    pub fn observe_rollouts(&self, job: &str, c: &AdmitCounts) {
        self.rollouts
            .rollouts_admitted
            .with_label_values(&[job])
            .inc_by(c.accepted);
        self.rollouts
            .rollouts_rejected
            .with_label_values(&[job, "stale"])
            .inc_by(c.rejected_stale);
        self.rollouts
            .rollouts_rejected
            .with_label_values(&[job, "zero_variance"])
            .inc_by(c.zero_variance_dropped);
    }

    /// Sets how many rollout pushes wait for queue room right now.
    pub fn observe_push_waiters(&self, n: usize) {
        self.rollouts.push_waiters.set(n as f64);
    }

    /// Refreshes the gauges read from the state machine at `now_ms`.
    pub fn observe_core(&self, core: &Coordinator, now_ms: i64) {
        let mut oldest_heartbeat = 0i64;
        for state in WORKER_STATES {
            let n = core.workers().filter(|w| w.state == state).count();
            self.state
                .workers
                .with_label_values(&[state.name()])
                .set(n as i64);
        }
        for w in core.workers().filter(|w| w.connected()) {
            oldest_heartbeat = oldest_heartbeat.max(now_ms - w.last_seen_ms());
        }
        self.state
            .heartbeat_age
            .set(oldest_heartbeat.max(0) as f64 / 1000.0);
        self.state
            .heartbeat_backlog
            .set(core.heartbeat_backlog_ms() as f64 / 1000.0);
        for state in JOB_STATES {
            let n = core.jobs().filter(|j| j.rec.state == state).count();
            self.state
                .jobs
                .with_label_values(&[state.name()])
                .set(n as i64);
        }
        let mut times = lock(&self.checkpoint_times);
        let mut progress = lock(&self.progress_times);
        for j in core.jobs() {
            let id = j.rec.id.as_str();
            // The alert "no committed step for N minutes" reads this; a
            // paused, pending or ended job is not expected to advance.
            let seen = progress
                .entry(id.to_string())
                .or_insert((j.rec.step, now_ms));
            if seen.0 != j.rec.step {
                *seen = (j.rec.step, now_ms);
            }
            if j.rec.state == JobState::Running {
                self.checkpoints
                    .progress_age
                    .with_label_values(&[id])
                    .set((now_ms - seen.1).max(0) as f64 / 1000.0);
            } else {
                drop(self.checkpoints.progress_age.remove_label_values(&[id]));
            }
            self.state
                .generation
                .with_label_values(&[id])
                .set(j.rec.generation as i64);
            self.steps
                .job_step
                .with_label_values(&[id])
                .set(j.rec.step as i64);
            self.dispatch
                .sent_ahead
                .with_label_values(&[id])
                .set(j.ahead.sent as i64);
            self.checkpoints
                .checkpoints_pending
                .with_label_values(&[id])
                .set(j.acks.checkpoints.len() as i64);
            self.state
                .quarantined
                .with_label_values(&[id])
                .set(j.rec.quarantine.len() as i64);
            if let Some(s) = &j.data.stream {
                self.rollouts
                    .rollouts_queued
                    .with_label_values(&[id])
                    .set(s.buffered() as i64);
                self.rollouts
                    .rollouts_capacity
                    .with_label_values(&[id])
                    .set(s.capacity as i64);
            }
            let newest = j.rec.checkpoints.last();
            match newest {
                Some(c) => self
                    .checkpoints
                    .checkpoint_step
                    .with_label_values(&[id])
                    .set(c.step as i64),
                None => drop(self.checkpoints.checkpoint_step.remove_label_values(&[id])),
            }
            // Completed when this process saw it, else (after a restart)
            // when its directory was last written; looked up once.
            let completed = newest.and_then(|c| {
                let seen = times.entry(id.to_string()).or_insert((c.step, None));
                if seen.0 != c.step || seen.1.is_none() {
                    *seen = (c.step, dir_mtime_ms(&c.dir));
                }
                seen.1
            });
            match completed {
                Some(ms) if !j.rec.state.is_terminal() => self
                    .checkpoints
                    .checkpoint_age
                    .with_label_values(&[id])
                    .set((now_ms - ms).max(0) as f64 / 1000.0),
                _ => drop(self.checkpoints.checkpoint_age.remove_label_values(&[id])),
            }
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn dir_mtime_ms(dir: &std::path::Path) -> Option<i64> {
    let t = std::fs::metadata(dir).ok()?.modified().ok()?;
    let d = t.duration_since(std::time::UNIX_EPOCH).ok()?;
    Some(d.as_millis() as i64)
}

const WORKER_STATES: [WorkerState; 6] = [
    WorkerState::Registered,
    WorkerState::Idle,
    WorkerState::Configuring,
    WorkerState::Active,
    WorkerState::Draining,
    WorkerState::Lost,
];

const JOB_STATES: [JobState; 6] = [
    JobState::Pending,
    JobState::Running,
    JobState::Paused,
    JobState::Completed,
    JobState::Failed,
    JobState::Cancelled,
];
