//! In-process server tests of the RPC surface's security: bearer tokens per
//! audience, TLS (certificates made here with rcgen, all on 127.0.0.1),
//! message size limits, and the startup policy for unprotected services.

#[path = "../../coordinator/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};

use accrue_cli::client::connect;
use accrue_cli::Conn;
use accrue_coordinator::shell::auth::{Security, Token, Tokens};
use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::shell::tls::ServerTls;
use accrue_coordinator::wire;
use tokio_util::sync::DropGuard;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

const ADMIN: &str = "admin-secret-1";
const WORKER: &str = "worker-secret-2";

/// A server stopped when this is dropped.
struct Running {
    addr: String,
    _stop: DropGuard,
}

fn tokens() -> Tokens {
    Tokens {
        admin: Some(Token::new(ADMIN, "test").unwrap()),
        worker: Some(Token::new(WORKER, "test").unwrap()),
    }
}

async fn start(state: &Path, security: Security) -> Running {
    let mut cfg = common::config(state);
    cfg.security = security;
    let s = common::start_with(cfg).await;
    Running {
        addr: s.addr.to_string(),
        _stop: s.stop.drop_guard(),
    }
}

type Auth = Box<dyn FnMut(Request<()>) -> Result<Request<()>, Status> + Send>;

fn bearer(token: Option<&'static str>) -> Auth {
    Box::new(move |mut r: Request<()>| {
        if let Some(t) = token {
            r.metadata_mut().insert(
                "authorization",
                MetadataValue::try_from(format!("Bearer {t}")).unwrap(),
            );
        }
        Ok(r)
    })
}

async fn channel(addr: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn admin(
    addr: &str,
    token: Option<&'static str>,
) -> wire::admin_client::AdminClient<InterceptedService<Channel, Auth>> {
    wire::admin_client::AdminClient::with_interceptor(channel(addr).await, bearer(token))
}

async fn worker(
    addr: &str,
    token: Option<&'static str>,
) -> wire::worker_service_client::WorkerServiceClient<InterceptedService<Channel, Auth>> {
    wire::worker_service_client::WorkerServiceClient::with_interceptor(
        channel(addr).await,
        bearer(token),
    )
}

fn register() -> wire::RegisterRequest {
    wire::RegisterRequest {
        hostname: "h".into(),
        device: "cpu".into(),
        protocol: accrue_proto::PROTOCOL,
        ..Default::default()
    }
}

#[tokio::test]
async fn each_service_takes_only_its_own_token() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(
        &dir.path().join("state"),
        Security {
            tokens: tokens(),
            ..Default::default()
        },
    )
    .await;

    for (token, needle) in [(None, "none was sent"), (Some("wrong"), "is not it")] {
        let e = admin(&s.addr, token)
            .await
            .list_jobs(wire::ListJobsRequest {})
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
        assert!(
            e.message().contains("admin token (ACCRUE_ADMIN_TOKEN)"),
            "{}",
            e.message()
        );
        assert!(e.message().contains(needle), "{}", e.message());
        let e = worker(&s.addr, token)
            .await
            .register(register())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{token:?}");
        assert!(
            e.message().contains("worker token (ACCRUE_WORKER_TOKEN)"),
            "{}",
            e.message()
        );
    }

    // Crossed tokens are refused, and the message never echoes a token.
    let e = admin(&s.addr, Some(WORKER))
        .await
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(!e.message().contains(WORKER) && !e.message().contains(ADMIN));
    let e = worker(&s.addr, Some(ADMIN))
        .await
        .register(register())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = admin(&s.addr, Some(WORKER))
        .await
        .list_workers(wire::ListWorkersRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    // Nothing was registered by the refused calls.
    let mut a = admin(&s.addr, Some(ADMIN)).await;
    let workers = a
        .list_workers(wire::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert!(workers.is_empty(), "{workers:?}");

    // The right tokens work.
    assert!(a.list_jobs(wire::ListJobsRequest {}).await.is_ok());
    let reg = worker(&s.addr, Some(WORKER))
        .await
        .register(register())
        .await
        .unwrap()
        .into_inner();
    assert!(!reg.worker_id.is_empty());
    let workers = a
        .list_workers(wire::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(workers.len(), 1);

    // The CLI's client sends --token / --token-file.
    let conn = Conn {
        token: Some(ADMIN.into()),
        ..Conn::new(&s.addr)
    };
    let mut c = connect(&conn).await.unwrap();
    assert!(c.list_jobs(wire::ListJobsRequest {}).await.is_ok());
    let file = dir.path().join("admin.token");
    std::fs::write(&file, format!("{ADMIN}\n")).unwrap();
    let conn = Conn {
        token: Some("stale".into()),
        token_file: Some(file),
        ..Conn::new(&s.addr)
    };
    let mut c = connect(&conn).await.unwrap();
    assert!(c.list_jobs(wire::ListJobsRequest {}).await.is_ok());
}

#[tokio::test]
async fn unprotected_services_need_loopback_or_an_explicit_flag() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServerConfig::new("0.0.0.0:0".parse().unwrap(), dir.path().join("state"));
    let err = Server::bind(cfg.clone()).await.err().expect("refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("not a loopback address"), "{msg}");
    assert!(msg.contains("--insecure-no-auth"), "{msg}");
    let mut open = cfg.clone();
    open.security.insecure_no_auth = true;
    assert!(Server::bind(open).await.is_ok());
    let mut protected = cfg;
    protected.security.tokens = tokens();
    assert!(Server::bind(protected).await.is_ok());
}

#[tokio::test]
async fn oversized_messages_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(
        &dir.path().join("state"),
        Security {
            max_message_bytes: 1 << 20,
            ..Default::default()
        },
    )
    .await;
    let mut a = admin(&s.addr, None).await;
    let e = a
        .submit_job(wire::SubmitJobRequest {
            spec_toml: "#".repeat(2 << 20),
            base_dir: "/".into(),
            new_job: false,
        })
        .await
        .unwrap_err();
    assert!(
        // tonic answers OutOfRange (the gRPC spec suggests ResourceExhausted).
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );
    assert!(e.message().contains("too large"), "{}", e.message());
    let jobs = a
        .list_jobs(wire::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert!(jobs.is_empty());
    let e = worker(&s.addr, None)
        .await
        .register(wire::RegisterRequest {
            hostname: "h".repeat(2 << 20),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{e:?}"
    );
    let workers = a
        .list_workers(wire::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert!(workers.is_empty());
}

/// A CA and a leaf it signed, for 127.0.0.1 (PEM files in `dir`).
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path, name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let p = Pki {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-cert.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    std::fs::write(&p.ca, ca.pem()).unwrap();
    std::fs::write(&p.cert, leaf.pem()).unwrap();
    std::fs::write(&p.key, key.serialize_pem()).unwrap();
    p
}

#[tokio::test]
async fn tls_handshakes_with_the_right_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "server");
    let other = pki(dir.path(), "other");
    let s = start(
        &dir.path().join("state"),
        Security {
            tokens: tokens(),
            tls: Some(ServerTls {
                cert: server.cert.clone(),
                key: server.key.clone(),
                client_ca: None,
            }),
            ..Default::default()
        },
    )
    .await;
    let conn = Conn {
        token: Some(ADMIN.into()),
        tls_ca: Some(server.ca.clone()),
        ..Conn::new(&s.addr)
    };
    let mut c = connect(&conn).await.unwrap();
    assert!(c.list_jobs(wire::ListJobsRequest {}).await.is_ok());
    // With --tls-domain overriding the name checked.
    let named = Conn {
        tls_domain: Some("localhost".into()),
        ..conn.clone()
    };
    assert!(connect(&named)
        .await
        .unwrap()
        .list_jobs(wire::ListJobsRequest {})
        .await
        .is_ok());

    let wrong = Conn {
        tls_ca: Some(other.ca.clone()),
        ..conn.clone()
    };
    let err = match connect(&wrong).await {
        Err(e) => format!("{e:#}"),
        Ok(mut c) => format!(
            "{:?}",
            c.list_jobs(wire::ListJobsRequest {}).await.unwrap_err()
        ),
    };
    assert!(
        err.to_lowercase().contains("certificate") || err.contains("UnknownIssuer"),
        "{err}"
    );
    // Plain HTTP/2 against a TLS server fails too.
    let plain = Conn::new(&s.addr);
    let failed = match connect(&plain).await {
        Err(_) => true,
        Ok(mut c) => c.list_jobs(wire::ListJobsRequest {}).await.is_err(),
    };
    assert!(failed);
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let server = pki(dir.path(), "server");
    let client = pki(dir.path(), "client");
    let rogue = pki(dir.path(), "rogue");
    let s = start(
        &dir.path().join("state"),
        Security {
            tls: Some(ServerTls {
                cert: server.cert.clone(),
                key: server.key.clone(),
                client_ca: Some(client.ca.clone()),
            }),
            ..Default::default()
        },
    )
    .await;
    let base = Conn {
        tls_ca: Some(server.ca.clone()),
        ..Conn::new(&s.addr)
    };
    let ok = Conn {
        tls_cert: Some(client.cert.clone()),
        tls_key: Some(client.key.clone()),
        ..base.clone()
    };
    assert!(connect(&ok)
        .await
        .unwrap()
        .list_jobs(wire::ListJobsRequest {})
        .await
        .is_ok());
    for bad in [
        base.clone(),
        Conn {
            tls_cert: Some(rogue.cert.clone()),
            tls_key: Some(rogue.key.clone()),
            ..base.clone()
        },
    ] {
        let refused = match connect(&bad).await {
            Err(_) => true,
            Ok(mut c) => c.list_jobs(wire::ListJobsRequest {}).await.is_err(),
        };
        assert!(refused, "{:?}", bad.tls_cert);
    }
}

#[tokio::test]
async fn tls_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.pem");
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
    cfg.security.tls = Some(ServerTls {
        cert: missing.clone(),
        key: missing.clone(),
        client_ca: None,
    });
    let err = format!("{:#}", Server::bind(cfg).await.err().unwrap());
    assert!(err.contains(&missing.display().to_string()), "{err}");
    let conn = Conn {
        tls_ca: Some(missing.clone()),
        ..Conn::new("127.0.0.1:1")
    };
    let err = format!("{:#}", connect(&conn).await.err().unwrap());
    assert!(
        err.starts_with(&format!("cannot read tls CA {}", missing.display())),
        "{err}"
    );
}
