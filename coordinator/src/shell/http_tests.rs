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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_request_holds_the_state_lock_only_to_copy() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let shared = Shared::new(
        Coordinator::new(CoordinatorOptions::default()),
        store.clone(),
        crate::shell::output::Holder {
            id: "c".into(),
            state_dir: dir.path().into(),
        },
    );
    let spec: crate::job::spec::JobSpec = toml::from_str(&format!(
        "[job]\nname = \"t\"\nsteps = 1000\noutput_dir = \"{}\"\n\
         [model]\ninit = \"random\"\nconfig = \"/dev/null\"\n\
         [data]\ntrain = [\"/dev/null\"]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
        dir.path().join("out").display()
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
        store
            .commit_step(
                &rec,
                StepRecord {
                    metrics,
                    docs,
                    manifest: None,
                },
            )
            .unwrap();
    }
    // What the old handler did under the lock.
    let t0 = std::time::Instant::now();
    assert_eq!(store.steps("job", 1).unwrap().len(), 200);
    let full_decode = t0.elapsed();

    shared.lock_stats(true);
    let app = router(shared.clone());
    let reply = app
        .oneshot(
            axum::http::Request::get("/api/jobs/job/metrics?since=0")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::OK);
    let body = axum::body::to_bytes(reply.into_body(), 1 << 26)
        .await
        .unwrap();
    let view: MetricsView = serde_json::from_slice(&body).unwrap();
    assert_eq!(view.steps.len(), 200);
    assert_eq!(view.steps[199].tokens, 2000);
    assert!(!view.more);
    let held = std::time::Duration::from_nanos(shared.lock_stats(false).max_ns);
    assert!(
        held * 10 < full_decode,
        "the lock was held {held:?}; decoding the history takes {full_decode:?}"
    );
}
