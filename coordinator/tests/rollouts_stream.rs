//! Streamed rollouts in process: the real server on 127.0.0.1:0, a
//! generator pushing through `Rollouts.PushRollouts`, and a fake worker
//! speaking the real session protocol. A pusher facing a full queue waits
//! (it neither drops nor errors) until committed steps free room; bad input
//! is an InvalidArgument naming the message, rollout and field; cancelling
//! the job ends a waiting push.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use accrue_coordinator::server::{Server, ServerConfig};
use accrue_coordinator::service::Shared;
use accrue_coordinator::wire;
use accrue_coordinator::wire::coordinator_message::Msg as In;
use accrue_coordinator::wire::worker_message::Msg as Out;
use tokio_util::sync::CancellationToken;
use tonic::Code;

struct Running {
    url: String,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

async fn start(state: &Path) -> Running {
    let server = Server::bind(ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        state.to_path_buf(),
    ))
    .await
    .unwrap();
    let url = format!("http://{}", server.local_addr());
    let shared = server.shared();
    let stop = CancellationToken::new();
    tokio::spawn(server.run(stop.clone()));
    Running { url, shared, stop }
}

async fn submit(url: &str, dir: &Path, steps: u64) -> String {
    std::fs::write(dir.join("tiny.json"), "{}").unwrap();
    let spec = format!(
        "[job]\nname = \"stream\"\nsteps = {steps}\noutput_dir = \"out\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\nsource = \"stream\"\nformat = \"rollouts\"\nmax_tokens = 256\n\
         [batch]\ndocs_per_step = 2\n[objective]\nkind = \"pg\"\n\
         [rl]\ngroup_size = 2\nqueue_capacity = 4\n"
    );
    let mut admin = wire::admin_client::AdminClient::connect(url.to_string())
        .await
        .unwrap();
    admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec,
            base_dir: dir.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .job_id
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

/// Answers Configure with Ready and each plan with a result; returns the
/// doc ids of every sequence it trained, once released.
async fn fake_worker(url: String) -> Vec<String> {
    let mut c = wire::worker_service_client::WorkerServiceClient::connect(url)
        .await
        .unwrap();
    let reg = c
        .register(wire::RegisterRequest {
            hostname: "fake".into(),
            device: "cpu".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let msg = |m| wire::WorkerMessage { msg: Some(m) };
    tx.send(msg(Out::Hello(wire::Hello {
        worker_id: reg.worker_id,
    })))
    .await
    .unwrap();
    let mut inbound = c
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut docs = Vec::new();
    while let Ok(Some(m)) = inbound.message().await {
        let reply = match m.msg {
            Some(In::Configure(c)) => Out::Ready(wire::Ready {
                job_id: c.job_id,
                generation: c.generation,
                step: c.step,
            }),
            Some(In::StepPlan(p)) => {
                let seqs = p.microbatches.iter().flat_map(|m| &m.sequences);
                docs.extend(seqs.map(|s| s.doc_id.clone()));
                Out::StepResult(wire::StepResult {
                    job_id: p.job_id,
                    generation: p.generation,
                    step: p.step,
                    rank: p.rank,
                    logps: Vec::new(),
                    sums: Some(wire::MetricSums {
                        loss_sum: 2.0,
                        loss_tokens: 2,
                        tokens: 8,
                        microbatches: 1,
                        ..Default::default()
                    }),
                })
            }
            Some(In::CheckpointRequest(c)) => Out::CheckpointDone(wire::CheckpointDone {
                job_id: c.job_id,
                step: c.step,
                rank: 0,
                path: c.dir,
            }),
            Some(In::Release(_)) => return docs,
            _ => continue,
        };
        tx.send(msg(reply)).await.unwrap();
    }
    docs
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
    until_waiting(&s.shared).await;
    assert!(
        !pusher.is_finished(),
        "no worker, no commit: the push waits"
    );

    let worker = tokio::spawn(fake_worker(s.url.clone()));
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
    until_waiting(&s.shared).await;
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
