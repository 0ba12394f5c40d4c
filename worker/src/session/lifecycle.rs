//! Health and drain (issue 7, "Health and lifecycle"): the worker's gRPC
//! health endpoint (`--health-listen`) and what SIGTERM does.
//!
//! Health follows the standard `grpc.health.v1.Health` protocol, which
//! Kubernetes gRPC probes speak: service `""` is SERVING while the process
//! runs (liveness); service [`READINESS_SERVICE`] is SERVING while the
//! worker is registered with a coordinator and not draining (readiness).
//!
//! SIGTERM (a preempted or scaled-down pod) is a drain: the first one asks
//! the session to send `Leave`, the coordinator lets the step in flight
//! finish and releases the worker at the step boundary, and the process
//! exits 0. A second SIGTERM, or the drain timeout passing, exits at once
//! with a non-zero code: the pod's grace period is about to end anyway.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::{error, info, warn};

/// The health service name that reports readiness.
pub const READINESS_SERVICE: &str = "accrue.v1.Worker";
/// Exit code when a second SIGTERM cuts a drain short (128 + SIGTERM).
pub const EXIT_SECOND_SIGTERM: i32 = 143;
/// Exit code when a drain outlives `--drain-timeout-s`.
pub const EXIT_DRAIN_TIMEOUT: i32 = 124;

/// The worker's health endpoint, or none (`Health::default()`): setting
/// readiness on none does nothing. Clones share the endpoint.
#[derive(Debug, Clone, Default)]
pub struct Health {
    reporter: Option<HealthReporter>,
}

impl Health {
    /// Binds `addr` and serves the health service on it (in a task on the
    /// current runtime) until the process ends. Returns the bound address.
    pub async fn serve(addr: &str) -> anyhow::Result<(Health, SocketAddr)> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--health-listen: binding {addr}"))?;
        let local = listener.local_addr()?;
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(READINESS_SERVICE, ServingStatus::NotServing)
            .await;
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
            if let Err(e) = served {
                warn!(%e, "health endpoint stopped");
            }
        });
        info!(addr = %local, "health endpoint listening");
        Ok((
            Health {
                reporter: Some(reporter),
            },
            local,
        ))
    }

    /// Sets readiness ([`READINESS_SERVICE`]).
    pub async fn set_ready(&self, ready: bool) {
        if let Some(r) = &self.reporter {
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            r.set_service_status(READINESS_SERVICE, status).await;
        }
    }
}

/// Whether a drain was requested (SIGTERM). `Drain::default()` never is.
#[derive(Debug, Clone, Default)]
pub struct Drain {
    rx: Option<watch::Receiver<bool>>,
}

impl Drain {
    /// A drain and the switch that requests it (tests; the binary uses
    /// [`drain_on_sigterm`]).
    pub fn manual() -> (watch::Sender<bool>, Drain) {
        let (tx, rx) = watch::channel(false);
        (tx, Drain { rx: Some(rx) })
    }

    /// Whether a drain has been requested.
    pub fn requested(&self) -> bool {
        self.rx.as_ref().is_some_and(|r| *r.borrow())
    }

    /// Resolves once a drain is requested (at once if it already was);
    /// never if none can be.
    pub async fn wait(&mut self) {
        let requested = match self.rx.as_mut() {
            Some(rx) => rx.wait_for(|d| *d).await.is_ok(),
            None => false,
        };
        if !requested {
            // No sender left: no drain can come.
            std::future::pending::<()>().await;
        }
    }
}

/// Installs the SIGTERM handling of a worker process: the first SIGTERM
/// requests a drain; a second one, or `timeout` after the first, ends the
/// process at once (`std::process::exit`) with [`EXIT_SECOND_SIGTERM`] or
/// [`EXIT_DRAIN_TIMEOUT`], saying why in the log.
pub fn drain_on_sigterm(timeout: Duration) -> anyhow::Result<Drain> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let (tx, drain) = Drain::manual();
    tokio::spawn(async move {
        term.recv().await;
        info!(
            timeout_s = timeout.as_secs(),
            "SIGTERM: draining (finish the step in flight, leave at the step boundary); a second SIGTERM exits at once"
        );
        let _ = tx.send(true);
        tokio::select! {
            _ = term.recv() => {
                error!(code = EXIT_SECOND_SIGTERM, "second SIGTERM during the drain: exiting at once");
                std::process::exit(EXIT_SECOND_SIGTERM);
            }
            _ = tokio::time::sleep(timeout) => {
                error!(code = EXIT_DRAIN_TIMEOUT, timeout_s = timeout.as_secs(), "drain not finished within --drain-timeout-s: exiting at once");
                std::process::exit(EXIT_DRAIN_TIMEOUT);
            }
        }
    });
    Ok(drain)
}

/// Whether the health service at `addr` (`host:port`) answers SERVING for
/// liveness (service `""`) within 5 s: `accrue-worker --health-check`.
pub async fn check_alive(addr: &str) -> bool {
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let ask = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        let req = HealthCheckRequest {
            service: String::new(),
        };
        let status = HealthClient::new(channel)
            .check(req)
            .await?
            .into_inner()
            .status;
        anyhow::Ok(status == Wire::Serving as i32)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), ask).await,
        Ok(Ok(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    #[tokio::test]
    async fn liveness_serves_at_once_and_readiness_follows_set_ready() {
        let (health, addr) = Health::serve("127.0.0.1:0").await.unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel);
        let mut check = async |service: &str| {
            let req = HealthCheckRequest {
                service: service.into(),
            };
            client.check(req).await.unwrap().into_inner().status
        };
        assert_eq!(check("").await, Wire::Serving as i32);
        assert_eq!(check(READINESS_SERVICE).await, Wire::NotServing as i32);
        health.set_ready(true).await;
        assert_eq!(check(READINESS_SERVICE).await, Wire::Serving as i32);
        health.set_ready(false).await;
        assert_eq!(check(READINESS_SERVICE).await, Wire::NotServing as i32);
        // The image's HEALTHCHECK: alive here, not where nothing listens.
        assert!(check_alive(&addr.to_string()).await);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gone = closed.local_addr().unwrap().to_string();
        drop(closed);
        assert!(!check_alive(&gone).await);
    }

    #[tokio::test]
    async fn a_drain_is_seen_by_every_clone_and_default_never_drains() {
        let (tx, mut d) = Drain::manual();
        let mut clone = d.clone();
        assert!(!d.requested());
        tx.send(true).unwrap();
        d.wait().await;
        clone.wait().await;
        assert!(d.requested() && clone.requested());
        let mut never = Drain::default();
        assert!(!never.requested());
        let waited = tokio::time::timeout(Duration::from_millis(20), never.wait()).await;
        assert!(waited.is_err());
    }
}
