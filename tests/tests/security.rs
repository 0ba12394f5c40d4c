//! The real `accrue-coordinator` with tokens, and the real `accrue` CLI
//! against it: refused without the admin token (exit 1, a message saying
//! which token), accepted with it from the flag, the environment or a file;
//! and the startup rules (no tokens off loopback, unreadable token files).

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;

const ADMIN: &str = "real-admin-token";
const WORKER: &str = "real-worker-token";

fn coordinator_cmd(state: &Path, listen: &str) -> Command {
    let mut c = Command::new(bin_dir().join("accrue-coordinator"));
    c.args(["--listen", listen, "--metrics-listen", "off", "--state-dir"])
        .arg(state)
        .env_remove("ACCRUE_ADMIN_TOKEN")
        .env_remove("ACCRUE_WORKER_TOKEN");
    c
}

fn cli(url: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin_dir().join("accrue"));
    c.args(["--coordinator", url])
        .args(args)
        .env_remove("ACCRUE_ADMIN_TOKEN")
        .env_remove("ACCRUE_ADMIN_TOKEN_FILE");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("running accrue")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn cli_needs_the_admin_token_of_a_protected_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let worker_file = dir.path().join("worker.token");
    std::fs::write(&worker_file, format!("{WORKER}\n")).unwrap();
    let mut child = coordinator_cmd(&dir.path().join("state"), "127.0.0.1:0")
        .env("ACCRUE_ADMIN_TOKEN", ADMIN)
        .arg("--worker-token-file")
        .arg(&worker_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    let url = format!("http://{addr}");

    let out = cli(&url, &["jobs"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("refused the request"), "{err}");
    assert!(err.contains("admin token (ACCRUE_ADMIN_TOKEN)"), "{err}");
    assert!(err.contains("--token"), "{err}");

    let out = cli(&url, &["jobs", "--token", WORKER], &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the worker token is not an admin token"
    );
    assert!(!stderr(&out).contains(WORKER), "{}", stderr(&out));

    let out = cli(&url, &["jobs", "--token", ADMIN], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = cli(&url, &["jobs", "--json"], &[("ACCRUE_ADMIN_TOKEN", ADMIN)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "[]");
    let admin_file = dir.path().join("admin.token");
    std::fs::write(&admin_file, format!("{ADMIN}\n")).unwrap();
    let out = cli(
        &url,
        &["jobs", "--token-file", admin_file.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn coordinator_refuses_to_start_unprotected_off_loopback_or_with_a_bad_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = coordinator_cmd(&dir.path().join("state"), "0.0.0.0:0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("not a loopback address"), "{err}");
    assert!(err.contains("--insecure-no-auth"), "{err}");

    let empty = dir.path().join("empty.token");
    std::fs::write(&empty, "\n").unwrap();
    let out = coordinator_cmd(&dir.path().join("state"), "127.0.0.1:0")
        .arg("--admin-token-file")
        .arg(&empty)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!("token file {} is empty", empty.display())),
        "{err}"
    );
}
