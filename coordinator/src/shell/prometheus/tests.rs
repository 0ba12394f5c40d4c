//! Unit tests of the exporter: naming conventions over every family it
//! registers, counters moving with the observations, abort reasons.

use std::time::Duration;

use prometheus::proto::MetricType;

use super::*;
use crate::core::{AbortReason, Coordinator, StepMetrics};
use crate::rl::stream::AdmitCounts;

/// Touches every family so the registry gathers it (a vec without a label
/// set is not exposed): the observe functions where they need no state
/// machine, the fields for the per-job scrape-time gauges.
fn populated() -> Exporter {
    let e = Exporter::new();
    let m = StepMetrics {
        step: 3,
        tokens: 100,
        docs: 4,
        step_time_s: 2.0,
        compute_s: 1.5,
        collective_s: 0.25,
        optimizer_s: 0.125,
        idle_s: 0.5,
        world_size: 2,
        generation: 1,
        sources: [("chat".to_string(), crate::core::SourceMetrics::default())].into(),
        ..Default::default()
    };
    e.observe_step("j", &m);
    e.observe_eval("j", &crate::core::EvalMetrics::default());
    e.observe_plan("j", Duration::from_millis(3), Duration::from_micros(200));
    e.observe_plan_ahead("j", Duration::from_millis(5));
    e.observe_abort("j", AbortReason::WorkerLost);
    e.observe_checkpoint("j", Some(3), 1_000);
    e.observe_rollouts(
        "j",
        &AdmitCounts {
            accepted: 8,
            rejected_stale: 2,
            zero_variance_dropped: 4,
            ..Default::default()
        },
    );
    e.observe_push_waiters(1);
    e.observe_core(&Coordinator::default(), 5_000);
    for g in [
        &e.checkpoints.checkpoints_pending,
        &e.rollouts.rollouts_queued,
        &e.rollouts.rollouts_capacity,
        &e.checkpoints.checkpoint_step,
        &e.state.quarantined,
        &e.dispatch.sent_ahead,
    ] {
        g.with_label_values(&["j"]).set(1);
    }
    e.checkpoints
        .checkpoint_age
        .with_label_values(&["j"])
        .set(4.0);
    e.checkpoints
        .progress_age
        .with_label_values(&["j"])
        .set(4.0);
    e.steps
        .gpu_memory
        .with_label_values(&["j", "allocated"])
        .set(1.0);
    e
}

#[test]
fn every_family_follows_the_prometheus_naming_conventions() {
    let e = populated();
    let families = e.registry.gather();
    assert_eq!(
        families.len(),
        e.families,
        "a registered family is not exposed by this test: touch it in populated()"
    );
    let name_ok = |n: &str| {
        n.strip_prefix("accrue_").is_some_and(|rest| {
            !rest.is_empty()
                && rest
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
    };
    for f in &families {
        let name = f.name();
        assert!(name_ok(name), "{name}: not ^accrue_[a-z0-9_]+$");
        assert!(!f.help().trim().is_empty(), "{name}: empty help");
        let counter = f.get_field_type() == MetricType::COUNTER;
        assert_eq!(
            counter,
            name.ends_with("_total"),
            "{name}: counters and only counters end in _total"
        );
        if name.contains("duration") || name.contains("time") || name.contains("age") {
            assert!(
                name.ends_with("_seconds") || name.ends_with("_seconds_total"),
                "{name}: a duration must be in seconds"
            );
        }
        if f.get_field_type() == MetricType::HISTOGRAM {
            assert!(
                name.ends_with("_seconds"),
                "{name}: histograms here are durations"
            );
        }
        for m in f.get_metric() {
            for l in m.get_label() {
                // `source`: a mixture's sources, declared in the spec (a dozen,
                // not one per document).
                assert!(
                    ["job_id", "state", "reason", "phase", "source", "kind"].contains(&l.name()),
                    "{name}: label {} is not one of the low-cardinality ones",
                    l.name()
                );
            }
        }
    }
}

#[test]
fn a_committed_step_moves_the_counters_and_the_histogram() {
    let e = populated();
    e.observe_step(
        "j",
        &StepMetrics {
            tokens: 50,
            docs: 2,
            step_time_s: 0.2,
            compute_s: 0.5,
            ..Default::default()
        },
    );
    let text = e.render();
    for line in [
        "accrue_tokens_total{job_id=\"j\"} 150",
        "accrue_documents_total{job_id=\"j\"} 6",
        "accrue_steps_committed_total{job_id=\"j\"} 2",
        "accrue_step_duration_seconds_count{job_id=\"j\"} 2",
        "accrue_step_duration_seconds_sum{job_id=\"j\"} 2.2",
        "accrue_rank_seconds_total{job_id=\"j\",phase=\"compute\"} 2",
        "accrue_rank_seconds_total{job_id=\"j\",phase=\"idle\"} 0.5",
        "accrue_step_aborts_total{job_id=\"j\",reason=\"worker_lost\"} 1",
        "accrue_rollouts_admitted_total{job_id=\"j\"} 8",
        "accrue_rollouts_dropped_total{job_id=\"j\",reason=\"stale\"} 2",
        "accrue_rollouts_dropped_total{job_id=\"j\",reason=\"zero_variance\"} 4",
        "accrue_plan_duration_seconds_count{job_id=\"j\"} 1",
        "accrue_plan_ahead_duration_seconds_count{job_id=\"j\"} 1",
        "accrue_checkpoints_total{job_id=\"j\"} 1",
        "accrue_rollout_pushes_waiting 1",
        "accrue_worker_heartbeat_age_max_seconds 0",
        "accrue_heartbeat_backlog_seconds 0",
        "accrue_jobs{state=\"running\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
}

#[test]
fn checkpoint_age_is_absent_without_a_checkpoint() {
    let e = Exporter::new();
    e.observe_core(&Coordinator::default(), 1_000);
    assert!(!e.render().contains("accrue_checkpoint_age_seconds"));
}
