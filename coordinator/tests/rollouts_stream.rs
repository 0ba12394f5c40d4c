//! Streamed rollouts in process: the real server on 127.0.0.1:0, a
//! generator pushing through `Rollouts.PushRollouts`, and a fake worker
//! speaking the real session protocol. A pusher facing a full queue waits
//! (it neither drops nor errors) until committed steps free room; bad input
//! is an InvalidArgument naming the message, rollout and field; cancelling
//! the job ends a waiting push.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use accrue_coordinator::shell::service::Shared;
use accrue_coordinator::wire;
use common::{fake_worker, start, FakeWorker};
use tonic::Code;

async fn submit(url: &str, dir: &Path, steps: u64) -> String {
    std::fs::write(dir.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
    let spec = format!(
        "[job]\nname = \"stream\"\nsteps = {steps}\noutput_dir = \"out\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\nsource = \"stream\"\nformat = \"rollouts\"\nmax_tokens = 256\n\
         [batch]\ndocs_per_step = 2\n[objective]\nkind = \"pg\"\n\
         [rl]\ngroup_size = 2\nqueue_capacity = 4\n"
    );
    common::submit(url, dir, &spec).await
}

/// A message holding one complete group `g{i}` (rewards 0 and 1).
fn group(job: &str, i: usize) -> wire::PushRolloutsRequest {
    let r = |reward| wire::StreamedRollout {
        prompt: format!("{i}+{i}="),
        completion: format!("{}", 2 * i),
        reward,
        group: format!("g{i}"),
        ..Default::default()
    };
    wire::PushRolloutsRequest {
        job_id: job.to_string(),
        rollouts: vec![r(0.0), r(1.0)],
    }
}

async fn push(
    url: String,
    msgs: Vec<wire::PushRolloutsRequest>,
) -> Result<wire::PushRolloutsResponse, tonic::Status> {
    let mut c = wire::rollouts_client::RolloutsClient::connect(url)
        .await
        .unwrap();
    c.push_rollouts(tokio_stream::iter(msgs))
        .await
        .map(|r| r.into_inner())
}

/// Waits (bounded, as a hang guard only) until a pusher waits for room.
async fn until_waiting(shared: &Shared) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while shared.rollout_waiters() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the pusher waits for room");
}

/// 1.0 loss per token over 8 tokens, one microbatch.
fn sums(_: &wire::StepPlan) -> wire::MetricSums {
    wire::MetricSums {
        loss_sum: 2.0,
        loss_tokens: 2,
        tokens: 8,
        microbatches: 1,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pusher_waits_on_a_full_queue_until_steps_commit() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir.path().join("state")).await;
    let job = submit(&s.url, dir.path(), 4).await;

    // Capacity 4 = two groups; the third message must wait for a commit.
    let msgs: Vec<_> = (0..4)
        .map(|i| group(if i == 0 { &job } else { "" }, i))
        .collect();
    let pusher = tokio::spawn(push(s.url.clone(), msgs));
    until_waiting(&s.shared.upgrade().unwrap()).await;
    assert!(
        !pusher.is_finished(),
        "no worker, no commit: the push waits"
    );

    let worker = tokio::spawn(fake_worker(s.url.clone(), FakeWorker::new(sums)));
    let reply = tokio::time::timeout(Duration::from_secs(30), pusher)
        .await
        .expect("commits free room and the push completes")
        .unwrap()
        .unwrap();
    assert_eq!((reply.messages, reply.accepted), (4, 8));
    assert_eq!((reply.rejected_stale, reply.invalid), (0, 0));

    let docs = tokio::time::timeout(Duration::from_secs(30), worker)
        .await
        .expect("the worker is released when the job completes")
        .unwrap();
    let unique: BTreeSet<&String> = docs.iter().collect();
    assert_eq!(
        (docs.len(), unique.len()),
        (8, 8),
        "each rollout once: {docs:?}"
    );
    s.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pushes_are_refused_with_the_field_and_cancel_ends_a_waiting_push() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir.path().join("state")).await;
    let job = submit(&s.url, dir.path(), 10).await;

    let err = push(s.url.clone(), vec![group("", 0)]).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("messages[0].job_id"),
        "{}",
        err.message()
    );
    let err = push(s.url.clone(), vec![group("nope", 0)])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // Message 1 holds a non-finite reward: it is refused whole, message 0
    // stays admitted.
    let mut bad = group("", 1);
    bad.rollouts[1].reward = f64::NAN;
    let err = push(s.url.clone(), vec![group(&job, 0), bad])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .starts_with("messages[1].rollouts[1]: \"reward\" must be a finite number"),
        "{}",
        err.message()
    );
    let mut ids = group("", 2);
    ids.rollouts[0].completion_ids = vec![70_000];
    let err = push(s.url.clone(), vec![group(&job, 1), ids])
        .await
        .unwrap_err();
    assert!(
        err.message().starts_with("messages[1].rollouts[0]: ")
            && err.message().contains("completion_ids"),
        "{}",
        err.message()
    );

    // The queue holds groups 0 and 1 (full): the next push waits, and
    // cancelling the job ends it with the job's state.
    let pusher = tokio::spawn(push(s.url.clone(), vec![group(&job, 5)]));
    until_waiting(&s.shared.upgrade().unwrap()).await;
    let mut admin = wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    admin
        .cancel_job(wire::CancelJobRequest {
            job_id: job.clone(),
        })
        .await
        .unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), pusher)
        .await
        .expect("cancelling wakes the waiting push")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("cancelled"), "{}", err.message());
    s.stop.cancel();
}

/// Regression (issue 32, bug 2): a pushed rollout was checked against the
/// submitted `data.max_tokens`: after `accrue set --max-tokens` lowered
/// it, a longer rollout was admitted and the next plan failed the job.
/// The push is refused naming the rollout and the live limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_is_checked_against_the_live_max_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir.path().join("state")).await;
    let job = submit(&s.url, dir.path(), 10).await;
    let mut admin = wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    admin
        .update_job(wire::UpdateJobRequest {
            job_id: job.clone(),
            max_tokens: Some(8),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut long = group(&job, 0);
    long.rollouts[1].completion = "1234567890".into();
    let err = push(s.url.clone(), vec![long]).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(
        err.message().starts_with("messages[0].rollouts[1]: ")
            && err.message().contains("data.max_tokens = 8"),
        "{}",
        err.message()
    );
}
