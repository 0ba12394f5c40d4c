//! `accrue doctor` against a real coordinator requiring an admin token:
//! the right token passes the coordinator check, a wrong one fails it by
//! name with exit 1, an unwritable shared directory fails too.

#[path = "../../coordinator/tests/common/mod.rs"]
mod common;

use accrue_coordinator::shell::auth::{Security, Token, Tokens};

const ADMIN: &str = "doctor-admin-token-0123456789abcdef";

fn doctor(url: &str, token: &str, shared: &std::path::Path) -> (bool, Vec<serde_json::Value>) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_accrue"))
        .args([
            "doctor",
            "--json",
            "--coordinator",
            url,
            "--token",
            token,
            "--shared",
        ])
        .arg(shared)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let checks: Vec<serde_json::Value> = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), checks)
}

fn verdict<'a>(checks: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    checks
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check: {checks:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_the_coordinator_token_and_the_shared_directory() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(&dir.path().join("state"));
    cfg.security = Security {
        tokens: Tokens {
            admin: Some(Token::new(ADMIN, "test").unwrap()),
            worker: None,
        },
        ..Default::default()
    };
    let s = common::start_with(cfg).await;
    let url = s.url.clone();
    let shared = dir.path().to_path_buf();
    let (_, checks) = tokio::task::spawn_blocking(move || doctor(&url, ADMIN, &shared))
        .await
        .unwrap();
    assert_eq!(
        verdict(&checks, "coordinator")["verdict"],
        "ok",
        "{checks:?}"
    );
    assert_eq!(verdict(&checks, "shared")["verdict"], "ok");

    let url = s.url.clone();
    let missing = dir.path().join("no/such/dir");
    let (ok, checks) =
        tokio::task::spawn_blocking(move || doctor(&url, "wrong-token-0123456789abcdef", &missing))
            .await
            .unwrap();
    assert!(!ok, "a failed check exits 1");
    let c = verdict(&checks, "coordinator");
    assert_eq!(c["verdict"], "fail");
    assert!(c["detail"].as_str().unwrap().contains("refused"), "{c}");
    assert_eq!(verdict(&checks, "shared")["verdict"], "fail");
}
