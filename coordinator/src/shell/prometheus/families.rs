//! The coordinator's metric families, registered in groups by what they
//! describe (the conventions are [`super`]'s).

use prometheus::core::Collector;
use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

/// Buckets of whole steps (seconds): 50 ms to ~17 min.
const STEP_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0,
];
/// Buckets of coordinator-side latencies (seconds): 100 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

const JOB: &[&str] = &["job_id"];

/// Registers metrics into one registry, counting them.
pub(super) struct Builder {
    pub(super) registry: Registry,
    pub(super) families: usize,
}

impl Builder {
    fn add<C: Collector + Clone + 'static>(&mut self, m: C) -> C {
        self.registry
            .register(Box::new(m.clone()))
            .expect("unique metric");
        self.families += 1;
        m
    }

    fn counter(&mut self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.add(GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn int_gauge(&mut self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    fn histogram(&mut self, name: &str, help: &str, buckets: &[f64]) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(HistogramVec::new(opts, &["job_id"]).expect("valid metric"))
    }
}

/// Committed steps: counters to rate(), the last step's gauges.
pub(super) struct Steps {
    pub(super) steps: IntCounterVec,
    pub(super) tokens: IntCounterVec,
    pub(super) documents: IntCounterVec,
    pub(super) rank_seconds: prometheus::CounterVec,
    pub(super) step_duration: HistogramVec,
    pub(super) step_time: GaugeVec,
    pub(super) tokens_per_s: GaugeVec,
    pub(super) mfu: GaugeVec,
    pub(super) gpu_memory: GaugeVec,
    pub(super) padding: GaugeVec,
    pub(super) loss: GaugeVec,
    pub(super) grad_norm: GaugeVec,
    pub(super) lr: GaugeVec,
    pub(super) job_step: IntGaugeVec,
    pub(super) world_size: IntGaugeVec,
}

impl Steps {
    pub(super) fn register(b: &mut Builder) -> Self {
        let job = JOB;
        let steps = b.counter(
            "accrue_steps_committed_total",
            "Steps committed (cursor moved, metrics written)",
            job,
        );
        let tokens = b.counter(
            "accrue_tokens_total",
            "Real (non-padding) tokens trained in committed steps; rate() gives tokens/s",
            job,
        );
        let documents = b.counter(
            "accrue_documents_total",
            "Documents (examples, pairs or rollouts) trained in committed steps",
            job,
        );
        let rank_seconds = b.add(
            prometheus::CounterVec::new(
                Opts::new(
                    "accrue_rank_seconds_total",
                    "Rank time of committed steps by phase (compute, collective, optimizer, idle), summed over ranks",
                ),
                &["job_id", "phase"],
            )
            .expect("valid metric"),
        );
        let step_duration = b.histogram(
            "accrue_step_duration_seconds",
            "Wall time of committed steps, plan dispatched to step committed",
            STEP_BUCKETS,
        );
        let step_time = b.gauge(
            "accrue_step_time_seconds",
            "Wall time of the last committed step, dispatch to commit",
            job,
        );
        let tokens_per_s = b.gauge(
            "accrue_tokens_per_second",
            "Real (non-padding) tokens per second in the last committed step",
            job,
        );
        let mfu = b.gauge(
            "accrue_mfu_ratio",
            "Model FLOPs utilisation of the last committed step, 0 to 1 (0 when a worker's peak is unknown)",
            job,
        );
        let gpu_memory = b.gauge(
            "accrue_gpu_memory_peak_bytes",
            "Largest per-rank peak GPU memory of the last committed step, by kind = allocated (tensors) or reserved (device memory in use); absent on CPU",
            &["job_id", "kind"],
        );
        let padding = b.gauge(
            "accrue_padding_ratio",
            "Fraction of microbatch token budget left as padding in the last committed step",
            job,
        );
        let loss = b.gauge(
            "accrue_loss",
            "Token-weighted loss of the last committed step",
            job,
        );
        let grad_norm = b.gauge(
            "accrue_grad_norm",
            "Global gradient norm (before clipping) of the last committed step",
            job,
        );
        let lr = b.gauge(
            "accrue_learning_rate",
            "Learning rate of the last committed step",
            job,
        );
        let job_step = b.int_gauge("accrue_job_step", "Last committed step of the job", job);
        let world_size = b.int_gauge(
            "accrue_job_world_size",
            "Ranks of the generation that committed the job's last step",
            job,
        );
        Self {
            steps,
            tokens,
            documents,
            rank_seconds,
            step_duration,
            step_time,
            tokens_per_s,
            mfu,
            gpu_memory,
            padding,
            loss,
            grad_norm,
            lr,
            job_step,
            world_size,
        }
    }
}

/// Per source of a mixture, and evaluations.
pub(super) struct Sources {
    pub(super) source_loss: GaugeVec,
    pub(super) source_tokens: IntCounterVec,
    pub(super) source_documents: IntCounterVec,
    pub(super) eval_loss: GaugeVec,
}

impl Sources {
    pub(super) fn register(b: &mut Builder) -> Self {
        let source_loss = b.gauge(
            "accrue_source_loss",
            "Loss of each source's documents in the last committed step of a mixture",
            &["job_id", "source"],
        );
        let source_tokens = b.counter(
            "accrue_source_tokens_total",
            "Tokens trained per source of a mixture",
            &["job_id", "source"],
        );
        let source_documents = b.counter(
            "accrue_source_documents_total",
            "Documents trained per source of a mixture",
            &["job_id", "source"],
        );
        let eval_loss = b.gauge(
            "accrue_eval_loss",
            "Loss of the last evaluation, per eval source and over all (source=\"all\")",
            &["job_id", "source"],
        );
        Self {
            source_loss,
            source_tokens,
            source_documents,
            eval_loss,
        }
    }
}

/// Plans dispatched, their latencies, steps sent as planned ahead, aborts.
pub(super) struct Dispatch {
    pub(super) plans: IntCounterVec,
    pub(super) plan_duration: HistogramVec,
    pub(super) plan_ahead_duration: HistogramVec,
    pub(super) dispatch_duration: HistogramVec,
    pub(super) aborts: IntCounterVec,
    pub(super) sent_ahead: IntGaugeVec,
}

impl Dispatch {
    pub(super) fn register(b: &mut Builder) -> Self {
        let job = JOB;
        let plans = b.counter(
            "accrue_plans_dispatched_total",
            "Step plans dispatched to a generation (training, replay and reference chunks; a re-planned step counts again)",
            job,
        );
        let plan_duration = b.histogram(
            "accrue_plan_duration_seconds",
            "Wall time of the state-machine call that produced a step plan (planning and packing; \
             after a commit it includes committing the previous step)",
            LATENCY_BUCKETS,
        );
        let plan_ahead_duration = b.histogram(
            "accrue_plan_ahead_duration_seconds",
            "Wall time of the state-machine call that planned a job's next step while one ran \
             (dispatch then sends it without planning, if nothing it was planned from changed)",
            LATENCY_BUCKETS,
        );
        let dispatch_duration = b.histogram(
            "accrue_dispatch_duration_seconds",
            "Wall time from a step plan existing to the last rank's plan queued on its session stream \
             (persisting the previous step, encoding, queueing)",
            LATENCY_BUCKETS,
        );
        let aborts = b.counter(
            "accrue_step_aborts_total",
            "In-flight steps aborted (re-planned with the same documents, or ended with the job), by reason",
            &["job_id", "reason"],
        );
        let sent_ahead = b.int_gauge(
            "accrue_steps_sent_ahead",
            "Steps of the job this coordinator sent as planned while the step before ran (the \
             others were planned at dispatch: the first, and any after a change)",
            job,
        );
        Self {
            plans,
            plan_duration,
            plan_ahead_duration,
            dispatch_duration,
            aborts,
            sent_ahead,
        }
    }
}

/// Checkpoints: completed, pending, their age, and the job's progress.
pub(super) struct Checkpoints {
    pub(super) checkpoints: IntCounterVec,
    pub(super) checkpoint_step: IntGaugeVec,
    pub(super) checkpoint_age: GaugeVec,
    pub(super) progress_age: GaugeVec,
    pub(super) checkpoints_pending: IntGaugeVec,
}

impl Checkpoints {
    pub(super) fn register(b: &mut Builder) -> Self {
        let job = JOB;
        let checkpoints = b.counter(
            "accrue_checkpoints_total",
            "Checkpoints completed (every rank reported its part durable) by this coordinator process",
            job,
        );
        let checkpoint_step = b.int_gauge(
            "accrue_checkpoint_step",
            "Step of the job's newest complete checkpoint (absent when it has none)",
            job,
        );
        let checkpoint_age = b.gauge(
            "accrue_checkpoint_age_seconds",
            "Seconds since the newest complete checkpoint of a job that is not finished was \
             completed (absent when it has none)",
            job,
        );
        let progress_age = b.gauge(
            "accrue_job_progress_age_seconds",
            "Seconds since a running job's step last advanced, as seen at scrapes (absent unless \
             the job is running)",
            job,
        );
        let checkpoints_pending = b.int_gauge(
            "accrue_checkpoints_pending",
            "Checkpoints requested and still being written by the ranks",
            job,
        );
        Self {
            checkpoints,
            checkpoint_step,
            checkpoint_age,
            progress_age,
            checkpoints_pending,
        }
    }
}

/// Streamed rollouts: admitted, dropped, queued, waiting pushers.
pub(super) struct Rollouts {
    pub(super) rollouts_admitted: IntCounterVec,
    pub(super) rollouts_rejected: IntCounterVec,
    pub(super) rollouts_queued: IntGaugeVec,
    pub(super) rollouts_capacity: IntGaugeVec,
    pub(super) push_waiters: Gauge,
}

impl Rollouts {
    pub(super) fn register(b: &mut Builder) -> Self {
        let job = JOB;
        let rollouts_admitted = b.counter(
            "accrue_rollouts_admitted_total",
            "Rollouts admitted into a streamed job's queue",
            job,
        );
        let rollouts_rejected = b.counter(
            "accrue_rollouts_dropped_total",
            "Pushed rollouts not trained on, by reason (stale policy, zero reward variance group)",
            &["job_id", "reason"],
        );
        let rollouts_queued = b.int_gauge(
            "accrue_rollout_queue_rollouts",
            "Rollouts buffered in a streamed job's queue (complete and filling groups)",
            job,
        );
        let rollouts_capacity = b.int_gauge(
            "accrue_rollout_queue_capacity_rollouts",
            "Rollouts a streamed job buffers before pushes wait",
            job,
        );
        let push_waiters = b.add(
            Gauge::new(
                "accrue_rollout_pushes_waiting",
                "Rollout pushes blocked waiting for room in a full queue (all jobs)",
            )
            .expect("valid metric"),
        );
        Self {
            rollouts_admitted,
            rollouts_rejected,
            rollouts_queued,
            rollouts_capacity,
            push_waiters,
        }
    }
}

/// Membership and jobs, read from the state machine at scrape time.
pub(super) struct State {
    pub(super) workers: IntGaugeVec,
    pub(super) heartbeat_age: Gauge,
    pub(super) heartbeat_backlog: Gauge,
    pub(super) jobs: IntGaugeVec,
    pub(super) generation: IntGaugeVec,
    pub(super) quarantined: IntGaugeVec,
}

impl State {
    pub(super) fn register(b: &mut Builder) -> Self {
        let job = JOB;
        let workers = b.int_gauge("accrue_workers", "Registered workers by state", &["state"]);
        let heartbeat_age = b.add(
            Gauge::new(
                "accrue_worker_heartbeat_age_max_seconds",
                "Seconds since the least recently heard-from connected worker was heard from (0 when none is connected)",
            )
            .expect("valid metric"),
        );
        let heartbeat_backlog = b.add(
            Gauge::new(
                "accrue_heartbeat_backlog_seconds",
                "How late the coordinator reads most workers' heartbeats (time it is behind, credited to workers' silence)",
            )
            .expect("valid metric"),
        );
        let jobs = b.int_gauge("accrue_jobs", "Jobs by state", &["state"]);
        let generation = b.int_gauge(
            "accrue_job_generation",
            "Last generation (membership) formed for the job",
            job,
        );
        let quarantined = b.int_gauge(
            "accrue_quarantined_documents",
            "Documents the job trains without: non-finite steps bisected down to them (accrue quarantine JOB)",
            job,
        );
        Self {
            workers,
            heartbeat_age,
            heartbeat_backlog,
            jobs,
            generation,
            quarantined,
        }
    }
}
