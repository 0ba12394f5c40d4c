//! The worker's side of `accrue.v1.WorkerService`: register, open the
//! session stream, forward coordinator messages to the [`Runner`] thread
//! and its answers back, and send heartbeats on the runtime while the
//! thread computes. If the coordinator goes away the worker re-registers
//! with its previous id (backoff, bounded by `reconnect_timeout`) and keeps
//! its model replica. A drain (SIGTERM, see [`lifecycle`]) sends `Leave`
//! and ends the process once the coordinator releases the worker.

mod host;
pub mod lifecycle;
mod peak;
mod relay;
pub mod secure;

use std::sync::Arc;
use std::time::{Duration, Instant};

use accrue_proto::v1 as wire;
use accrue_proto::v1::coordinator_message::Msg as In;
use accrue_proto::v1::worker_message::Msg as Out;
use anyhow::Context as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

pub use host::{hostname, memory_bytes};
pub use peak::peak_flops;
pub use relay::Relay;
use relay::RelayEvent;

use crate::runner::{Runner, RunnerConfig, Work};

/// Settings of one worker process (from the `accrue-worker` flags).
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The coordinator's URL (`http://host:port`; `host:port` is accepted).
    pub coordinator: String,
    /// Address peers reach this worker's collective endpoint on
    /// (advertised at registration; the listener itself is in the
    /// [`RunnerConfig`]).
    pub collective_addr: String,
    /// Leave the process when the coordinator releases the worker.
    pub exit_on_release: bool,
    /// Give up after this long without reaching the coordinator.
    pub reconnect_timeout: Duration,
    pub hostname: String,
    /// The device this worker trains on, as registration reports it.
    pub device: crate::device::DeviceInfo,
    pub memory_bytes: u64,
    /// Peak FLOP/s reported at registration (MFU denominator; 0 = unknown).
    pub peak_flops: f64,
    /// Worker token, TLS and message size limit.
    pub security: secure::Security,
    /// The health endpoint whose readiness the session sets (default: none).
    pub health: lifecycle::Health,
    /// Requests a drain (default: never).
    pub drain: lifecycle::Drain,
    /// This worker's relay listener and the address it advertises
    /// (`--relay-listen`; default: none, its generations are not relayed).
    pub relay: Option<(Arc<std::net::TcpListener>, String)>,
}

impl SessionConfig {
    /// A config describing this host, with the defaults of the binary.
    pub fn new(coordinator: &str) -> SessionConfig {
        SessionConfig {
            coordinator: coordinator.into(),
            collective_addr: String::new(),
            exit_on_release: true,
            reconnect_timeout: Duration::from_secs(60),
            hostname: hostname(),
            device: crate::device::describe(tch::Device::Cpu),
            memory_bytes: memory_bytes(),
            peak_flops: 0.0,
            security: secure::Security::default(),
            health: lifecycle::Health::default(),
            drain: lifecycle::Drain::default(),
            relay: None,
        }
    }
}

/// Binds this worker's collective listener on `addr` (`host:port`, port 0
/// for any free one) and returns it with the address to advertise to peers.
///
/// `advertise` (`--collective-advertise`) wins when given: `host:port`, or a
/// bare host (or `host:0`) that takes the bound port. It is needed where the
/// bound address is not what peers dial, e.g. a Kubernetes pod listening on
/// `0.0.0.0` whose hostname does not resolve (advertise `$(POD_IP):7071`).
/// Without it: the bound address, with this host's name in place of an
/// unspecified IP (`0.0.0.0`).
pub fn bind_collective(
    addr: &str,
    advertise: Option<&str>,
) -> anyhow::Result<(std::net::TcpListener, String)> {
    bind_endpoint("collective", addr, advertise)
}

/// Binds this worker's relay listener (`--relay-listen`, see
/// [`Relay`]) like [`bind_collective`]. `addr` "auto" takes the collective
/// listener's host (`collective_listen`) with any free port, advertised
/// with the collective's advertised host unless `advertise` says more;
/// "off": no relay (its generations are never relayed).
pub fn bind_relay(
    addr: &str,
    advertise: Option<&str>,
    collective_listen: &str,
    collective_advertise: Option<&str>,
) -> anyhow::Result<Option<(std::net::TcpListener, String)>> {
    let (addr, advertise) = match addr.trim() {
        "off" => return Ok(None),
        "auto" => (
            format!("{}:0", host_part(collective_listen)),
            advertise
                .map(str::to_string)
                .or_else(|| collective_advertise.map(|a| host_part(a).to_string())),
        ),
        a => (a.to_string(), advertise.map(str::to_string)),
    };
    bind_endpoint("relay", &addr, advertise.as_deref()).map(Some)
}

/// The host of `host:port`, `[v6]:port`, or a bare host or IP.
fn host_part(addr: &str) -> &str {
    let addr = addr.trim();
    if addr.parse::<std::net::IpAddr>().is_ok() {
        return addr;
    }
    match addr.rsplit_once(':') {
        Some((host, _)) if !host.is_empty() && (!host.contains(':') || host.starts_with('[')) => {
            host
        }
        _ => addr,
    }
}

/// Binds `--{what}-listen` and works out the address to advertise for it
/// (see [`bind_collective`]).
fn bind_endpoint(
    what: &str,
    addr: &str,
    advertise: Option<&str>,
) -> anyhow::Result<(std::net::TcpListener, String)> {
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("--{what}-listen: binding {addr}"))?;
    let local = listener.local_addr()?;
    let advertised = match advertise.map(str::trim) {
        Some(a) => advertised_with_port(what, a, local.port())?,
        None if local.ip().is_unspecified() => format!("{}:{}", hostname(), local.port()),
        None => local.to_string(),
    };
    Ok((listener, advertised))
}

/// `advertise` with `port` filled in where it names none (or port 0).
fn advertised_with_port(what: &str, advertise: &str, port: u16) -> anyhow::Result<String> {
    if advertise.is_empty() {
        anyhow::bail!("--{what}-advertise: empty address");
    }
    if let Ok(ip) = advertise.parse::<std::net::IpAddr>() {
        // A bare IP (an IPv6 one holds colons but no port).
        return Ok(std::net::SocketAddr::new(ip, port).to_string());
    }
    match advertise.rsplit_once(':') {
        Some((host, p)) if (!host.is_empty() && !host.contains(':')) || host.starts_with('[') => {
            let p: u16 = p.parse().with_context(|| {
                format!("--{what}-advertise: {advertise:?}: port {p:?} is not a number")
            })?;
            Ok(format!("{host}:{}", if p == 0 { port } else { p }))
        }
        Some(_) => anyhow::bail!("--{what}-advertise: {advertise:?} is not host:port"),
        None => Ok(format!("{advertise}:{port}")),
    }
}

/// How a session ended.
enum Ended {
    /// Released with `exit_on_release`: the process is done.
    Released(String),
    /// The stream broke: reconnect.
    Lost(String),
    /// A drain was requested while not connected: nothing to finish.
    Drained,
    /// The training thread died: the worker cannot go on.
    Died(String),
}

/// Runs the worker until it is released (with `exit_on_release`) or the
/// coordinator stays unreachable for `reconnect_timeout`.
pub async fn run(cfg: SessionConfig, runner: RunnerConfig) -> anyhow::Result<()> {
    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
    let runner = Runner::start(runner, out_tx);
    let mut relay = match &cfg.relay {
        Some((listener, addr)) => Some(
            Relay::start(
                listener.try_clone()?,
                addr.clone(),
                cfg.security.max_message_bytes,
            )
            .context("starting the relay listener")?,
        ),
        None => None,
    };
    let mut worker_id = String::new();
    let mut unreachable_since: Option<Instant> = None;
    let mut backoff = Duration::from_millis(100);
    let mut drain = cfg.drain.clone();
    let result = loop {
        let ended = session(&cfg, &mut worker_id, &runner, &mut out_rx, relay.as_mut()).await;
        cfg.health.set_ready(false).await;
        match ended {
            Ok(Ended::Released(reason)) => {
                info!(%reason, "released by the coordinator; finishing queued work");
                break Ok(());
            }
            Ok(Ended::Drained) => {
                info!("drain requested while not connected to a coordinator: exiting");
                break Ok(());
            }
            Ok(Ended::Died(why)) => break Err(anyhow::anyhow!(why)),
            Ok(Ended::Lost(why)) if drain.requested() => {
                info!(%why, "session lost while draining: exiting");
                break Ok(());
            }
            Ok(Ended::Lost(why)) => {
                warn!(%why, "session lost; reconnecting");
                unreachable_since = None;
                backoff = Duration::from_millis(100);
            }
            Err(e) if refused(&e) => {
                // A wrong token or certificate does not fix itself.
                break Err(e.context(format!(
                    "coordinator {} refused this worker",
                    cfg.coordinator
                )));
            }
            Err(e) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() > cfg.reconnect_timeout {
                    break Err(e.context(format!(
                        "coordinator {} unreachable for {:?}",
                        cfg.coordinator, cfg.reconnect_timeout
                    )));
                }
                warn!(error = %format!("{e:#}"), retry_in = ?backoff, "cannot reach the coordinator");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = drain.wait() => {
                info!("drain requested while not connected to a coordinator: exiting");
                break Ok(());
            }
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    };
    // Finish what is queued (a final checkpoint) before the process exits.
    tokio::task::spawn_blocking(move || runner.shutdown()).await?;
    result
}

/// Hands one coordinator message (from the session or through this
/// worker's hub) to the runner; Some when it ends the session (a Release,
/// when `release_ends`).
fn deliver(
    msg: In,
    runner: &Runner,
    relay: Option<&mut Relay>,
    release_ends: bool,
) -> Option<Ended> {
    match msg {
        In::Configure(c) => {
            if let Some(r) = relay {
                r.configure(&c);
            }
            runner.submit(Work::Configure(Box::new(c)))
        }
        In::StepPlan(p) => runner.submit(Work::Plan(Box::new(p))),
        In::CheckpointRequest(c) => runner.submit(Work::Checkpoint(c)),
        In::Abort(a) => runner.submit(Work::Abort(a)),
        In::PublishPolicy(p) => runner.submit(Work::Publish(p)),
        In::GeneratePlan(g) => runner.submit(Work::Generate(Box::new(g))),
        In::SyncWeights(s) => runner.submit(Work::Sync(s)),
        In::Relay(r) => {
            let Some(relay) = relay else {
                warn!(job = %r.job_id, generation = r.generation, "a relay for a worker that runs no hub: dropped");
                return None;
            };
            // Its own messages, in order (never a Configure, a Release or a
            // relay: those are not relayed).
            for m in relay.forward(r) {
                match m.msg {
                    Some(In::Relay(_) | In::Configure(_) | In::Release(_)) | None => {
                        warn!("a relayed message of a kind never relayed: dropped")
                    }
                    Some(m) => {
                        deliver(m, runner, None, false);
                    }
                }
            }
        }
        In::Release(r) => {
            info!(job = %r.job_id, reason = %r.reason, "released");
            if release_ends {
                return Some(Ended::Released(r.reason));
            }
        }
    }
    None
}

/// Whether `e` is the coordinator refusing our credentials.
fn refused(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<tonic::Status>())
        .any(|s| {
            matches!(
                s.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            )
        })
}

/// One registration + session stream. `Err` means the coordinator could
/// not be reached at all.
async fn session(
    cfg: &SessionConfig,
    worker_id: &mut String,
    runner: &Runner,
    results: &mut mpsc::UnboundedReceiver<wire::WorkerMessage>,
    mut relay: Option<&mut Relay>,
) -> anyhow::Result<Ended> {
    let mut drain = cfg.drain.clone();
    if drain.requested() {
        return Ok(Ended::Drained);
    }
    let mut client = tokio::select! {
        c = secure::connect(&cfg.coordinator, &cfg.security) => c?,
        _ = drain.wait() => return Ok(Ended::Drained),
    };
    let registering = client.register(wire::RegisterRequest {
        hostname: cfg.hostname.clone(),
        device: cfg.device.label.clone(),
        memory_bytes: cfg.memory_bytes,
        gpu_name: cfg.device.gpu_name.clone(),
        gpu_memory_bytes: cfg.device.gpu_memory_bytes,
        collective_addr: cfg.collective_addr.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        protocol: accrue_proto::PROTOCOL,
        previous_worker_id: worker_id.clone(),
        peak_flops: cfg.peak_flops,
        // The replica this process still holds (a coordinator restart):
        // the coordinator keeps it when it is at the committed step.
        held: runner.progress().held(),
        relay_addr: relay
            .as_ref()
            .map(|r| r.addr().to_string())
            .unwrap_or_default(),
    });
    let reg = tokio::select! {
        r = registering => match r {
            // Another revision of the contract (`protocol`): retrying
            // cannot fix it.
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                return Ok(Ended::Died(format!(
                    "coordinator {} refused this worker: {}",
                    cfg.coordinator,
                    s.message()
                )));
            }
            r => r.context("register")?.into_inner(),
        },
        _ = drain.wait() => return Ok(Ended::Drained),
    };
    *worker_id = reg.worker_id.clone();
    info!(worker = %reg.worker_id, device = %cfg.device, "registered");

    let (tx, rx) = mpsc::channel(256);
    let send = |m: Out| wire::WorkerMessage { msg: Some(m) };
    tx.send(send(Out::Hello(wire::Hello {
        worker_id: reg.worker_id.clone(),
    })))
    .await?;
    let mut inbound = client
        .session(ReceiverStream::new(rx))
        .await
        .context("open session")?
        .into_inner();
    let mut beat = tokio::time::interval(Duration::from_millis(
        u64::from(reg.heartbeat_interval_ms).max(50),
    ));
    let progress = runner.progress();
    // Stamped with this session's clock: the coordinator measures how late
    // it reads them (a backlog of its own is not held against us).
    let opened = Instant::now();
    let heartbeat = || wire::Heartbeat {
        generation: progress
            .generation
            .load(std::sync::atomic::Ordering::Relaxed),
        step: progress.step.load(std::sync::atomic::Ordering::Relaxed),
        sent_ms: opened.elapsed().as_millis() as u64 + 1,
    };
    cfg.health.set_ready(true).await;
    let mut leaving = false;
    let ended = loop {
        tokio::select! {
            msg = inbound.message() => {
                let msg = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break Ended::Lost("the coordinator closed the session".into()),
                    Err(s) => break Ended::Lost(format!("session stream: {s}")),
                };
                let Some(msg) = msg.msg else { continue };
                if let Some(ended) = deliver(msg, runner, relay.as_deref_mut(), cfg.exit_on_release || leaving) {
                    break ended;
                }
            }
            event = async {
                match relay.as_deref_mut() {
                    Some(r) => r.next().await,
                    None => std::future::pending().await,
                }
            } => match event {
                RelayEvent::Message(m) => {
                    let Some(msg) = m.msg else { continue };
                    if let Some(ended) = deliver(msg, runner, relay.as_deref_mut(), cfg.exit_on_release || leaving) {
                        break ended;
                    }
                }
                RelayEvent::Failed { job, generation, peer_rank, message } => {
                    let error = wire::WorkerError {
                        job_id: job,
                        generation,
                        step: progress.step.load(std::sync::atomic::Ordering::Relaxed),
                        kind: wire::ErrorKind::RelayLink as i32,
                        message,
                        peer_rank: Some(peer_rank),
                        weight_ring: false,
                    };
                    if tx.send(send(Out::Error(error))).await.is_err() {
                        break Ended::Lost("the outbound stream closed".into());
                    }
                }
            },
            Some(m) = results.recv() => {
                if tx.send(m).await.is_err() {
                    break Ended::Lost("the outbound stream closed".into());
                }
            }
            _ = beat.tick() => {
                if let Some(why) = runner.died() {
                    // Its last answer (the error) goes out before the
                    // process stops heartbeating and exits non-zero.
                    while let Ok(m) = results.try_recv() {
                        let _ = tx.send(m).await;
                    }
                    break Ended::Died(why);
                }
                if tx.send(send(Out::Heartbeat(heartbeat()))).await.is_err() {
                    break Ended::Lost("the outbound stream closed".into());
                }
            }
            _ = drain.wait(), if !leaving => {
                leaving = true;
                cfg.health.set_ready(false).await;
                info!(worker = %reg.worker_id, "drain: asking the coordinator to let this worker leave at the step boundary");
                let leave = Out::Leave(wire::Leave { reason: "SIGTERM".into() });
                if tx.send(send(leave)).await.is_err() {
                    break Ended::Lost("the outbound stream closed".into());
                }
            }
        }
    };
    if let Ended::Released(_) = &ended {
        // Queued work (the final checkpoint) finishes and its answers go out
        // before the stream closes, with heartbeats meanwhile.
        while runner.pending() > 0 {
            tokio::select! {
                Some(m) = results.recv() => { let _ = tx.send(m).await; }
                _ = beat.tick() => {
                    let _ = tx.send(send(Out::Heartbeat(heartbeat()))).await;
                }
            }
        }
        while let Ok(m) = results.try_recv() {
            let _ = tx.send(m).await;
        }
        drop(tx);
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
    }
    Ok(ended)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertise_overrides_the_bound_address() {
        let (l, a) = bind_collective("127.0.0.1:0", Some("10.1.2.3:7071")).unwrap();
        assert_ne!(l.local_addr().unwrap().port(), 0);
        assert_eq!(a, "10.1.2.3:7071");
    }

    #[test]
    fn advertise_without_port_takes_the_bound_port() {
        let (l, a) = bind_collective("127.0.0.1:0", Some("10.1.2.3")).unwrap();
        let port = l.local_addr().unwrap().port();
        assert_eq!(a, format!("10.1.2.3:{port}"));
        let (l, a) = bind_collective("127.0.0.1:0", Some("pod-a.workers:0")).unwrap();
        assert_eq!(
            a,
            format!("pod-a.workers:{}", l.local_addr().unwrap().port())
        );
        let (l, a) = bind_collective("127.0.0.1:0", Some("fd00::7")).unwrap();
        assert_eq!(a, format!("[fd00::7]:{}", l.local_addr().unwrap().port()));
        assert_eq!(
            advertised_with_port("collective", "[fd00::7]:9", 1).unwrap(),
            "[fd00::7]:9"
        );
    }

    #[test]
    fn without_advertise_the_bound_address_is_advertised() {
        let (l, a) = bind_collective("127.0.0.1:0", None).unwrap();
        assert_eq!(a, l.local_addr().unwrap().to_string());
        let (l, a) = bind_collective("0.0.0.0:0", None).unwrap();
        assert_eq!(
            a,
            format!("{}:{}", hostname(), l.local_addr().unwrap().port())
        );
    }

    #[test]
    fn the_relay_listener_follows_the_collective_one_unless_told_otherwise() {
        assert!(bind_relay("off", None, "127.0.0.1:0", None)
            .unwrap()
            .is_none());
        // auto: the collective's host, any port, advertised with the
        // collective's advertised host.
        let (l, a) = bind_relay("auto", None, "127.0.0.1:0", Some("10.1.2.3:7071"))
            .unwrap()
            .unwrap();
        let port = l.local_addr().unwrap().port();
        assert_eq!(l.local_addr().unwrap().ip().to_string(), "127.0.0.1");
        assert_eq!(a, format!("10.1.2.3:{port}"));
        let (l, a) = bind_relay("auto", None, "127.0.0.1:0", None)
            .unwrap()
            .unwrap();
        assert_eq!(a, l.local_addr().unwrap().to_string());
        let (_, a) = bind_relay("127.0.0.1:0", Some("pod-a:7073"), "0.0.0.0:0", None)
            .unwrap()
            .unwrap();
        assert_eq!(a, "pod-a:7073");
        let e = bind_relay("auto", Some("a:b:c"), "127.0.0.1:0", None).unwrap_err();
        assert!(format!("{e:#}").contains("--relay-advertise"), "{e:#}");
    }

    #[test]
    fn a_bad_advertise_address_is_an_error_naming_the_flag() {
        for bad in ["", "host:port", "a:b:c"] {
            let e = bind_collective("127.0.0.1:0", Some(bad)).unwrap_err();
            assert!(
                format!("{e:#}").contains("--collective-advertise"),
                "{bad:?}: {e:#}"
            );
        }
    }
}
