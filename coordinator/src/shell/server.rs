//! The coordinator server: binds in `bind()` (so tests use 127.0.0.1:0),
//! restores jobs from the state dir, and serves the admin and worker
//! services, the standard gRPC health service and a tick loop until the
//! shutdown token fires.
//!
//! Shutdown (SIGTERM): health turns NOT_SERVING, the listener stops
//! accepting, the tick loop stops, and open connections get
//! [`ServerConfig::shutdown_grace`] to finish before they are dropped (a
//! worker's session stream never ends on its own; the worker reconnects to
//! the restarted coordinator). Nothing needs flushing: every state change
//! was written in its own redb transaction when it happened (a committed
//! step with its job record, atomically), and metrics.jsonl lines are
//! written unbuffered.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accrue_proto::v1::admin_server::AdminServer;
use accrue_proto::v1::rollouts_server::RolloutsServer;
use accrue_proto::v1::worker_service_server::WorkerServiceServer;
use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tracing::{error, info};

use crate::core::{Coordinator, CoordinatorOptions, Event, JobRecord, JobState};
use crate::job::spec::JobSpec;
use crate::shell::service::{AdminService, RolloutsService, Shared, WorkerServiceImpl};
use crate::shell::store::Store;

/// Server settings (from the `accrue-coordinator` flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    pub heartbeat_interval_ms: u32,
    pub heartbeat_timeout_ms: i64,
    /// How often the tick loop checks liveness.
    pub tick_ms: u64,
    /// Where to serve Prometheus `GET /metrics` (None: not served).
    pub metrics_listen: Option<SocketAddr>,
    /// A metrics address that cannot be bound only warns (the default port
    /// may be taken by another coordinator on the machine).
    pub metrics_optional: bool,
    /// Where served jobs' OpenAI-compatible endpoint listens
    /// ([`crate::shell::openai`]; None: not served).
    pub serve_listen: Option<SocketAddr>,
    /// Tokens, TLS and message size limits (see [`crate::shell::auth`]).
    pub security: crate::shell::auth::Security,
    /// How long open connections may run on after shutdown starts.
    pub shutdown_grace: Duration,
    /// Generations of at least this many ranks relay through hubs when
    /// every member can (`core::relay`); 0: never.
    pub relay_min_world: u32,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, state_dir: PathBuf) -> Self {
        Self {
            listen,
            state_dir,
            heartbeat_interval_ms: 500,
            heartbeat_timeout_ms: 2_000,
            tick_ms: 200,
            metrics_listen: None,
            metrics_optional: false,
            serve_listen: None,
            security: crate::shell::auth::Security::default(),
            shutdown_grace: Duration::from_secs(3),
            relay_min_world: crate::core::RELAY_MIN_WORLD,
        }
    }

    /// Sets where the status page and `GET /metrics` are served from a
    /// `--metrics-listen` flag: an address (port 0 lets the OS pick), `off`,
    /// or nothing for [`DEFAULT_METRICS_LISTEN`], which only warns when taken
    /// (another coordinator on the machine may hold it).
    pub fn metrics_from_flag(&mut self, flag: Option<&str>) -> anyhow::Result<()> {
        (self.metrics_listen, self.metrics_optional) = match flag {
            Some("off") => (None, false),
            Some(a) => (
                Some(a.parse().with_context(|| {
                    format!("--metrics-listen {a:?}: expected HOST:PORT or off")
                })?),
                false,
            ),
            None => (Some(DEFAULT_METRICS_LISTEN), true),
        };
        Ok(())
    }
}

/// The status page's and Prometheus's address unless told otherwise.
pub const DEFAULT_METRICS_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9090);

pub struct Server {
    listener: TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    metrics: Option<TcpListener>,
    serve: Option<TcpListener>,
    shared: Arc<Shared>,
    config: ServerConfig,
}

impl Server {
    /// Opens the state dir, restores its jobs and binds the listener.
    pub async fn bind(config: ServerConfig) -> anyhow::Result<Server> {
        let sec = &config.security;
        crate::shell::auth::check_policy(&sec.tokens, config.listen, sec.insecure_no_auth)?;
        let tls = sec
            .tls
            .as_ref()
            .map(crate::shell::tls::server_config)
            .transpose()?;
        std::fs::create_dir_all(&config.state_dir)
            .with_context(|| format!("creating state dir {}", config.state_dir.display()))?;
        let store = Store::open(&config.state_dir)?;
        let mut core = Coordinator::new(CoordinatorOptions {
            heartbeat_timeout_ms: config.heartbeat_timeout_ms,
            relay_min_world: config.relay_min_world,
            seal_links: tls.is_some(),
            ..Default::default()
        });
        let records = store.jobs()?;
        let restored = records.len();
        let mut scorers = Vec::new();
        let mut endpoints = Vec::new();
        for rec in records {
            let (id, terminal) = (rec.id.clone(), rec.state.is_terminal());
            let event = restore_event(rec, &store)?;
            let scorer = match &event {
                Event::RestoreJob { spec, .. } if spec.data.is_generate() && !terminal => {
                    restore_scorer(&id, spec)
                }
                _ => None,
            };
            if let Event::RestoreJob { spec, .. } = &event {
                if spec.rl.serve.is_some() && !terminal {
                    endpoints.extend(restore_endpoint(&id, spec).map(|e| (id.clone(), e)));
                }
            }
            core.handle(event, crate::shell::service::now_ms())?;
            if let Some(s) = scorer {
                let event = Event::LoadPrompts {
                    job: id.clone(),
                    inputs: s.inputs(),
                };
                core.handle(event, crate::shell::service::now_ms())?;
                scorers.push((id.clone(), s));
            }
            // A streamed job's acknowledged rollouts come back with it.
            if let Some(stored) = store.stream(&id)?.filter(|_| !terminal) {
                let event = Event::RestoreRollouts { job: id, stored };
                core.handle(event, crate::shell::service::now_ms())?;
            }
        }
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        config.security.warn_if_open(config.listen);
        info!(addr = %listener.local_addr()?, tls = tls.is_some(), restored, state_dir = %config.state_dir.display(), "coordinator listening");
        let metrics = match config.metrics_listen {
            None => None,
            Some(addr) => match TcpListener::bind(addr).await {
                Ok(l) => Some(l),
                Err(e) if config.metrics_optional => {
                    tracing::warn!(%addr, %e, "metrics endpoint disabled: cannot bind");
                    None
                }
                Err(e) => return Err(e).with_context(|| format!("binding metrics on {addr}")),
            },
        };
        let serve = match config.serve_listen {
            None => None,
            Some(addr) => {
                // The endpoint generates with a job's policy and takes
                // its rollouts: open only where nobody else can reach it.
                let open = sec.tokens.admin.is_none();
                if open && !addr.ip().is_loopback() && !sec.insecure_no_auth {
                    anyhow::bail!("--serve-listen {addr} is not a loopback address and no admin token is configured (served jobs' endpoint tokens derive from it): set ACCRUE_ADMIN_TOKEN, or pass --insecure-no-auth");
                }
                let l = TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the endpoint on {addr}"))?;
                info!(addr = %l.local_addr()?, "served jobs' OpenAI-compatible endpoint listening");
                Some(l)
            }
        };
        let exposed = metrics.as_ref().and_then(|l| l.local_addr().ok());
        if let Some(warning) = exposed.and_then(crate::shell::http::exposure_warning) {
            tracing::warn!("{warning}");
        }
        // The id its jobs' output markers name (state_dir shown absolute).
        let holder = crate::shell::output::Holder {
            id: store.coordinator_id()?,
            state_dir: std::fs::canonicalize(&config.state_dir)
                .unwrap_or_else(|_| config.state_dir.clone()),
        };
        let shared = Shared::new(core, store, holder);
        for (id, s) in scorers {
            shared.install_scorer(&id, s);
        }
        for (id, e) in endpoints {
            shared.install_endpoint(&id, e);
        }
        Ok(Server {
            listener,
            tls,
            metrics,
            serve,
            shared,
            config,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Where `GET /metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Where served jobs' endpoint listens, if it does.
    pub fn serve_addr(&self) -> Option<SocketAddr> {
        self.serve.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Serves until `shutdown` is cancelled, then stops within
    /// `shutdown_grace` (see the module docs).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let shared = self.shared.clone();
        let tick = Duration::from_millis(self.config.tick_ms);
        let ticker_stop = shutdown.clone();
        let ticker = tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            // A late tick is measured (below), not made up in a burst.
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last: Option<Instant> = None;
            loop {
                tokio::select! {
                    _ = ticker_stop.cancelled() => return,
                    _ = interval.tick() => {
                        // Waits for the lock on a blocking thread: a runtime
                        // thread blocked here would stop the sessions it
                        // serves from reading heartbeats.
                        let shared = shared.clone();
                        let ticked = tokio::task::spawn_blocking(move || {
                            let mut inner = shared.lock();
                            // Measured once the lock is held: a tick that
                            // waited for it, or for a thread, was that late.
                            let now = Instant::now();
                            let stalled_ms = last.map_or(0, |l| stall_ms(now - l, tick));
                            // The heartbeats read meanwhile count before the
                            // tick judges silence.
                            if let Err(e) = shared.apply_heartbeats(&mut inner) {
                                error!(%e, "applying heartbeats failed");
                            }
                            if let Err(e) = shared.apply_locked(&mut inner, Event::Tick { stalled_ms }) {
                                error!(%e, "tick failed");
                            }
                            now
                        })
                        .await;
                        match ticked {
                            Ok(now) => last = Some(now),
                            Err(e) => error!(%e, "the tick's thread failed"),
                        }
                    }
                }
            }
        });
        let markers = tokio::spawn(keep_markers(self.shared.clone(), shutdown.clone()));
        // Everything holding the state (and so the store) is awaited before
        // `run` returns: a restarted coordinator opens the same store.
        let mut listeners = Vec::new();
        if let Some(l) = self.metrics {
            listeners.push(tokio::spawn(crate::shell::http::serve(
                l,
                self.shared.clone(),
                self.config.security.tokens.admin.clone(),
                shutdown.clone(),
            )));
        }
        if let Some(l) = self.serve {
            listeners.push(tokio::spawn(crate::shell::openai::serve(
                l,
                self.shared.clone(),
                self.config.security.tokens.admin.clone(),
                shutdown.clone(),
            )));
        }
        let max = self.config.security.max_message_bytes;
        let admin = AdminServer::new(AdminService::new(self.shared.clone()))
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let worker = WorkerServiceServer::new(WorkerServiceImpl::new(
            self.shared.clone(),
            self.config.heartbeat_interval_ms,
            max,
        ))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
        let rollouts = RolloutsServer::new(RolloutsService::new(self.shared.clone()))
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let (health, health_service) = tonic_health::server::health_reporter();
        set_health(&health, ServingStatus::Serving).await;
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = self.tls {
            builder = builder.tls_config(tls).context("configuring tls")?;
        }
        let stop = shutdown.clone();
        let stopping = async move {
            stop.cancelled().await;
            set_health(&health, ServingStatus::NotServing).await;
            info!("shutting down: health NOT_SERVING, accepting no new connections");
        };
        let serve = builder
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .layer(crate::shell::auth::AuthLayer::new(
                self.config.security.tokens.clone(),
            ))
            .add_service(health_service)
            .add_service(admin)
            .add_service(worker)
            .add_service(rollouts)
            .serve_with_incoming_shutdown(accepting(self.listener), stopping);
        let grace = self.config.shutdown_grace;
        tokio::select! {
            r = serve => r.context("serving gRPC")?,
            _ = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
                info!(grace = ?grace, "connections still open after the grace period (worker sessions); closing them");
            }
        }
        // Both return once `shutdown` fired (it has: the server stops only
        // then), after the blocking work in flight, which holds the state.
        let _ = ticker.await;
        let _ = markers.await;
        for l in listeners {
            if tokio::time::timeout(grace, l).await.is_err() {
                info!("an HTTP listener still had open connections after the grace period");
            }
        }
        let jobs = self.shared.lock().core.jobs().count();
        info!(jobs, state_dir = %self.config.state_dir.display(), "coordinator stopped; state is on disk");
        Ok(())
    }
}

/// Keeps the output markers of the live jobs fresh (and so this
/// coordinator's claim on their directories) until `stop`; the first pass
/// runs at once, for the jobs just restored.
async fn keep_markers(shared: Arc<Shared>, stop: CancellationToken) {
    let every = Duration::from_millis(crate::shell::output::REFRESH_MS as u64);
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = interval.tick() => {
                // File writes, and the state lock: off the runtime.
                let shared = shared.clone();
                let now = crate::shell::service::now_ms();
                if let Err(e) = tokio::task::spawn_blocking(move || shared.refresh_markers(now)).await {
                    error!(%e, "the output markers' thread failed");
                }
            }
        }
    }
}

/// Sets the serving status of every service this server offers, and of
/// the server as a whole (service "").
async fn set_health(health: &tonic_health::server::HealthReporter, status: ServingStatus) {
    for name in [
        "",
        <AdminServer<AdminService> as NamedService>::NAME,
        <WorkerServiceServer<WorkerServiceImpl> as NamedService>::NAME,
        <RolloutsServer<RolloutsService> as NamedService>::NAME,
    ] {
        health.set_service_status(name, status).await;
    }
}

/// A job admitted before the bounds of [`crate::job::limits`] (or changed by an
/// older `accrue set`) may break them; planning its next step could take
/// all the coordinator's memory, so it fails with the reason instead.
fn within_limits(
    spec: &JobSpec,
    changes: &[crate::job::settings::ConfigChange],
    data: &crate::stream::data::Dataset,
) -> Result<(), String> {
    let shape = crate::job::settings::Settings::new(spec, changes).latest_shape();
    let mut problems = Vec::new();
    let mut bad = |field: &str, message: String| problems.push(format!("{field}: {message}"));
    crate::job::limits::check_step(&shape, &mut bad);
    if !spec.data.is_stream() {
        let size = crate::job::limits::DatasetSize {
            docs: data.docs.len() as u64,
            tokens: data.report.tokens,
        };
        crate::job::limits::check_against_dataset(&shape, size, &mut bad);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "its step settings break the admission limits: {}",
            problems.join("; ")
        ))
    }
}

/// A restored generating job's prompts and verifier; a job whose prompts
/// can no longer be read is left without (its first round then fails the
/// job, naming this log line's reason).
fn restore_scorer(id: &str, spec: &JobSpec) -> Option<Arc<crate::rl::scorer::Scorer>> {
    let loaded = crate::model::config::read_config(&spec.model)
        .map_err(|e| e.to_string())
        .and_then(|m| {
            crate::rl::scorer::Scorer::load(spec, m.vocab_size, None).map_err(|e| e.to_string())
        });
    match loaded {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            error!(job = %id, %e, "the RL loop's prompts could not be loaded after a restart");
            None
        }
    }
}

/// A served job's endpoint after a restart (its episodes not reported
/// before it are lost: their callers find them unknown).
fn restore_endpoint(id: &str, spec: &JobSpec) -> Option<Arc<crate::rl::endpoint::Endpoint>> {
    let loaded = crate::model::config::read_config(&spec.model)
        .map_err(|e| e.to_string())
        .and_then(|m| crate::rl::endpoint::Endpoint::load(spec, m.vocab_size));
    match loaded {
        Ok(e) => Some(Arc::new(e)),
        Err(e) => {
            error!(job = %id, %e, "the job's endpoint could not be loaded after a restart");
            None
        }
    }
}

/// Rebuilds a stored job. Its dataset is re-read and re-tokenized (the same
/// files give the same documents and ids); a job whose data can no longer be
/// read fails with the reason rather than silently training on less.
fn restore_event(mut rec: JobRecord, store: &Store) -> anyhow::Result<Event> {
    let spec: JobSpec = toml::from_str(&rec.spec_toml)
        .with_context(|| format!("stored spec of job {} does not parse", rec.id))?;
    let docs: Arc<[crate::stream::doc::Document]> = if rec.state.is_terminal() {
        Arc::from(Vec::new())
    } else {
        let loaded = crate::model::config::read_config(&spec.model)
            .map_err(|e| format!("the model config could not be read: {e}"))
            .and_then(|m| {
                crate::stream::data::encoder(&spec.data, m.vocab_size)
                    .and_then(|enc| crate::stream::data::load_job(&enc, &spec, &|_, _| {}))
                    .map_err(|e| format!("the dataset could not be loaded: {e}"))
            })
            .and_then(|d| within_limits(&spec, &rec.changes, &d).map(|()| d));
        match loaded {
            Ok(d)
                if d.docs.len() as u64 + d.eval.as_ref().map_or(0, |e| e.docs.len() as u64)
                    == rec.documents =>
            {
                d.into_job_docs().into()
            }
            Ok(d) => {
                rec.state = JobState::Failed;
                rec.reason = format!(
                    "after restart the dataset holds {} documents, {} when the job was submitted",
                    d.docs.len(),
                    rec.documents
                );
                Arc::from(Vec::new())
            }
            Err(why) => {
                rec.state = JobState::Failed;
                rec.reason = format!("after restart {why}");
                Arc::from(Vec::new())
            }
        }
    };
    if rec.state == JobState::Failed && docs.is_empty() {
        error!(job = %rec.id, reason = %rec.reason, "job failed on restore");
        store.put_job(&rec)?;
    }
    let reference = store.reference(&rec.id)?;
    let history = if rec.state.is_terminal() {
        Vec::new()
    } else {
        // Only the newest steps: a replay reaching older ones reads them
        // then (`Effect::LoadHistory`).
        crate::shell::store::committed_steps(
            store,
            &rec.id,
            crate::core::Job::history_window_start(&rec),
        )?
    };
    Ok(Event::RestoreJob {
        rec: Box::new(rec),
        spec: Arc::new(spec),
        docs,
        reference,
        history,
    })
}

/// How long the coordinator could not listen, judged from one tick to the
/// next: everything past the tick period. While the state lock is held
/// long (a big step's planning and commit) or the runtime's threads are
/// blocked on it, heartbeats sit unread in the sockets and the tick waits
/// with them; that silence is the coordinator's, not the workers' (issue
/// 19: at 4096 workers it cost nearly every worker).
fn stall_ms(since_last_tick: Duration, period: Duration) -> i64 {
    since_last_tick.saturating_sub(period).as_millis() as i64
}

/// The gRPC listener's connections, with Nagle's algorithm off: a worker's
/// small messages (a plan, a result, a heartbeat) otherwise wait up to
/// ~40 ms for the peer's delayed ACK. (`Server::tcp_nodelay` does not reach
/// connections served from our own listener.)
fn accepting(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod liveness_tests;

#[cfg(test)]
mod nodelay_tests {
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        let listener = super::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::accepting(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }

    /// Not a speed target: a detector of Nagle's algorithm meeting the
    /// peer's delayed ACK. Each side writes a message as two small writes
    /// (a header, then a body) and waits for the other's whole message;
    /// with Nagle on, the body waits for the header's ACK, which the peer
    /// delays ~40 ms, so every round trip takes ~40 ms. Without it, well
    /// under a millisecond on loopback: the bound leaves a loaded machine
    /// room.
    #[tokio::test]
    async fn small_write_write_read_round_trips_do_not_wait_for_delayed_acks() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const ROUNDS: usize = 21;
        let listener = super::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::accepting(listener);
        // Dialled as the worker and the CLI dial (`tcp_nodelay(true)`).
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client.set_nodelay(true).unwrap();
        let mut served = incoming.next().await.unwrap().unwrap();
        let echo = tokio::spawn(async move {
            let mut buf = [0u8; 20];
            for _ in 0..ROUNDS {
                served.read_exact(&mut buf).await.unwrap();
                served.write_all(&buf[..4]).await.unwrap();
                served.write_all(&buf[4..]).await.unwrap();
            }
        });
        let mut times = Vec::new();
        let mut buf = [0u8; 20];
        for i in 0..ROUNDS {
            let started = std::time::Instant::now();
            client.write_all(&[i as u8; 4]).await.unwrap();
            client.write_all(&[i as u8; 16]).await.unwrap();
            client.read_exact(&mut buf).await.unwrap();
            times.push(started.elapsed());
            assert_eq!(buf, [i as u8; 20]);
        }
        echo.await.unwrap();
        times.sort();
        let median = times[ROUNDS / 2];
        assert!(
            median < std::time::Duration::from_millis(15),
            "median round trip {median:?} (all: {times:?}): small writes wait for delayed ACKs"
        );
    }
}
