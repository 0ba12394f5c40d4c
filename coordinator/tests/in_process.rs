//! In-process server tests: the real tonic server on 127.0.0.1:0 with real
//! clients; bad requests get clear errors and change nothing.

mod common;

use std::path::Path;

use accrue_coordinator::wire;
use common::start;
use tonic::Code;

fn write_fixture(dir: &Path) -> String {
    common::write_sft_fixture(dir, 10, |i| (i + 1).to_string());
    r#"
[job]
name = "inproc"
steps = 2
output_dir = "out"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["train.jsonl"]
format = "sft"
[batch]
docs_per_step = 4
"#
    .to_string()
}

type Admin = wire::admin_client::AdminClient<tonic::transport::Channel>;

/// A coordinator on the fixture's directory and an admin client to it:
/// (dir, spec, server, client, the dir as the submit base).
async fn admin_on_fixture() -> (tempfile::TempDir, String, common::Running, Admin, String) {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_fixture(dir.path());
    let s = start(&dir.path().join("state")).await;
    let admin = Admin::connect(s.url.clone()).await.unwrap();
    let base = dir.path().display().to_string();
    (dir, spec, s, admin, base)
}

#[tokio::test]
async fn admin_rpcs_validate_input_and_persist_jobs() {
    let (dir, spec, s, mut admin, base) = admin_on_fixture().await;

    // An invalid spec: InvalidArgument listing each field, nothing created.
    let bad = spec
        .replace("steps = 2", "steps = 0")
        .replace("docs_per_step = 4", "docs_per_step = 0");
    let err = admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: bad.clone(),
            base_dir: base.clone(),
            new_job: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("job.steps") && err.message().contains("batch.docs_per_step"),
        "{}",
        err.message()
    );
    let problems = admin
        .validate_job(wire::ValidateJobRequest {
            spec_toml: bad,
            base_dir: base.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .problems;
    assert_eq!(problems.len(), 2, "{problems:?}");
    let err = admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec.clone(),
            base_dir: "relative".into(),
            new_job: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("base_dir"));
    assert!(admin
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs
        .is_empty());

    // A valid one waits in pending with no workers.
    let id = admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec,
            base_dir: base,
            new_job: false,
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let job = admin
        .get_job(wire::GetJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(job.state, wire::JobState::Pending as i32);
    assert_eq!(job.documents, 10);
    assert!(job.reason.contains("waiting for workers"), "{}", job.reason);

    for (code, result) in [
        (
            Code::NotFound,
            admin
                .get_job(wire::GetJobRequest {
                    job_id: "nope".into(),
                })
                .await
                .map(drop),
        ),
        (
            Code::InvalidArgument,
            admin
                .cancel_job(wire::CancelJobRequest {
                    job_id: String::new(),
                })
                .await
                .map(drop),
        ),
        (
            Code::NotFound,
            admin
                .drain_worker(wire::DrainWorkerRequest {
                    worker_id: "w".into(),
                })
                .await
                .map(drop),
        ),
        (
            Code::NotFound,
            admin
                .watch_job(wire::WatchJobRequest {
                    job_id: "nope".into(),
                    from_step: 0,
                })
                .await
                .map(drop),
        ),
    ] {
        assert_eq!(result.unwrap_err().code(), code);
    }

    // Pause, resume, cancel; a cancelled job cannot be resumed.
    let paused = admin
        .pause_job(wire::PauseJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.job.unwrap().state, wire::JobState::Paused as i32);
    admin
        .resume_job(wire::ResumeJobRequest { job_id: id.clone() })
        .await
        .unwrap();
    admin
        .cancel_job(wire::CancelJobRequest { job_id: id.clone() })
        .await
        .unwrap();
    let err = admin
        .resume_job(wire::ResumeJobRequest { job_id: id.clone() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    s.stop.cancel();
    s.task.await.unwrap().unwrap();

    // Restarted on the same state dir: the same job, cancelled.
    let s = start(&dir.path().join("state")).await;
    let mut admin = wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    let jobs = admin
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].job_id, id);
    assert_eq!(jobs[0].state, wire::JobState::Cancelled as i32);
    s.stop.cancel();
}

#[tokio::test]
async fn worker_session_rejects_bad_openings() {
    use wire::worker_service_client::WorkerServiceClient;
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir.path().join("state")).await;
    let mut client = WorkerServiceClient::connect(s.url.clone()).await.unwrap();
    let err = client
        .register(wire::RegisterRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("hostname"));
    // A worker built before workers sent their contract revision.
    let err = client
        .register(wire::RegisterRequest {
            hostname: "old".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().starts_with("protocol: "), "{}", err.message());

    // First message not hello.
    let msgs = tokio_stream::iter(vec![wire::WorkerMessage {
        msg: Some(wire::worker_message::Msg::Heartbeat(
            wire::Heartbeat::default(),
        )),
    }]);
    let err = client.session(msgs).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Hello from a worker that never registered.
    let msgs = tokio_stream::iter(vec![wire::WorkerMessage {
        msg: Some(wire::worker_message::Msg::Hello(wire::Hello {
            worker_id: "ghost".into(),
        })),
    }]);
    let err = client.session(msgs).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    s.stop.cancel();
}

/// Issue 14: a live job owns its output_dir (a marker names it); a second
/// job asking for it is refused naming both, an output_dir that cannot be
/// a directory is refused at submit, and an ended job's directory can be
/// taken over.
#[tokio::test]
async fn a_live_jobs_output_dir_is_refused_to_another_and_an_unusable_one_at_submit() {
    let (dir, spec, _s, mut admin, base) = admin_on_fixture().await;
    let submit = |spec_toml: String| wire::SubmitJobRequest {
        spec_toml,
        base_dir: base.clone(),
        new_job: false,
    };
    let first = admin
        .submit_job(submit(spec.clone()))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let marker = std::fs::read_to_string(dir.path().join("out/.accrue-job.json")).unwrap();
    assert!(marker.contains(&first), "{marker}");
    let err = admin
        .submit_job(submit(
            spec.replace("name = \"inproc\"", "name = \"second\""),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains(&first) && err.message().contains("inproc"),
        "{}",
        err.message()
    );
    assert!(err.message().contains("output_dir"), "{}", err.message());
    // An output_dir that is an existing file: refused before any job exists.
    std::fs::write(dir.path().join("afile"), "x").unwrap();
    let err = admin
        .submit_job(submit(
            spec.replace("output_dir = \"out\"", "output_dir = \"afile\"")
                .replace("name = \"inproc\"", "name = \"third\""),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("not a directory"),
        "{}",
        err.message()
    );
    let jobs = admin
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert_eq!(jobs.len(), 1, "nothing created by the refusals");
    // Once the first job ended, its directory can be used again.
    admin
        .cancel_job(wire::CancelJobRequest {
            job_id: first.clone(),
        })
        .await
        .unwrap();
    let second = admin
        .submit_job(submit(spec))
        .await
        .unwrap()
        .into_inner()
        .job_id;
    let marker = std::fs::read_to_string(dir.path().join("out/.accrue-job.json")).unwrap();
    assert!(marker.contains(&second), "{marker}");
}

/// Issue 14 item 2: a job admitted with a billion documents per step (before
/// the limits) took down the coordinator, and, persisted, the next one too.
/// Restored now, it fails with the reason instead of being planned.
#[tokio::test]
async fn a_persisted_job_over_the_limits_fails_at_restore_instead_of_planning() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_fixture(dir.path());
    let state = dir.path().join("state");
    let s = start(&state).await;
    let job = common::submit(&s.url, dir.path(), &spec).await;
    s.stop.cancel();
    s.task.await.unwrap().unwrap();

    // What an older coordinator admitted: the stored spec over the limit.
    {
        let store = accrue_coordinator::shell::store::Store::open(&state).unwrap();
        let mut rec = store.jobs().unwrap().pop().unwrap();
        rec.spec_toml = rec
            .spec_toml
            .replace("docs_per_step = 4", "docs_per_step = 1000000000");
        assert!(rec.spec_toml.contains("1000000000"), "{}", rec.spec_toml);
        store.put_job(&rec).unwrap();
    }
    let s = start(&state).await;
    let mut admin = wire::admin_client::AdminClient::connect(s.url.clone())
        .await
        .unwrap();
    let got = admin
        .get_job(wire::GetJobRequest {
            job_id: job.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(got.state, wire::JobState::Failed as i32, "{got:?}");
    assert!(
        got.reason.contains(
            "batch.docs_per_step: 1000000000 is more than the limit of 1048576 documents per step"
        ),
        "{}",
        got.reason
    );
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}

/// Issue 18: a retried submit (same name and spec, job still live) returns
/// the live job instead of starting a second; the same name with another
/// spec is refused naming the live job; `new_job` starts another anyway.
#[tokio::test]
async fn submitting_twice_returns_the_live_job_and_another_spec_is_refused() {
    let (_dir, spec, _s, mut admin, base) = admin_on_fixture().await;
    let submit = |spec_toml: String, new_job: bool| wire::SubmitJobRequest {
        spec_toml,
        base_dir: base.clone(),
        new_job,
    };
    let first = admin
        .submit_job(submit(spec.clone(), false))
        .await
        .unwrap()
        .into_inner();
    assert!(!first.existing);
    let again = admin
        .submit_job(submit(spec.clone(), false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.job_id, first.job_id);
    assert!(again.existing);
    let other = spec.replace("steps = 2", "steps = 3");
    let err = admin
        .submit_job(submit(other.clone(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert!(
        err.message().contains(&first.job_id) && err.message().contains("job.name"),
        "{}",
        err.message()
    );
    let forced = admin
        .submit_job(submit(
            other.replace("output_dir = \"out\"", "output_dir = \"out2\""),
            true,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(forced.job_id, first.job_id);
    assert!(!forced.existing);
    let jobs = admin
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert_eq!(jobs.len(), 2, "one job per distinct submit");
}

/// Issue 18: a checkpoint is a complete model folder only with its
/// tokenizer files; when they cannot be written (here the job's chat
/// template vanished after submit) the job fails naming the directory and
/// the file, as for any output it cannot write, instead of reporting a
/// checkpoint that AutoTokenizer cannot load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_tokenizer_files_cannot_be_written_fails_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_fixture(dir.path()).replace(
        "format = \"sft\"\n",
        "format = \"sft\"\nchat_template = \"t.jinja\"\n",
    ) + "[checkpoint]\nevery_steps = 1\n";
    let template = dir.path().join("t.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let s = start(&dir.path().join("state")).await;
    let job = common::submit(&s.url, dir.path(), &spec).await;
    std::fs::remove_file(&template).unwrap();
    let worker = tokio::spawn(common::fake_worker(
        s.url.clone(),
        common::FakeWorker::new(|p| common::counted(common::loss_2(p), p)),
    ));
    let mut admin = Admin::connect(s.url.clone()).await.unwrap();
    let mut got = None;
    for _ in 0..200 {
        let j = admin
            .get_job(wire::GetJobRequest {
                job_id: job.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        if j.state == wire::JobState::Failed as i32 || j.state == wire::JobState::Completed as i32 {
            got = Some(j);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let got = got.expect("the job never ended");
    assert_eq!(got.state, wire::JobState::Failed as i32, "{got:?}");
    assert!(
        got.reason.contains("tokenizer files") && got.reason.contains("t.jinja"),
        "{}",
        got.reason
    );
    worker.abort();
    s.stop.cancel();
}

/// Regression (issue 32, bug 5): whether a worker may take back its
/// previous id was decided under one lock and applied under another, and
/// a registration not yet followed by a session did not count as taking
/// the id: two processes registering with the same previous id (a worker
/// restarted twice, a duplicated pod) both got it and shared one record.
/// Each registration gets an id no other live registration holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_with_the_same_previous_id_get_distinct_ids() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir.path().join("state")).await;
    let register = |url: String, previous: &str| {
        let previous = previous.to_string();
        async move {
            let mut c = wire::worker_service_client::WorkerServiceClient::connect(url)
                .await
                .unwrap();
            c.register(wire::RegisterRequest {
                hostname: "h".into(),
                device: "cpu".into(),
                memory_bytes: 1 << 30,
                collective_addr: "127.0.0.1:9".into(),
                version: "test".into(),
                previous_worker_id: previous,
                protocol: accrue_proto::PROTOCOL,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .worker_id
        }
    };
    // Unknown to this coordinator: the first registration takes it back.
    let first = register(s.url.clone(), "w-old").await;
    assert_eq!(first, "w-old");
    let second = register(s.url.clone(), "w-old").await;
    assert_ne!(second, "w-old", "the id is held by the first registration");
    // Many at once: no two share an id.
    let many: Vec<_> = (0..16)
        .map(|_| tokio::spawn(register(s.url.clone(), "w-many")))
        .collect();
    let mut ids = Vec::new();
    for h in many {
        ids.push(h.await.unwrap());
    }
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "{ids:?}");
    assert_eq!(ids.iter().filter(|i| *i == "w-many").count(), 1, "{ids:?}");
}
