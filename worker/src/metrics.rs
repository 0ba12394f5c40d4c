//! The worker's Prometheus metrics (`accrue-worker --metrics-listen ADDR`,
//! HTTP `GET /metrics`): where this process's time goes (compute,
//! collective, optimizer, idle — the same split the step results carry to
//! the coordinator, as counters so `rate()` works), steps and tokens run,
//! memory, and its place in the current generation.
//!
//! One process is one worker and one scrape target, so the metrics are
//! process-wide ([`global`]) and carry no worker label. The runner feeds
//! them after every completed step (`runner/step.rs`); memory is read at
//! scrape time. Names follow <https://prometheus.io/docs/practices/naming/>.

use std::net::SocketAddr;
use std::sync::OnceLock;

use prometheus::{Counter, Encoder, GaugeVec, IntCounter, IntGauge, Opts, Registry, TextEncoder};
use tokio::net::TcpListener;
use tracing::warn;

use crate::wire;

/// The worker's registry and its metrics.
pub struct WorkerMetrics {
    registry: Registry,
    compute: Counter,
    collective: Counter,
    optimizer: Counter,
    idle: Counter,
    steps: IntCounter,
    tokens: IntCounter,
    checkpoint_write: Counter,
    checkpoints: IntCounter,
    memory: GaugeVec,
    generation: IntGauge,
    rank: IntGauge,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerMetrics {
    pub fn new() -> WorkerMetrics {
        let registry = Registry::new();
        let seconds = |name: &str, help: &str| {
            let m = Counter::new(name, help).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let compute = seconds(
            "accrue_worker_compute_seconds_total",
            "Seconds in forward/backward of completed steps' microbatches",
        );
        let collective = seconds(
            "accrue_worker_collective_seconds_total",
            "Seconds in collectives of completed steps, as the step results report them",
        );
        let optimizer = seconds(
            "accrue_worker_optimizer_seconds_total",
            "Seconds in the optimizer step (gradient reduction, clipping, update) of completed steps",
        );
        let idle = seconds(
            "accrue_worker_idle_seconds_total",
            "Seconds between finishing one plan and starting the next completed step",
        );
        let checkpoint_write = seconds(
            "accrue_worker_checkpoint_write_seconds_total",
            "Seconds spent writing this rank's checkpoint files (in the background)",
        );
        let int_counter = |name: &str, help: &str| {
            let m = IntCounter::new(name, help).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let steps = int_counter(
            "accrue_worker_steps_total",
            "Training steps this worker completed (replays included)",
        );
        let tokens = int_counter(
            "accrue_worker_tokens_total",
            "Real (non-padding) tokens of the completed steps' microbatches",
        );
        let checkpoints = int_counter(
            "accrue_worker_checkpoints_total",
            "Checkpoint parts this worker wrote durably",
        );
        let memory = GaugeVec::new(
            Opts::new(
                "accrue_worker_memory_bytes",
                "Memory of this process: kind=\"rss\" resident set (VmRSS of /proc/self/status); GPU workers: kind=\"cuda_peak_allocated\" / \"cuda_peak_reserved\", the last step's peak on the GPU",
            ),
            &["kind"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(memory.clone()))
            .expect("unique metric");
        let int_gauge = |name: &str, help: &str| {
            let m = IntGauge::new(name, help).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let generation = int_gauge(
            "accrue_worker_generation",
            "Generation of the last step plan this worker ran (0 before the first)",
        );
        let rank = int_gauge(
            "accrue_worker_rank",
            "Rank of this worker in the generation of its last step plan",
        );
        WorkerMetrics {
            registry,
            compute,
            collective,
            optimizer,
            idle,
            steps,
            tokens,
            checkpoint_write,
            checkpoints,
            memory,
            generation,
            rank,
        }
    }

    /// Records a completed training step of `plan` with its `sums`.
    pub fn observe_step(&self, plan: &wire::StepPlan, sums: &wire::MetricSums) {
        for (c, s) in [
            (&self.compute, sums.compute_s),
            (&self.collective, sums.collective_s),
            (&self.optimizer, sums.optimizer_s),
            (&self.idle, sums.idle_s),
        ] {
            // A counter never goes down (inc_by panics on a negative).
            if s.is_finite() && s > 0.0 {
                c.inc_by(s);
            }
        }
        for (kind, bytes) in [
            ("cuda_peak_allocated", sums.gpu_memory_peak_allocated_bytes),
            ("cuda_peak_reserved", sums.gpu_memory_peak_reserved_bytes),
        ] {
            if bytes > 0 {
                self.memory.with_label_values(&[kind]).set(bytes as f64);
            }
        }
        self.steps.inc();
        self.tokens.inc_by(sums.tokens);
        self.generation.set(plan.generation as i64);
        self.rank.set(i64::from(plan.rank));
    }

    /// Records a checkpoint part written in `seconds`.
    pub fn observe_checkpoint_write(&self, seconds: f64) {
        self.checkpoints.inc();
        if seconds.is_finite() && seconds > 0.0 {
            self.checkpoint_write.inc_by(seconds);
        }
    }

    /// The Prometheus text exposition, memory read now.
    pub fn render(&self) -> String {
        if let Some(rss) = rss_bytes() {
            self.memory.with_label_values(&["rss"]).set(rss as f64);
        }
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

/// The process-wide metrics (one process is one worker).
pub fn global() -> &'static WorkerMetrics {
    static METRICS: OnceLock<WorkerMetrics> = OnceLock::new();
    METRICS.get_or_init(WorkerMetrics::new)
}

/// Resident set size from `/proc/self/status` (`VmRSS`, in kB: no page
/// size to guess); `None` off Linux.
fn rss_bytes() -> Option<u64> {
    parse_vm_rss(&std::fs::read_to_string("/proc/self/status").ok()?)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Binds the metrics endpoint (port 0: any free port).
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves `GET /metrics` of [`global`] on `listener` until the process ends.
pub async fn serve(listener: TcpListener) {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(|| async {
            (
                [("content-type", "text/plain; version=0.0.4")],
                global().render(),
            )
        }),
    );
    if let Err(e) = axum::serve(listener, app).await {
        warn!(%e, "metrics endpoint stopped");
    }
}

/// Binds `addr`, serves metrics on it in the background and returns the
/// bound address.
pub async fn spawn(addr: &str) -> std::io::Result<SocketAddr> {
    let listener = bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener));
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_moves_the_time_counters_steps_and_tokens() {
        let m = WorkerMetrics::new();
        let plan = wire::StepPlan {
            generation: 3,
            rank: 1,
            ..Default::default()
        };
        let sums = wire::MetricSums {
            compute_s: 1.5,
            collective_s: 0.25,
            optimizer_s: 0.5,
            idle_s: -1.0,
            tokens: 40,
            ..Default::default()
        };
        m.observe_step(&plan, &sums);
        m.observe_step(&plan, &sums);
        m.observe_checkpoint_write(0.75);
        let text = m.render();
        for line in [
            "accrue_worker_compute_seconds_total 3",
            "accrue_worker_collective_seconds_total 0.5",
            "accrue_worker_optimizer_seconds_total 1",
            // A negative reading is not added (counters never go down).
            "accrue_worker_idle_seconds_total 0",
            "accrue_worker_steps_total 2",
            "accrue_worker_tokens_total 80",
            "accrue_worker_generation 3",
            "accrue_worker_rank 1",
            "accrue_worker_checkpoints_total 1",
            "accrue_worker_checkpoint_write_seconds_total 0.75",
            "# TYPE accrue_worker_compute_seconds_total counter",
            "# TYPE accrue_worker_memory_bytes gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("accrue_worker_memory_bytes{kind=\"rss\"} "))
            .expect("rss on linux");
        assert!(rss.parse::<f64>().unwrap() > 1e6, "rss {rss}");
    }

    #[test]
    fn names_follow_the_conventions() {
        for f in WorkerMetrics::new().registry.gather() {
            let name = f.name();
            assert!(name.starts_with("accrue_worker_"), "{name}");
            assert!(!f.help().is_empty(), "{name}");
            let counter = f.get_field_type() == prometheus::proto::MetricType::COUNTER;
            assert_eq!(counter, name.ends_with("_total"), "{name}");
        }
    }

    #[test]
    fn rss_is_vm_rss_in_kilobytes() {
        let status = "Name:\taccrue-worker\nVmPeak:\t  9000 kB\nVmRSS:\t   250 kB\n";
        assert_eq!(parse_vm_rss(status), Some(250 * 1024));
        assert_eq!(parse_vm_rss("garbage"), None);
    }

    #[tokio::test]
    async fn the_endpoint_serves_the_text_format_over_http() {
        let addr = spawn("127.0.0.1:0").await.unwrap();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("text/plain; version=0.0.4"), "{out}");
        assert!(
            out.contains("accrue_worker_memory_bytes{kind=\"rss\"}"),
            "{out}"
        );
    }
}
