//! The Prometheus endpoint, in process: a real server with metrics on
//! 127.0.0.1:0, jobs trained by fake workers over the real session
//! protocol, then `GET /metrics` must show what happened: committed steps,
//! tokens, latency histograms, a checkpoint and its age while the job
//! runs, an aborted step when a worker is lost.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use accrue_coordinator::wire;
use common::{fake_worker, get, submit, FakeWorker};
use tokio::sync::oneshot;

/// The value of the sample line `series` (name and labels, exactly).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// 2.0 loss per token and 0.5 s of compute; the counts are the plan's
/// (`common::counted`): 28 tokens and 4 documents a step on this fixture.
fn sums(_: &wire::StepPlan) -> wire::MetricSums {
    wire::MetricSums {
        documents: 4,
        compute_s: 0.5,
        ..common::loss_2(&wire::StepPlan::default())
    }
}

const SPEC: &str =
    "[job]\nname = \"m\"\nsteps = 2\noutput_dir = \"out\"\n[model]\ninit = \"random\"\n\
                    config = \"tiny.json\"\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n\
                    [batch]\ndocs_per_step = 4\n[checkpoint]\nevery_steps = 1\n";

/// Scrapes until `series` has a sample (the job got there), or panics.
async fn scrape_until(metrics: SocketAddr, series: &str) -> String {
    for _ in 0..200 {
        let text = get(metrics, "/metrics").await;
        if sample(&text, series).is_some() {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{series} never appeared:\n{}",
        get(metrics, "/metrics").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_shows_committed_steps_and_workers() {
    let (dir, s, metrics) = common::start_with_http().await;
    let url = s.url.clone();
    let job = submit(&url, dir.path(), SPEC).await;
    let (open, gate) = oneshot::channel();
    let worker = tokio::spawn(fake_worker(
        url,
        FakeWorker {
            hold: Some((2, gate)),
            ..FakeWorker::new(sums)
        },
    ));

    // Step 1 committed and checkpointed, step 2 dispatched and held.
    let age = format!("accrue_checkpoint_age_seconds{{job_id=\"{job}\"}}");
    let text = scrape_until(metrics, &age).await;
    let of = |name: &str| sample(&text, &format!("{name}{{job_id=\"{job}\"}}"));
    let seconds = of("accrue_checkpoint_age_seconds").unwrap();
    assert!((0.0..60.0).contains(&seconds), "checkpoint age {seconds}");
    assert_eq!(of("accrue_checkpoint_step"), Some(1.0), "{text}");
    assert_eq!(of("accrue_checkpoints_total"), Some(1.0), "{text}");
    assert_eq!(of("accrue_tokens_total"), Some(28.0), "{text}");
    assert_eq!(of("accrue_documents_total"), Some(4.0), "{text}");
    assert_eq!(of("accrue_job_step"), Some(1.0), "{text}");
    assert_eq!(
        of("accrue_step_duration_seconds_count"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(of("accrue_plans_dispatched_total"), Some(2.0), "{text}");
    assert_eq!(
        of("accrue_plan_duration_seconds_count"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        of("accrue_dispatch_duration_seconds_count"),
        Some(2.0),
        "{text}"
    );
    // Each dispatch is followed by planning the next step ahead.
    assert_eq!(
        of("accrue_plan_ahead_duration_seconds_count"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(sample(&text, "accrue_jobs{state=\"running\"}"), Some(1.0));
    // Step 2 is held: the job's progress age grows across scrapes (what
    // the "no committed step" alert reads).
    let progress = format!("accrue_job_progress_age_seconds{{job_id=\"{job}\"}}");
    let before = sample(&text, &progress).expect("progress age of a running job");
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let later = sample(&scrape_until(metrics, &progress).await, &progress).unwrap();
    assert!(
        later >= before + 1.0,
        "progress age {before} then {later} while step 2 is held"
    );
    assert_eq!(sample(&text, "accrue_workers{state=\"active\"}"), Some(1.0));
    let compute = format!("accrue_rank_seconds_total{{job_id=\"{job}\",phase=\"compute\"}}");
    assert_eq!(sample(&text, &compute), Some(0.5), "{text}");
    for (family, kind) in [
        ("accrue_steps_committed_total", "counter"),
        ("accrue_tokens_total", "counter"),
        ("accrue_rank_seconds_total", "counter"),
        ("accrue_checkpoints_total", "counter"),
        ("accrue_plans_dispatched_total", "counter"),
        ("accrue_step_duration_seconds", "histogram"),
        ("accrue_plan_duration_seconds", "histogram"),
        ("accrue_plan_ahead_duration_seconds", "histogram"),
        ("accrue_steps_sent_ahead", "gauge"),
        ("accrue_dispatch_duration_seconds", "histogram"),
        ("accrue_checkpoint_age_seconds", "gauge"),
        ("accrue_checkpoints_pending", "gauge"),
        ("accrue_mfu_ratio", "gauge"),
        ("accrue_worker_heartbeat_age_max_seconds", "gauge"),
        ("accrue_heartbeat_backlog_seconds", "gauge"),
        ("accrue_jobs", "gauge"),
    ] {
        let line = format!("# TYPE {family} {kind}");
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }

    open.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), worker)
        .await
        .expect("the fake worker is released when the job completes")
        .unwrap();
    let text = get(metrics, "/metrics").await;
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    for line in [
        format!("accrue_steps_committed_total{{job_id=\"{job}\"}} 2"),
        format!("accrue_tokens_total{{job_id=\"{job}\"}} 56"),
        format!("accrue_step_duration_seconds_count{{job_id=\"{job}\"}} 2"),
        format!("accrue_loss{{job_id=\"{job}\"}} 2"),
        format!("accrue_job_generation{{job_id=\"{job}\"}} 1"),
        "accrue_workers{state=\"active\"} 0".to_string(),
        "accrue_jobs{state=\"completed\"} 1".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from:\n{text}"
        );
    }
    // A finished job has no checkpoint age (nothing to alert on).
    assert!(sample(&text, &age).is_none(), "{text}");
    // (The final checkpoint may still be pending: the worker was released.)
    assert!(
        sample(
            &text,
            &format!("accrue_checkpoints_total{{job_id=\"{job}\"}}")
        )
        .unwrap()
            >= 1.0,
        "{text}"
    );
    // The released worker is idle or, once its session closed, lost: one in all.
    let workers: i64 = text
        .lines()
        .filter(|l| l.starts_with("accrue_workers{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(workers, 1, "{text}");
    for name in ["accrue_step_time_seconds", "accrue_tokens_per_second"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{name}{{job_id=\"{job}\"}} "))),
            "{name} missing from:\n{text}"
        );
    }
    assert!(get(metrics, "/nope").await.starts_with("HTTP/1.1 404"));
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_counts_one_aborted_step_by_reason() {
    let (dir, s, metrics) = common::start_with_http().await;
    let url = s.url.clone();
    let spec = SPEC.replace("steps = 2", "steps = 1");
    let job = submit(&url, dir.path(), &spec).await;
    // Lost with step 1 in flight; a second worker then trains it.
    let dying = FakeWorker {
        die_at: Some(1),
        ..FakeWorker::new(sums)
    };
    tokio::time::timeout(Duration::from_secs(20), fake_worker(url.clone(), dying))
        .await
        .expect("the first worker gets step 1");
    tokio::time::timeout(
        Duration::from_secs(20),
        fake_worker(url, FakeWorker::new(sums)),
    )
    .await
    .expect("the second worker is released when the job completes");

    let text = get(metrics, "/metrics").await;
    let lost = format!("accrue_step_aborts_total{{job_id=\"{job}\",reason=\"worker_lost\"}}");
    assert_eq!(sample(&text, &lost), Some(1.0), "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("accrue_step_aborts_total{"))
            .count(),
        1,
        "one abort, one reason:\n{text}"
    );
    assert!(text.contains("# TYPE accrue_step_aborts_total counter"));
    let of = |name: &str| sample(&text, &format!("{name}{{job_id=\"{job}\"}}"));
    assert_eq!(of("accrue_job_generation"), Some(2.0), "{text}");
    assert_eq!(of("accrue_plans_dispatched_total"), Some(2.0), "{text}");
    assert_eq!(of("accrue_steps_committed_total"), Some(1.0), "{text}");
    assert_eq!(of("accrue_tokens_total"), Some(28.0), "{text}");
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}
