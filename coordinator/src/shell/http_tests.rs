//! The HTTP side against a real store: how long a request holds the
//! coordinator's state lock.

use std::sync::Arc;

use tower::ServiceExt;

use super::*;
use crate::core::{CoordinatorOptions, Event};
use crate::shell::store::StepRecord;
use crate::stream::doc::{DocBody, DocId, Document, Sequence};

/// Regression (issue 33, finding 1): `GET /api/jobs/J/metrics?since=0`
/// decoded the job's whole step history (every record's documents) while
/// holding the global state lock, so one unauthenticated request stalled
/// the coordinator for as long as that takes. Now the lock is held only
/// to copy the store's handle, and only metrics are decoded, after.
/// A coordinator over a real store in `dir` with one submitted SFT job,
/// `job`.
fn shared_with_a_job(dir: &std::path::Path) -> (Arc<Shared>, Store) {
    let store = Store::open(dir).unwrap();
    let shared = Shared::new(
        Coordinator::new(CoordinatorOptions::default()),
        store.clone(),
        crate::shell::output::Holder {
            id: "c".into(),
            state_dir: dir.into(),
        },
    );
    let spec: crate::job::spec::JobSpec = toml::from_str(&format!(
        "[job]\nname = \"t\"\nsteps = 1000\noutput_dir = \"{}\"\n\
         [model]\ninit = \"random\"\nconfig = \"/dev/null\"\n\
         [data]\ntrain = [\"/dev/null\"]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
        dir.join("out").display()
    ))
    .unwrap();
    let docs: Arc<[Document]> = (1..=4)
        .map(|line| Document {
            id: DocId { file: 0, line },
            body: DocBody::Sft(Sequence::new(vec![7; 8], vec![7; 8])),
        })
        .collect::<Vec<_>>()
        .into();
    shared
        .apply(Event::SubmitJob {
            id: "job".into(),
            spec: Arc::new(spec),
            spec_toml: String::new(),
            docs,
            start: None,
        })
        .unwrap();
    (shared, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_request_holds_the_state_lock_only_to_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (shared, store) = shared_with_a_job(dir.path());
    // A long job's history: 200 steps of 30,000 documents each.
    let mut rec = shared.read(|c| c.job("job").unwrap().rec.clone());
    for step in 1..=200u64 {
        rec.step = step;
        let docs = (0..30_000u64)
            .map(|i| DocId {
                file: 0,
                line: (i * 7919 + step * 104_729) % 1_000_003,
            })
            .collect();
        let metrics = StepMetrics {
            step,
            docs: 30_000,
            tokens: 10 * step,
            ..Default::default()
        };
        commit(&store, &rec, metrics, docs);
    }
    // What the old handler did under the lock.
    let t0 = std::time::Instant::now();
    assert_eq!(store.steps("job", 1).unwrap().len(), 200);
    let full_decode = t0.elapsed();

    shared.lock_stats(true);
    let app = router(shared.clone(), None);
    let (status, body) = get(&app, "/api/jobs/job/metrics?since=0", None).await;
    assert_eq!(status, StatusCode::OK);
    let view: MetricsView = serde_json::from_str(&body).unwrap();
    assert_eq!(view.steps.len(), 200);
    assert_eq!(view.steps[199]["tokens"], 2000);
    assert!(!view.more);
    let held = std::time::Duration::from_nanos(shared.lock_stats(false).max_ns);
    assert!(
        held * 10 < full_decode,
        "the lock was held {held:?}; decoding the history takes {full_decode:?}"
    );
}

/// Commits a step of `rec` with `metrics` over `docs` to `store`.
fn commit(store: &Store, rec: &crate::core::JobRecord, metrics: StepMetrics, docs: Vec<DocId>) {
    let step = StepRecord {
        metrics,
        docs,
        manifest: None,
    };
    store.commit_step(rec, step).unwrap();
}

/// `GET path` on `app` with `token` as a bearer token: (status, body).
async fn get(app: &Router, path: &str, token: Option<&str>) -> (StatusCode, String) {
    let mut req = axum::http::Request::get(path);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let reply = app
        .clone()
        .oneshot(req.body(axum::body::Body::empty()).unwrap())
        .await
        .unwrap();
    let status = reply.status();
    let body = axum::body::to_bytes(reply.into_body(), 1 << 26)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// Issue 33: the unauthenticated JSON API showed every worker's host and
/// rank, each job's generation (what a forged ring hello needed) and
/// reason (worker ids, what a verifier printed), and reward components
/// named by the verifier. Without the admin token it now shows only jobs,
/// their states, progress and losses and how many workers there are; with
/// it, everything; a wrong token is refused.
#[tokio::test]
async fn without_the_admin_token_the_api_shows_only_the_public_view() {
    let dir = tempfile::tempdir().unwrap();
    let (shared, store) = shared_with_a_job(dir.path());
    shared
        .apply(Event::RegisterWorker {
            id: "w-secret".into(),
            reg: crate::core::Registration {
                hostname: "gpu-node-17.internal".into(),
                collective_addr: "10.1.2.3:7071".into(),
                ..Default::default()
            },
        })
        .unwrap();
    let mut rec = shared.read(|c| c.job("job").unwrap().rec.clone());
    rec.step = 1;
    rec.generation = 7;
    rec.reason = "worker w-secret (rank 1) answered wrongly: verifier said hunter2".into();
    let metrics = StepMetrics {
        step: 1,
        docs: 2,
        tokens: 16,
        loss: 1.25,
        generation: 7,
        extra: [
            ("rl/reward/leaked_component".to_string(), 0.5),
            ("rl/reward_mean".to_string(), 0.25),
        ]
        .into(),
        ..Default::default()
    };
    let docs = vec![DocId { file: 0, line: 1 }, DocId { file: 0, line: 2 }];
    commit(&store, &rec, metrics, docs);
    shared.lock().core.jobs.get_mut("job").unwrap().rec = rec;

    let admin = crate::shell::auth::Token::new("admintok", "test").unwrap();
    let app = router(shared.clone(), Some(admin));
    let secrets = [
        "gpu-node-17",
        "w-secret",
        "10.1.2.3",
        "hunter2",
        "leaked_component",
    ];

    let (code, body) = get(&app, "/api/status", None).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    let v: StatusView = serde_json::from_str(&body).unwrap();
    assert_eq!(v.detail, Detail::Public);
    assert_eq!((v.jobs.len(), v.workers.len(), v.worker_count), (1, 0, 1));
    let j = &v.jobs[0];
    assert_eq!((j.step, j.reason.as_deref(), j.generation), (1, None, None));
    let (code, steps) = get(&app, "/api/jobs/job/metrics?since=0", None).await;
    assert_eq!(code, StatusCode::OK, "{steps}");
    let m: MetricsView = serde_json::from_str(&steps).unwrap();
    assert_eq!(m.steps.len(), 1);
    assert_eq!(m.steps[0]["loss"], 1.25);
    assert_eq!(m.steps[0]["extra"]["rl/reward_mean"], 0.25);
    assert!(m.steps[0].get("generation").is_none(), "{steps}");
    for secret in secrets {
        assert!(
            !body.contains(secret) && !steps.contains(secret),
            "{secret}: {body} {steps}"
        );
    }

    let (code, body) = get(&app, "/api/status", Some("admintok")).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    let v: StatusView = serde_json::from_str(&body).unwrap();
    assert_eq!(v.detail, Detail::Full);
    assert_eq!(v.workers[0].hostname, "gpu-node-17.internal");
    assert_eq!(v.jobs[0].generation, Some(7));
    assert!(v.jobs[0]
        .reason
        .as_deref()
        .is_some_and(|r| r.contains("hunter2")));
    let (_, steps) = get(&app, "/api/jobs/job/metrics?since=0", Some("admintok")).await;
    assert!(
        steps.contains("leaked_component") && steps.contains("\"generation\":7"),
        "{steps}"
    );

    for wrong in ["nope", "admintok2", ""] {
        let (code, body) = get(&app, "/api/status", Some(wrong)).await;
        assert_eq!(code, StatusCode::UNAUTHORIZED, "{wrong}: {body}");
        assert!(
            body.contains("not the admin token") && !body.contains("admintok"),
            "{body}"
        );
        let (code, _) = get(&app, "/api/jobs/job/metrics?since=0", Some(wrong)).await;
        assert_eq!(code, StatusCode::UNAUTHORIZED);
    }
    // The page and /metrics need no token.
    assert_eq!(get(&app, "/", None).await.0, StatusCode::OK);
    let (code, prom) = get(&app, "/metrics", None).await;
    assert_eq!(code, StatusCode::OK);
    assert!(
        !prom.contains("gpu-node-17") && !prom.contains("w-secret"),
        "{prom}"
    );

    // A coordinator without an admin token (loopback development) shows
    // everything to everyone.
    let open = router(shared.clone(), None);
    let (_, body) = get(&open, "/api/status", None).await;
    assert!(
        body.contains("gpu-node-17.internal") && body.contains("\"detail\":\"full\""),
        "{body}"
    );
}
