//! Health and lifecycle (issue 7 "Done means": SIGTERM drains a worker with
//! no aborted step, and the coordinator survives SIGTERM + restart), with
//! real processes (see real/cluster.rs) except the coordinator's health
//! test, which runs the server in-process so it can watch the status change
//! on shutdown.
//!
//! Needs the venv with torch (scripts/setup.sh) and `scripts/env.sh` sourced
//! for the worker build (scripts/test.sh does both).

use std::process::Child;
use std::time::{Duration, Instant};

use accrue_coordinator::shell::auth::{Security, Token, Tokens};
use accrue_coordinator::shell::server::{Server, ServerConfig};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

mod real;

use real::cluster::{lock, reference, signal, write_job, Cluster};

/// One `grpc.health.v1.Health/Check` without credentials.
async fn check(url: &str, service: &str) -> Result<ServingStatus, tonic::Status> {
    let mut client = HealthClient::new(
        channel(url)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?,
    );
    let req = HealthCheckRequest {
        service: service.into(),
    };
    let status = client.check(req).await?.into_inner().status;
    Ok(ServingStatus::try_from(status).expect("a known serving status"))
}

async fn channel(url: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect()
        .await
}

/// [`check`] from synchronous test code.
fn check_blocking(url: &str, service: &str) -> Result<ServingStatus, tonic::Status> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(check(url, service))
}

/// Waits for `child` to exit, at most `limit`; returns its status and how
/// long it took.
fn wait_exit(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (s, t0.elapsed());
        }
        assert!(t0.elapsed() < limit, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The address worker `i` logged for its health endpoint.
fn health_addr(c: &Cluster, i: usize) -> String {
    c.wait_log(i, "health endpoint listening", Duration::from_secs(60));
    let log = c.log(i);
    let line = log
        .lines()
        .find(|l| l.contains("health endpoint listening"))
        .unwrap();
    let addr = line.split("addr=").nth(1).expect("addr= in the log line");
    format!("http://{}", addr.split_whitespace().next().unwrap())
}

#[tokio::test]
async fn coordinator_health_needs_no_token_and_turns_not_serving_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().into());
    config.security = Security {
        tokens: Tokens {
            admin: Some(Token::new("adm1n", "test").unwrap()),
            worker: Some(Token::new("w0rker", "test").unwrap()),
        },
        ..Default::default()
    };
    config.shutdown_grace = Duration::from_secs(1);
    let server = Server::bind(config).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(server.run(shutdown.clone()));
    for service in ["", "accrue.v1.Admin", "accrue.v1.WorkerService"] {
        assert_eq!(
            check(&url, service).await.unwrap(),
            ServingStatus::Serving,
            "{service:?}"
        );
    }
    let unknown = check(&url, "no.such.Service").await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    // The exemption opens nothing else: admin RPCs still need the token.
    let mut admin = accrue_coordinator::wire::admin_client::AdminClient::connect(url.clone())
        .await
        .unwrap();
    let refused = admin
        .list_jobs(accrue_coordinator::wire::ListJobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    // A watcher sees NOT_SERVING when shutdown starts.
    let mut client = HealthClient::new(channel(&url).await.unwrap());
    let mut watch = client
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap().status;
    assert_eq!(first, ServingStatus::Serving as i32);
    let t0 = Instant::now();
    shutdown.cancel();
    let next = watch.message().await.unwrap().unwrap().status;
    assert_eq!(next, ServingStatus::NotServing as i32);
    // The open watch does not hold the server past its grace period.
    tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the server stops within its grace")
        .unwrap()
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// SIGTERM to one of three workers while step 3 is in flight (worker 0
/// holds it frozen until the signal is sent): the worker finishes step 3,
/// leaves at the boundary and exits 0; the job goes on at world 2 with no
/// aborted step, every document once, and the parameters of an
/// uninterrupted run. The victim's health endpoint says live and ready
/// before the signal.
fn sigterm_drains_a_worker(sharding: &str) {
    let _g = lock();
    let want = reference(sharding);
    let mut c = Cluster::with_heartbeat(Some(30_000));
    let spec = write_job(c.d(), "job", sharding, 3);
    c.start_worker(Some("stop:before_step:3"));
    c.start_worker(None);
    let victim = c.start_worker_with(None, &["--health-listen", "127.0.0.1:0"]);
    let health = health_addr(&c, victim);
    assert_eq!(check_blocking(&health, "").unwrap(), ServingStatus::Serving);
    let id = c.submit(&spec);
    assert_eq!(
        check_blocking(&health, "accrue.v1.Worker").unwrap(),
        ServingStatus::Serving,
        "ready once registered"
    );
    c.wait_log(0, "fault point", Duration::from_secs(240));
    signal(c.pid(victim), "TERM");
    c.wait_log(
        victim,
        "drain: asking the coordinator",
        Duration::from_secs(30),
    );
    signal(c.pid(0), "CONT");
    let (status, _) = wait_exit(&mut c.workers[victim], Duration::from_secs(120));
    assert!(
        status.success(),
        "{sharding}: drained worker exited {status}\n{}",
        c.logs()
    );
    c.wait_completed(&id, Duration::from_secs(240));
    c.assert_left_after_step_3(&id, want, &format!("{sharding}, SIGTERM 3 → 2"));
    assert!(c.log(victim).contains("released"), "{}", c.log(victim));
}

#[test]
fn sigterm_drains_a_ddp_worker_with_no_aborted_step() {
    sigterm_drains_a_worker("ddp");
}

#[test]
fn sigterm_drains_an_fsdp_worker_with_no_aborted_step() {
    sigterm_drains_a_worker("fsdp");
}

/// SIGTERM to the coordinator while a step is in flight (rank 0 frozen in
/// it, both sessions open): it exits 0 within 10 s; restarted on the same
/// state dir and address, the job completes exactly once with the
/// parameters of an uninterrupted run.
#[test]
fn coordinator_sigterm_exits_promptly_and_a_restart_completes_the_job() {
    let _g = lock();
    let want = reference("ddp");
    let mut c = Cluster::new();
    let spec = write_job(c.d(), "job", "ddp", 2);
    c.start_worker(Some("stop:mid_microbatch:4:0"));
    c.start_worker(Some("stop:mid_microbatch:4:0"));
    let id = c.submit(&spec);
    assert_eq!(
        check_blocking(&c.url(), "").unwrap(),
        ServingStatus::Serving
    );
    let t0 = Instant::now();
    let frozen = loop {
        if let Some(i) = (0..2).find(|&i| c.log(i).contains("fault point")) {
            break i;
        }
        assert!(t0.elapsed() < Duration::from_secs(240), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut coord = c.coord.take().unwrap();
    signal(coord.id(), "TERM");
    let (status, took) = wait_exit(&mut coord, Duration::from_secs(10));
    assert!(
        status.success(),
        "coordinator exited {status}\n{}",
        c.logs()
    );
    let log = std::fs::read_to_string(c.d().join("logs/coordinator-0.log")).unwrap();
    assert!(log.contains("shutting down"), "{log}");
    assert!(log.contains("coordinator stopped"), "{log}");
    eprintln!("coordinator stopped {took:?} after SIGTERM");
    signal(c.pid(frozen), "CONT");
    c.start_coordinator();
    c.wait_completed(&id, Duration::from_secs(240));
    c.assert_trained_like(&id, want, "ddp, coordinator SIGTERM and restart");
}

/// Supervisors often read the first line of a server's stdout and close
/// the pipe, or start it with stdout closed: the coordinator must keep
/// serving (its address lines go to a reader that is gone) and still exit
/// 0 on SIGTERM.
#[test]
fn the_coordinator_serves_and_exits_cleanly_on_sigterm_with_its_stdout_gone() {
    let state = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(real::bin_dir().join("accrue-coordinator"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--state-dir",
        ])
        .arg(state.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the server writes its address.
    drop(child.stdout.take());
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let t0 = Instant::now();
    let mut log = Vec::new();
    while !log
        .iter()
        .any(|l: &String| l.contains("coordinator listening"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never listened:\n{}",
            log.join("\n")
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
            log.push(l);
        }
    }
    // Past the address lines: still up.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the coordinator exited with its stdout gone:\n{}",
        log.join("\n")
    );
    signal(child.id(), "TERM");
    let (status, _) = wait_exit(&mut child, Duration::from_secs(30));
    assert!(status.success(), "exit {status} after SIGTERM");
}
