//! `ListSteps` and `UpdateJob` against the real server on 127.0.0.1:0 with
//! a scripted in-process worker: a settings change made while step 1 is in
//! flight applies from step 2, every step's manifest says what it ran with,
//! bad input is refused naming the field, and the manifests survive a
//! restart.

#[path = "../../coordinator/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use accrue_coordinator::core::manifest::{check_exactly_once, Expectation, StepManifest};
use accrue_coordinator::wire;
use common::{fake_worker, start, FakeWorker, PlanHook};
use tokio::sync::Notify;
use tonic::Code;

const SPEC: &str = r#"
[job]
name = "controls"
epochs = 1
output_dir = "out"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["train.jsonl"]
format = "sft"
max_tokens = 64
[batch]
docs_per_step = 4
[optimizer]
lr = 0.001
"#;

/// Plausible sums for a plan: one token in four of each microbatch, loss
/// 1.0 per token, and the plan's documents and microbatches.
fn sums(p: &wire::StepPlan) -> wire::MetricSums {
    let tokens: u64 = p
        .microbatches
        .iter()
        .map(|mb| mb.token_ids.len() as u64 / 4)
        .sum();
    let documents = p
        .microbatches
        .iter()
        .map(|mb| mb.sequences.len())
        .sum::<usize>();
    wire::MetricSums {
        loss_sum: tokens as f64,
        loss_tokens: tokens,
        tokens,
        documents: documents as u64,
        microbatches: p.microbatches.len() as u32,
        ..Default::default()
    }
}

/// A worker that answers Configure with Ready, plans with plausible sums
/// and checkpoint requests with done, and leaves when released. It holds
/// step 1's result (answering nothing meanwhile) until `release` is
/// notified, telling `step1` when that plan has arrived.
fn worker(step1: Arc<Notify>, release: Arc<Notify>) -> FakeWorker {
    let hook: PlanHook = Box::new(move |p| {
        let (step1, release) = (step1.clone(), release.clone());
        let first = p.step == 1;
        Box::pin(async move {
            if first {
                step1.notify_one();
                release.notified().await;
            }
        })
    });
    FakeWorker {
        hostname: "test",
        collective_addr: "127.0.0.1:1",
        before_plan: Some(hook),
        ..FakeWorker::new(sums)
    }
}

type Admin = wire::admin_client::AdminClient<tonic::transport::Channel>;

async fn wait_for(admin: &mut Admin, job: &str, state: wire::JobState) {
    for _ in 0..500 {
        let j = admin
            .get_job(wire::GetJobRequest { job_id: job.into() })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        if j.state == state as i32 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("job {job} never reached {state:?}");
}

fn update(job: &str) -> wire::UpdateJobRequest {
    wire::UpdateJobRequest {
        job_id: job.into(),
        ..Default::default()
    }
}

async fn list(admin: &mut Admin, req: wire::ListStepsRequest) -> Vec<wire::StepManifest> {
    admin.list_steps(req).await.unwrap().into_inner().steps
}

#[tokio::test]
async fn a_change_during_step_1_applies_from_step_2_and_every_manifest_records_it() {
    let dir = tempfile::tempdir().unwrap();
    common::write_sft_fixture(dir.path(), 10, |i| (i + 1).to_string());
    let state = dir.path().join("state");
    let s = start(&state).await;
    let mut admin = Admin::connect(s.url.clone()).await.unwrap();
    let job = common::submit(&s.url, dir.path(), SPEC).await;
    let (step1, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    tokio::spawn(fake_worker(
        s.url.clone(),
        worker(step1.clone(), release.clone()),
    ));
    tokio::time::timeout(std::time::Duration::from_secs(10), step1.notified())
        .await
        .expect("step 1 dispatched");

    // Bad input: refused, naming the field, nothing changed.
    for (req, code, needle) in [
        (
            wire::UpdateJobRequest {
                docs_per_step: Some(0),
                ..update(&job)
            },
            Code::InvalidArgument,
            "batch.docs_per_step: must be at least 1",
        ),
        (
            wire::UpdateJobRequest {
                tokens_per_step: Some(100),
                ..update(&job)
            },
            Code::InvalidArgument,
            "batch.tokens_per_step: the job's steps are sized by batch.docs_per_step",
        ),
        (
            wire::UpdateJobRequest {
                max_tokens: Some(2),
                ..update(&job)
            },
            Code::InvalidArgument,
            "data.max_tokens: document 0:",
        ),
        (update(&job), Code::InvalidArgument, "set at least one of"),
        (
            wire::UpdateJobRequest {
                lr: Some(1.0),
                ..update("nope")
            },
            Code::NotFound,
            "job nope not found",
        ),
        (
            wire::UpdateJobRequest {
                lr: Some(1.0),
                ..update("")
            },
            Code::InvalidArgument,
            "job_id must not be empty",
        ),
    ] {
        let e = admin.update_job(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(e.message().contains(needle), "{req:?}: {}", e.message());
    }
    let r = admin
        .update_job(wire::UpdateJobRequest {
            docs_per_step: Some(3),
            lr: Some(0.5),
            ..update(&job)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.from_step, 2, "never the in-flight step");
    assert_eq!(r.job.unwrap().total_steps, 3, "4 documents, then 6 at 3");
    release.notify_one();
    wait_for(&mut admin, &job, wire::JobState::Completed).await;

    let all = list(
        &mut admin,
        wire::ListStepsRequest {
            job_id: job.clone(),
            detail: true,
            ..Default::default()
        },
    )
    .await;
    let shape: Vec<(u64, u64, Option<u64>, f64, u32)> = all
        .iter()
        .map(|m| (m.step, m.documents, m.docs_per_step, m.lr, m.attempts))
        .collect();
    assert_eq!(
        shape,
        vec![
            (1, 4, Some(4), 0.001, 1),
            (2, 3, Some(3), 0.5, 1),
            (3, 3, Some(3), 0.5, 1)
        ]
    );
    assert!(all
        .iter()
        .all(|m| m.complete && m.world_size == 1 && m.ranks.len() == 1));
    assert!(all
        .iter()
        .all(|m| m.max_tokens == 64 && m.docs.len() as u64 == m.documents));
    // The manifests prove exactly-once through the CLI's JSON form.
    let parsed: Vec<StepManifest> = all
        .iter()
        .map(|m| serde_json::from_value(accrue_cli::steps::step_json(m)).unwrap())
        .collect();
    let expect = Expectation {
        complete_epochs: 1,
        ..Default::default()
    };
    assert_eq!(check_exactly_once(&parsed, 1, &expect), vec![]);
    assert_eq!(parsed.iter().map(|m| m.docs().len()).sum::<usize>(), 10);

    // Ranges, and a summary without the layout.
    let middle = list(
        &mut admin,
        wire::ListStepsRequest {
            job_id: job.clone(),
            from_step: Some(2),
            to_step: Some(2),
            detail: false,
        },
    )
    .await;
    assert_eq!(middle.len(), 1);
    assert_eq!(middle[0].step, 2);
    assert!(middle[0].docs.is_empty() && middle[0].ranks.is_empty());
    for (req, code) in [
        (
            wire::ListStepsRequest {
                job_id: "nope".into(),
                ..Default::default()
            },
            Code::NotFound,
        ),
        (
            wire::ListStepsRequest {
                job_id: job.clone(),
                from_step: Some(3),
                to_step: Some(2),
                detail: false,
            },
            Code::InvalidArgument,
        ),
    ] {
        assert_eq!(admin.list_steps(req).await.unwrap_err().code(), code);
    }
    s.stop.cancel();
    s.task.await.unwrap().unwrap();

    // After a restart: the same manifests, and the change in the record.
    let s = start(&state).await;
    let mut admin = Admin::connect(s.url.clone()).await.unwrap();
    let again = list(
        &mut admin,
        wire::ListStepsRequest {
            job_id: job.clone(),
            detail: true,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(again, all);
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}
