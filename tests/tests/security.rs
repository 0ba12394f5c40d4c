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

/// A child process killed when dropped (also when a test panics).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A coordinator without tokens on 127.0.0.1, its HTTP side on `metrics`
/// (or "off"), `extra` flags added, its log in `log`: the process, its
/// gRPC URL and its HTTP address.
fn coordinator_with_http(
    state: &Path,
    metrics: &str,
    log: &Path,
    extra: &[&str],
) -> (Killed, String, Option<String>) {
    let mut child = Command::new(bin_dir().join("accrue-coordinator"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", metrics])
        .args(extra)
        .arg("--state-dir")
        .arg(state)
        .env_remove("ACCRUE_ADMIN_TOKEN")
        .env_remove("ACCRUE_WORKER_TOKEN")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| {
        let line = lines.next().unwrap().unwrap();
        line.strip_prefix(prefix)
            .unwrap_or_else(|| panic!("unexpected line {line:?}"))
            .to_string()
    };
    let url = format!("http://{}", next("listening on "));
    let http = (metrics != "off").then(|| next("metrics on "));
    (Killed(child), url, http)
}

/// `GET path` on `addr` (HTTP/1.0, the server closes the connection).
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply
}

/// Issue 14 item 9: binding the unauthenticated status page and metrics
/// off loopback gave no warning.
#[test]
fn serving_metrics_off_loopback_warns_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    for (metrics, warns) in [("0.0.0.0:0", true), ("127.0.0.1:0", false)] {
        let log = dir.path().join("coordinator.log");
        let (child, _, http) = coordinator_with_http(&dir.path().join("state"), metrics, &log, &[]);
        drop(child);
        let text = std::fs::read_to_string(&log).unwrap();
        let warning = format!(
            "the status page and /metrics on {} are not on loopback",
            http.unwrap()
        );
        assert_eq!(text.contains(&warning), warns, "{metrics}: {text}");
        // Issue 18: no colour codes when the log is not a terminal.
        assert!(
            !text.contains('\u{1b}'),
            "colour codes in a log file: {text}"
        );
    }
}

/// Issue 14 item 9: the unauthenticated status JSON showed absolute file
/// paths in job reasons (the README says it shows no specs or data). The
/// admin API (with its token) still names the file.
#[test]
fn the_status_json_shows_job_reasons_without_paths() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = write_job(d, "gone", "steps = 100");
    let state = d.join("state");
    let log = d.join("coordinator.log");
    let (child, url, _) = coordinator_with_http(&state, "127.0.0.1:0", &log, &[]);
    let out = accrue(&url, &["submit", spec.to_str().unwrap()], d);
    assert!(out.status.success(), "{}", stderr(&out));
    let job = String::from_utf8_lossy(&out.stdout).trim().to_string();
    drop(child);
    // The dataset is gone after a restart: the job fails, its reason
    // naming the missing file.
    let train = d.join("train.jsonl");
    std::fs::remove_file(&train).unwrap();
    let (child, url, http) = coordinator_with_http(&state, "127.0.0.1:0", &log, &[]);
    let reply = http_get(&http.unwrap(), "/api/status");
    let body = &reply[reply.find("\r\n\r\n").unwrap() + 4..];
    let status: serde_json::Value = serde_json::from_str(body).unwrap();
    let reason = status["jobs"][0]["reason"].as_str().unwrap().to_string();
    assert_eq!(status["jobs"][0]["state"], "failed", "{status}");
    assert_eq!(
        reason,
        "after restart the dataset could not be loaded: file not found: <path>"
    );
    assert!(!body.contains(&d.display().to_string()), "{body}");
    let out = accrue(&url, &["status", &job], d);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&train.display().to_string()),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    drop(child);
}

/// Issue 14 item 10: a request over the CLI's gRPC message limit failed
/// with "h2 protocol error: http2 error (internal)"; over the
/// coordinator's, with tonic's bare length message.
#[test]
fn a_request_over_the_message_limit_names_the_limit_and_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = write_job(d, "big", "epochs = 1");
    let mut text = std::fs::read_to_string(&spec).unwrap();
    text.push_str(&format!("# {}\n", "x".repeat(2 << 20)));
    std::fs::write(&spec, text).unwrap();
    let log = d.join("coordinator.log");
    let (child, url, _) = coordinator_with_http(&d.join("state"), "off", &log, &[]);
    let out = Command::new(bin_dir().join("accrue"))
        .args(["--coordinator", &url, "--max-message-mb", "1", "submit"])
        .arg(&spec)
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("the submit request of {} is ", spec.display()))
            && err.contains("bytes, more than the gRPC message limit of 1 MiB"),
        "{err}"
    );
    drop(child);
    let (child, url, _) =
        coordinator_with_http(&d.join("state2"), "off", &log, &["--max-message-mb", "1"]);
    let out = accrue(&url, &["submit", spec.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("a gRPC message over the size limit: ")
            && err.contains("the limit is: 1048576 bytes")
            && err.contains("--max-message-mb"),
        "{err}"
    );
    drop(child);
}
