//! Prometheus metrics of the coordinator, served as text on `GET /metrics`.
//!
//! Step gauges are updated when a step commits (the `CommitStep` effect);
//! worker counts and job generations are read from the state machine at
//! scrape time, so they are never stale. [`crate::http`] serves them.

use prometheus::{Encoder, GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::core::{Coordinator, StepMetrics, WorkerState};

/// The coordinator's Prometheus registry and its metrics.
pub struct Exporter {
    registry: Registry,
    steps: IntCounterVec,
    step_time: GaugeVec,
    tokens_per_s: GaugeVec,
    mfu: GaugeVec,
    loss: GaugeVec,
    workers: IntGaugeVec,
    generation: IntGaugeVec,
}

impl Default for Exporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Exporter {
    pub fn new() -> Exporter {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let m = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let steps = counter(
            "accrue_steps_committed_total",
            "Steps committed (cursor moved, metrics written)",
            &["job"],
        );
        let gauge = |name: &str, help: &str| {
            let m = GaugeVec::new(Opts::new(name, help), &["job"]).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let step_time = gauge(
            "accrue_step_time_seconds",
            "Wall time of the last committed step, dispatch to commit",
        );
        let tokens_per_s = gauge(
            "accrue_tokens_per_second",
            "Real (non-padding) tokens per second in the last committed step",
        );
        let mfu = gauge(
            "accrue_mfu",
            "Model FLOPs utilisation of the last committed step (0 when a worker's peak is unknown)",
        );
        let loss = gauge(
            "accrue_loss",
            "Token-weighted loss of the last committed step",
        );
        let int_gauge = |name: &str, help: &str, label: &str| {
            let m = IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let workers = int_gauge("accrue_workers", "Registered workers by state", "state");
        let generation = int_gauge(
            "accrue_job_generation",
            "Last generation (membership) formed for the job",
            "job",
        );
        Exporter {
            registry,
            steps,
            step_time,
            tokens_per_s,
            mfu,
            loss,
            workers,
            generation,
        }
    }

    /// Records a committed step of `job`.
    pub fn observe_step(&self, job: &str, m: &StepMetrics) {
        self.steps.with_label_values(&[job]).inc();
        self.step_time.with_label_values(&[job]).set(m.step_time_s);
        self.tokens_per_s
            .with_label_values(&[job])
            .set(m.tokens_per_s);
        self.mfu.with_label_values(&[job]).set(m.mfu);
        self.loss.with_label_values(&[job]).set(m.loss);
        self.generation
            .with_label_values(&[job])
            .set(m.generation as i64);
    }

    /// Refreshes the gauges read from the state machine.
    pub fn observe_core(&self, core: &Coordinator) {
        for state in WORKER_STATES {
            let n = core.workers().filter(|w| w.state == state).count();
            self.workers
                .with_label_values(&[worker_state_name(state)])
                .set(n as i64);
        }
        for j in core.jobs() {
            self.generation
                .with_label_values(&[j.rec.id.as_str()])
                .set(j.rec.generation as i64);
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

const WORKER_STATES: [WorkerState; 6] = [
    WorkerState::Registered,
    WorkerState::Idle,
    WorkerState::Configuring,
    WorkerState::Active,
    WorkerState::Draining,
    WorkerState::Lost,
];

fn worker_state_name(s: WorkerState) -> &'static str {
    match s {
        WorkerState::Registered => "registered",
        WorkerState::Idle => "idle",
        WorkerState::Configuring => "configuring",
        WorkerState::Active => "active",
        WorkerState::Draining => "draining",
        WorkerState::Lost => "lost",
    }
}
