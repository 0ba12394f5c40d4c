//! The endpoint's HTTP side: tokens checked before a body is read, each
//! job's token opening only that job, errors in OpenAI's shape.

use std::sync::Arc;

use axum::http::StatusCode;
use tower::ServiceExt;

use super::*;
use crate::core::{Coordinator, CoordinatorOptions};
use crate::shell::store::Store;

fn shared(dir: &std::path::Path) -> Arc<Shared> {
    Shared::new(
        Coordinator::new(CoordinatorOptions::default()),
        Store::open(dir).unwrap(),
        crate::shell::output::Holder {
            id: "c".into(),
            state_dir: dir.into(),
        },
    )
}

/// POSTs `body` to `path` with `token`: (status, the JSON reply).
async fn post(app: &Router, path: &str, token: Option<&str>, body: Vec<u8>) -> (StatusCode, Json_) {
    let mut req = axum::http::Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let reply = app
        .clone()
        .oneshot(req.body(axum::body::Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = reply.status();
    let bytes = axum::body::to_bytes(reply.into_body(), 1 << 26)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Json_::Null),
    )
}

#[tokio::test]
async fn a_jobs_token_opens_only_that_job_and_is_checked_before_the_body() {
    let dir = tempfile::tempdir().unwrap();
    let admin = Token::generate();
    let app = router(shared(dir.path()), Some(admin.clone()));
    let chat = |job: &str| format!("/jobs/{job}/v1/chat/completions");
    let small = br#"{"messages": [{"role": "user", "content": "hi"}]}"#.to_vec();
    let mine = admin.endpoint_token("a");
    let theirs = admin.endpoint_token("b");
    assert_ne!(mine, theirs);
    assert_ne!(mine.expose(), admin.expose());
    assert_eq!(admin.endpoint_token("a"), mine, "derived, not stored");

    let (status, body) = post(&app, &chat("a"), None, small.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["type"], "authentication_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("accrue endpoint-token a"));
    let (status, _) = post(&app, &chat("a"), Some(theirs.expose()), small.clone()).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "job b's token does not open job a"
    );
    // Past the check: job a has no endpoint here.
    let (status, body) = post(&app, &chat("a"), Some(mine.expose()), small.clone()).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("[rl.serve]"));
    let (status, _) = post(&app, &chat("a"), Some(admin.expose()), small).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // An oversized body: refused unread without a token, bounded with one.
    let huge = vec![b' '; MAX_BODY + 1];
    let (status, _) = post(&app, &chat("a"), None, huge.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = post(&app, &chat("a"), Some(mine.expose()), huge).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let reward = "/jobs/a/v1/episodes/e1/reward";
    let (status, _) = post(&app, reward, None, b"{}".to_vec()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = post(
        &app,
        "/v1/chat/completions",
        Some(admin.expose()),
        Vec::new(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("/jobs/JOB/v1"));
}
