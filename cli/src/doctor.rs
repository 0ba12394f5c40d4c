//! `accrue doctor`: what a job on this machine would need, checked one by
//! one — the worker binary and libtorch, CUDA devices and the NCCL build,
//! the coordinator and the admin token, a writable shared directory — each
//! reported `ok`, `info` (not a problem, e.g. no GPU) or `FAIL` with what
//! to do. Exit 1 when anything failed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;

use super::client::{connect, rpc_error};
use super::output::outln;
use crate::args::Conn;
use accrue_coordinator::wire::ListJobsRequest;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Ok,
    Info,
    Fail,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
}

fn check(name: &'static str, verdict: Verdict, detail: impl Into<String>) -> Check {
    Check {
        name,
        verdict,
        detail: detail.into(),
    }
}

/// The worker `accrue local` would start (`$ACCRUE_WORKER_BIN`, else
/// beside this binary), else one on PATH.
fn worker_binary() -> Option<PathBuf> {
    super::local::worker_binary().ok().or_else(|| {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join("accrue-worker"))
            .find(|p| p.is_file())
    })
}

/// The worker's `--probe` line, or why it could not run.
pub fn probe_worker(bin: &Path) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(bin)
        .arg("--probe")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!(
            "{} --probe exited {}: {last}",
            bin.display(),
            out.status
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .map_err(|e| format!("{} --probe printed no JSON line: {e}", bin.display()))
}

/// The checks that need no coordinator.
pub fn local_checks(worker: Option<PathBuf>, shared: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    match worker {
        None => out.push(check(
            "worker",
            Verdict::Fail,
            "accrue-worker is neither beside accrue nor on PATH (scripts/setup.sh builds it)",
        )),
        Some(bin) => match probe_worker(&bin) {
            Err(e) => out.push(check(
                "libtorch",
                Verdict::Fail,
                format!("{e} (libtorch 2.13.0 must be findable: scripts/setup.sh installs it into .venv)"),
            )),
            Ok(p) => {
                out.push(check(
                    "libtorch",
                    Verdict::Ok,
                    format!("{} {} loads libtorch ({} threads)", bin.display(), p["version"].as_str().unwrap_or("?"), p["threads"]),
                ));
                let n = p["cuda_devices"].as_u64().unwrap_or(0);
                let cuda_build = p["cuda_build"] == true;
                out.push(if n > 0 {
                    check("cuda", Verdict::Ok, format!("{n} CUDA device(s) visible"))
                } else {
                    check("cuda", Verdict::Info, "no CUDA device visible: workers train on CPU")
                });
                out.push(match (cuda_build, n > 0) {
                    (true, true) => check("nccl", Verdict::Ok, "built with NCCL (loaded at a generation's first collective)"),
                    (true, false) => check("nccl", Verdict::Info, "built with NCCL; no GPU to use it"),
                    (false, true) => check(
                        "nccl",
                        Verdict::Fail,
                        "GPUs are visible but this worker was built without the `cuda` feature: rebuild with --features cuda to use them",
                    ),
                    (false, false) => check("nccl", Verdict::Info, "CPU build (TCP ring collective)"),
                });
            }
        },
    }
    out.push(writable(shared));
    out
}

/// A file can be created, written, synced and removed in `dir`.
fn writable(dir: &Path) -> Check {
    let probe = dir.join(format!(".accrue-doctor-{}", std::process::id()));
    let result = (|| {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&probe)?;
        f.write_all(b"accrue doctor")?;
        f.sync_all()?;
        std::fs::remove_file(&probe)
    })();
    match result {
        Ok(()) => check(
            "shared",
            Verdict::Ok,
            format!("{} is writable", dir.display()),
        ),
        Err(e) => check(
            "shared",
            Verdict::Fail,
            format!(
                "{}: {e} (checkpoints and metrics are written here)",
                dir.display()
            ),
        ),
    }
}

/// Reaches the coordinator and lists jobs with the admin token.
async fn coordinator_check(conn: &Conn) -> Check {
    let call = async {
        let mut c = connect(conn).await?;
        let r = c
            .list_jobs(ListJobsRequest {})
            .await
            .map_err(|s| rpc_error(&s, &conn.coordinator))?;
        anyhow::Ok(r.into_inner().jobs.len())
    };
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(Ok(n)) => check(
            "coordinator",
            Verdict::Ok,
            format!("{} answers with this token ({n} jobs)", conn.coordinator),
        ),
        Ok(Err(e)) => check("coordinator", Verdict::Fail, format!("{e:#}")),
        Err(_) => check(
            "coordinator",
            Verdict::Fail,
            format!("{} did not answer in 10 s", conn.coordinator),
        ),
    }
}

pub async fn run(
    conn: &Conn,
    shared: &Path,
    offline: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut checks = local_checks(worker_binary(), shared);
    if !offline {
        checks.push(coordinator_check(conn).await);
    }
    if json {
        outln!("{}", serde_json::to_string(&checks)?)?;
    } else {
        for c in &checks {
            let tag = match c.verdict {
                Verdict::Ok => "ok  ",
                Verdict::Info => "info",
                Verdict::Fail => "FAIL",
            };
            outln!("{tag}  {:<12} {}", c.name, c.detail)?;
        }
    }
    Ok(if checks.iter().any(|c| c.verdict == Verdict::Fail) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_worker_and_an_unwritable_dir_fail_by_name() {
        let checks = local_checks(None, Path::new("/proc/definitely/not/here"));
        let fails: Vec<&str> = checks
            .iter()
            .filter(|c| c.verdict == Verdict::Fail)
            .map(|c| c.name)
            .collect();
        assert_eq!(fails, ["worker", "shared"]);
    }

    #[test]
    fn a_worker_that_cannot_load_libtorch_fails_with_its_error() {
        let d = tempfile::tempdir().unwrap();
        let fake = d.path().join("accrue-worker");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho 'error while loading shared libraries: libtorch_cpu.so: cannot open shared object file' >&2\nexit 127\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let checks = local_checks(Some(fake), d.path());
        assert_eq!(checks[0].name, "libtorch");
        assert_eq!(checks[0].verdict, Verdict::Fail);
        assert!(
            checks[0].detail.contains("libtorch_cpu.so"),
            "{}",
            checks[0].detail
        );
        assert_eq!(
            checks.last().unwrap().verdict,
            Verdict::Ok,
            "the temp dir is writable"
        );
    }
}
