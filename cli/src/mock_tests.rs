//! The commands against an in-process mock Admin server on 127.0.0.1:0:
//! exit codes, the bearer token on the wire, submit's request and error
//! paths, and how `watch` decides its exit code. The real coordinator is
//! exercised by the workspace's end-to-end tests.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use tonic::{Request, Response, Status};

use super::{admin, set, steps, watch, Conn};
use accrue_coordinator::wire::admin_server::{Admin, AdminServer};
use accrue_coordinator::wire::watch_job_response::Item;
use accrue_coordinator::wire::*;

struct Mock {
    /// The `authorization` header of every call, in order.
    auth: Mutex<Vec<Option<String>>>,
    submitted: Mutex<Vec<SubmitJobRequest>>,
    /// What WatchJob streams.
    watch: Vec<WatchJobResponse>,
    /// The state GetJob reports.
    state: JobState,
    /// Every ListSteps and UpdateJob request, in order.
    listed: Mutex<Vec<ListStepsRequest>>,
    updates: Mutex<Vec<UpdateJobRequest>>,
}

impl Default for Mock {
    fn default() -> Self {
        Self {
            auth: Mutex::default(),
            submitted: Mutex::default(),
            watch: Vec::new(),
            state: JobState::Running,
            listed: Mutex::default(),
            updates: Mutex::default(),
        }
    }
}

impl Mock {
    fn seen<T>(&self, r: &Request<T>) {
        let h = r
            .metadata()
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_string());
        self.auth.lock().unwrap().push(h);
    }

    fn summary(&self, job_id: &str) -> JobSummary {
        JobSummary {
            job_id: job_id.into(),
            name: "sft-demo".into(),
            state: self.state as i32,
            total_steps: 3,
            ..Default::default()
        }
    }
}

fn quarantined_doc() -> QuarantinedDocument {
    QuarantinedDocument {
        doc_id: "0:13".into(),
        source: "data/train.jsonl:13".into(),
        step: 2,
        detail: "worker w1: non-finite loss NaN in loss chunk 0".into(),
        unix_ms: 1_000,
    }
}

fn known(job_id: &str) -> Result<(), Status> {
    if job_id == "missing" {
        Err(Status::not_found(format!("no job {job_id}")))
    } else {
        Ok(())
    }
}

#[tonic::async_trait]
impl Admin for Mock {
    async fn submit_job(
        &self,
        r: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        self.seen(&r);
        let r = r.into_inner();
        let bad = r.spec_toml.contains("lr = -1");
        self.submitted.lock().unwrap().push(r);
        if bad {
            return Err(Status::invalid_argument(
                "job spec has 1 problem:\noptimizer.lr: must be a positive number, got -1",
            ));
        }
        Ok(Response::new(SubmitJobResponse {
            job_id: "job-1".into(),
            existing: false,
        }))
    }
    async fn validate_job(
        &self,
        _: Request<ValidateJobRequest>,
    ) -> Result<Response<ValidateJobResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
    async fn list_quarantine(
        &self,
        r: Request<ListQuarantineRequest>,
    ) -> Result<Response<ListQuarantineResponse>, Status> {
        self.seen(&r);
        known(&r.get_ref().job_id)?;
        Ok(Response::new(ListQuarantineResponse {
            documents: vec![quarantined_doc()],
        }))
    }
    async fn release_quarantine(
        &self,
        r: Request<ReleaseQuarantineRequest>,
    ) -> Result<Response<ReleaseQuarantineResponse>, Status> {
        self.seen(&r);
        let r = r.into_inner();
        known(&r.job_id)?;
        if !r.all && r.doc_ids != ["0:13"] {
            return Err(Status::not_found(format!(
                "document {} is not quarantined in job {}",
                r.doc_ids.join(","),
                r.job_id
            )));
        }
        Ok(Response::new(ReleaseQuarantineResponse {
            released: vec![quarantined_doc()],
        }))
    }
    async fn list_jobs(
        &self,
        r: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        self.seen(&r);
        Ok(Response::new(ListJobsResponse {
            jobs: vec![self.summary("job-1")],
        }))
    }
    async fn get_job(&self, r: Request<GetJobRequest>) -> Result<Response<GetJobResponse>, Status> {
        self.seen(&r);
        known(&r.get_ref().job_id)?;
        Ok(Response::new(GetJobResponse {
            job: Some(self.summary(&r.get_ref().job_id)),
            spec_toml: String::new(),
            recent_steps: vec![],
        }))
    }
    async fn cancel_job(
        &self,
        r: Request<CancelJobRequest>,
    ) -> Result<Response<CancelJobResponse>, Status> {
        self.seen(&r);
        known(&r.get_ref().job_id)?;
        let mut job = self.summary(&r.get_ref().job_id);
        job.state = JobState::Cancelled as i32;
        Ok(Response::new(CancelJobResponse { job: Some(job) }))
    }
    async fn pause_job(
        &self,
        _: Request<PauseJobRequest>,
    ) -> Result<Response<PauseJobResponse>, Status> {
        Err(Status::failed_precondition("job job-1 is not running"))
    }
    async fn resume_job(
        &self,
        _: Request<ResumeJobRequest>,
    ) -> Result<Response<ResumeJobResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
    async fn list_workers(
        &self,
        r: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        self.seen(&r);
        Ok(Response::new(ListWorkersResponse { workers: vec![] }))
    }
    async fn drain_worker(
        &self,
        _: Request<DrainWorkerRequest>,
    ) -> Result<Response<DrainWorkerResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
    async fn trigger_checkpoint(
        &self,
        r: Request<TriggerCheckpointRequest>,
    ) -> Result<Response<TriggerCheckpointResponse>, Status> {
        self.seen(&r);
        Ok(Response::new(TriggerCheckpointResponse { step: 12 }))
    }
    async fn list_steps(
        &self,
        r: Request<ListStepsRequest>,
    ) -> Result<Response<ListStepsResponse>, Status> {
        self.seen(&r);
        known(&r.get_ref().job_id)?;
        let detail = r.get_ref().detail;
        self.listed.lock().unwrap().push(r.into_inner());
        let steps = (1..=2)
            .map(|step| StepManifest {
                step,
                generation: 1,
                world_size: 1,
                documents: 1,
                complete: true,
                attempts: 1,
                docs: if detail {
                    vec![format!("0:{step}")]
                } else {
                    vec![]
                },
                ..Default::default()
            })
            .collect();
        Ok(Response::new(ListStepsResponse { steps }))
    }
    async fn update_job(
        &self,
        r: Request<UpdateJobRequest>,
    ) -> Result<Response<UpdateJobResponse>, Status> {
        self.seen(&r);
        known(&r.get_ref().job_id)?;
        let bad = r.get_ref().docs_per_step == Some(0);
        self.updates.lock().unwrap().push(r.into_inner());
        if bad {
            return Err(Status::invalid_argument(
                "invalid update of job job-1: batch.docs_per_step: must be at least 1",
            ));
        }
        Ok(Response::new(UpdateJobResponse {
            job: Some(self.summary("job-1")),
            from_step: 7,
        }))
    }
    type WatchJobStream = tokio_stream::Iter<std::vec::IntoIter<Result<WatchJobResponse, Status>>>;
    async fn watch_job(
        &self,
        r: Request<WatchJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        self.seen(&r);
        let items: Vec<_> = self.watch.iter().cloned().map(Ok).collect();
        Ok(Response::new(tokio_stream::iter(items)))
    }
}

/// Serves `mock` on 127.0.0.1:0; returns a `Conn` pointing at it.
async fn serve(mock: Arc<Mock>, token: Option<&str>) -> Conn {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AdminServer::from_arc(mock))
            .serve_with_incoming(incoming),
    );
    Conn {
        token: token.map(str::to_string),
        ..Conn::new(&format!("http://{addr}"))
    }
}

fn step(n: u64) -> WatchJobResponse {
    WatchJobResponse {
        item: Some(Item::Step(StepMetrics {
            step: n,
            loss: 1.0 / n as f64,
            ..Default::default()
        })),
    }
}

fn event(state: JobState) -> WatchJobResponse {
    WatchJobResponse {
        item: Some(Item::Event(JobEvent {
            kind: EventKind::State as i32,
            state: state as i32,
            ..Default::default()
        })),
    }
}

#[tokio::test]
async fn token_is_sent_as_bearer_on_every_call_and_only_when_set() {
    let mock = Arc::new(Mock::default());
    let conn = serve(mock.clone(), Some("s3cret")).await;
    assert_eq!(admin::jobs(&conn, true).await.unwrap(), ExitCode::SUCCESS);
    assert_eq!(
        admin::workers(&conn, false).await.unwrap(),
        ExitCode::SUCCESS
    );
    assert_eq!(
        admin::checkpoint(&conn, "job-1").await.unwrap(),
        ExitCode::SUCCESS
    );
    let anonymous = Conn {
        token: None,
        ..conn.clone()
    };
    admin::jobs(&anonymous, false).await.unwrap();
    let auth = mock.auth.lock().unwrap().clone();
    let bearer = Some("Bearer s3cret".to_string());
    assert_eq!(auth, vec![bearer.clone(), bearer.clone(), bearer, None]);
}

#[tokio::test]
async fn submit_sends_the_spec_and_an_absolute_base_dir() {
    let mock = Arc::new(Mock::default());
    let conn = serve(mock.clone(), None).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, "[job]\nname = \"x\"\n").unwrap();
    assert_eq!(
        admin::submit(&conn, &path, false).await.unwrap(),
        ExitCode::SUCCESS
    );
    let sent = mock.submitted.lock().unwrap()[0].clone();
    assert_eq!(sent.spec_toml, "[job]\nname = \"x\"\n");
    assert!(
        std::path::Path::new(&sent.base_dir).is_absolute(),
        "{sent:?}"
    );
    assert_eq!(
        std::path::Path::new(&sent.base_dir),
        std::env::current_dir().unwrap()
    );
}

#[tokio::test]
async fn submit_of_a_rejected_spec_exits_1() {
    let conn = serve(Arc::new(Mock::default()), None).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, "[optimizer]\nlr = -1\n").unwrap();
    assert_eq!(
        admin::submit(&conn, &path, false).await.unwrap(),
        ExitCode::FAILURE
    );
}

#[tokio::test]
async fn rpc_errors_name_the_operation_and_the_reason() {
    let conn = serve(Arc::new(Mock::default()), None).await;
    let e = admin::status(&conn, "missing", false).await.unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "get job missing: no job missing (not found)"
    );
    let e = admin::transition(&conn, "job-1", admin::Transition::Pause)
        .await
        .unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "pause job job-1: job job-1 is not running (failed precondition)"
    );
    let code = admin::transition(&conn, "job-1", admin::Transition::Cancel)
        .await
        .unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
}

#[tokio::test]
async fn watch_exit_code_follows_the_last_state_event() {
    for (last, json, want) in [
        (JobState::Completed, false, ExitCode::SUCCESS),
        (JobState::Completed, true, ExitCode::SUCCESS),
        (JobState::Failed, false, ExitCode::FAILURE),
        (JobState::Cancelled, true, ExitCode::FAILURE),
    ] {
        let mock = Mock {
            watch: vec![
                event(JobState::Running),
                step(1),
                step(2),
                step(3),
                event(last),
            ],
            state: JobState::Running,
            ..Default::default()
        };
        let conn = serve(Arc::new(mock), None).await;
        let code = watch::run(&conn, "job-1", 0, json).await.unwrap();
        assert_eq!(code, want, "{last:?} json={json}");
    }
}

#[tokio::test]
async fn watch_asks_for_the_state_when_the_stream_ends_without_one() {
    // The job had already completed: the stream replays steps only.
    let mock = Mock {
        watch: vec![step(1), step(2)],
        state: JobState::Completed,
        ..Default::default()
    };
    let conn = serve(Arc::new(mock), None).await;
    assert_eq!(
        watch::run(&conn, "job-1", 1, false).await.unwrap(),
        ExitCode::SUCCESS
    );
    // Still running when the stream ends: an error, not a silent success.
    let mock = Mock {
        watch: vec![step(1)],
        state: JobState::Running,
        ..Default::default()
    };
    let conn = serve(Arc::new(mock), None).await;
    let e = watch::run(&conn, "job-1", 0, false).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "the watch stream of job job-1 ended while the job is still running"
    );
}

#[tokio::test]
async fn watch_of_an_unknown_job_fails_before_streaming() {
    let conn = serve(Arc::new(Mock::default()), None).await;
    let e = watch::run(&conn, "missing", 0, false).await.unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "get job missing: no job missing (not found)"
    );
}

#[tokio::test]
async fn steps_passes_the_range_and_detail_and_names_an_unknown_job() {
    let mock = Arc::new(Mock::default());
    let conn = serve(mock.clone(), Some("t")).await;
    let args = steps::StepsArgs {
        job: "job-1".into(),
        from: Some(2),
        to: Some(9),
        detail: true,
        json: true,
    };
    assert_eq!(steps::run(&conn, &args).await.unwrap(), ExitCode::SUCCESS);
    let table = steps::StepsArgs {
        json: false,
        detail: false,
        from: None,
        to: None,
        ..args.clone()
    };
    assert_eq!(steps::run(&conn, &table).await.unwrap(), ExitCode::SUCCESS);
    let listed = mock.listed.lock().unwrap().clone();
    assert_eq!(
        listed,
        vec![
            ListStepsRequest {
                job_id: "job-1".into(),
                from_step: Some(2),
                to_step: Some(9),
                detail: true
            },
            ListStepsRequest {
                job_id: "job-1".into(),
                from_step: None,
                to_step: None,
                detail: false
            },
        ]
    );
    assert_eq!(
        mock.auth
            .lock()
            .unwrap()
            .last()
            .cloned()
            .flatten()
            .as_deref(),
        Some("Bearer t")
    );
    let missing = steps::StepsArgs {
        job: "missing".into(),
        ..args
    };
    let e = steps::run(&conn, &missing).await.unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "list steps of job missing: no job missing (not found)"
    );
}

#[tokio::test]
async fn set_sends_only_the_given_settings_and_reports_a_refusal() {
    let mock = Arc::new(Mock::default());
    let conn = serve(mock.clone(), None).await;
    let args = set::SetArgs {
        job: "job-1".into(),
        max_tokens: Some(512),
        lr: Some(2e-4),
        ..Default::default()
    };
    assert_eq!(set::run(&conn, &args).await.unwrap(), ExitCode::SUCCESS);
    let bad = set::SetArgs {
        job: "job-1".into(),
        docs_per_step: Some(0),
        ..Default::default()
    };
    let e = set::run(&conn, &bad).await.unwrap_err();
    assert_eq!(
        format!("{e:#}"),
        "update job job-1: invalid update of job job-1: batch.docs_per_step: must be at least 1 (invalid argument)"
    );
    let sent = mock.updates.lock().unwrap().clone();
    assert_eq!(
        sent[0],
        UpdateJobRequest {
            job_id: "job-1".into(),
            docs_per_step: None,
            tokens_per_step: None,
            max_tokens: Some(512),
            lr: Some(2e-4),
            weights: Default::default(),
        }
    );
    assert_eq!(sent[1].docs_per_step, Some(0));
}

#[tokio::test]
async fn quarantine_lists_releases_and_names_what_is_unknown() {
    use super::quarantine::{run, Action};
    let conn = serve(Arc::new(Mock::default()), None).await;
    assert_eq!(
        run(&conn, "job-1", Action::List, false).await.unwrap(),
        ExitCode::SUCCESS
    );
    assert_eq!(
        run(&conn, "job-1", Action::Release(vec!["0:13".into()]), true)
            .await
            .unwrap(),
        ExitCode::SUCCESS
    );
    let e = run(&conn, "job-1", Action::Release(vec!["0:9".into()]), false)
        .await
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("0:9") && msg.contains("not quarantined"),
        "{msg}"
    );
    let e = run(&conn, "missing", Action::List, false)
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("missing"), "{e:#}");
}
