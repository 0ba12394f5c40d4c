//! Bearer-token authentication of the coordinator's gRPC services.
//!
//! Two secrets, one per audience: the **worker token** opens
//! `accrue.v1.WorkerService` and nothing else; the **admin token** opens
//! every other service (`Admin`, and any admin-facing service added later,
//! such as `Rollouts`: an unknown service is admin-only by default, so a new
//! service is never left open by accident). A worker token never works on an
//! admin RPC and vice versa; the two must differ. The one exemption is
//! `grpc.health.v1.Health` (Check/Watch), which answers without a token:
//! Kubernetes gRPC probes send none, and it reveals only serving status.
//!
//! The check is a tower layer over the whole router ([`AuthLayer`]) because
//! it needs the RPC path (which audience) and the peer address (the log
//! line), which a tonic interceptor does not see. The decision itself is the
//! pure [`authorize`]. Comparison is constant-time (`subtle`); a refusal is
//! `Unauthenticated`, names the token that is expected, never the token, and
//! is logged at warn with the peer and the method.
//!
//! Policy when a token is not configured ([`check_policy`]): that service is
//! open, which is allowed only on a loopback listen address (local
//! development, tests, `accrue local` generates tokens anyway) or with
//! `--insecure-no-auth`; anywhere else the coordinator refuses to start.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use subtle::ConstantTimeEq as _;
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;
use tracing::warn;

/// Environment variable holding the admin token.
pub const ADMIN_TOKEN_ENV: &str = "ACCRUE_ADMIN_TOKEN";
/// Environment variable holding the worker token.
pub const WORKER_TOKEN_ENV: &str = "ACCRUE_WORKER_TOKEN";
/// The RPC path prefix of the worker-facing service.
const WORKER_SERVICE_PREFIX: &str = "/accrue.v1.WorkerService/";
/// The RPC path prefix of the standard gRPC health service, open to all.
const HEALTH_SERVICE_PREFIX: &str = "/grpc.health.v1.Health/";

/// Problems with the token configuration (startup errors).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read token file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("token file {} is empty", path.display())]
    Empty { path: PathBuf },
    #[error("{what}: a token must be visible ASCII without spaces")]
    NotAscii { what: String },
    #[error("the admin and worker tokens are the same; they must differ so a worker token cannot administer the coordinator")]
    SameTokens,
    #[error("no {missing} configured and --listen {listen} is not a loopback address: set {hint}, or pass --insecure-no-auth to serve it unauthenticated")]
    Unprotected {
        missing: String,
        listen: SocketAddr,
        hint: String,
    },
}

/// Which token an RPC needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Worker,
}

impl Role {
    /// The audience of an RPC path (`/package.Service/Method`): the worker
    /// service is for workers, everything else is admin.
    pub fn of_path(path: &str) -> Role {
        if path.starts_with(WORKER_SERVICE_PREFIX) {
            Role::Worker
        } else {
            Role::Admin
        }
    }

    fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Worker => "worker",
        }
    }

    fn env(self) -> &'static str {
        match self {
            Role::Admin => ADMIN_TOKEN_ENV,
            Role::Worker => WORKER_TOKEN_ENV,
        }
    }
}

/// A bearer token. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl Token {
    /// Checks that `value` can travel in an HTTP header; `what` names its
    /// source in the error.
    pub fn new(value: &str, what: &str) -> Result<Token, AuthError> {
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(AuthError::NotAscii { what: what.into() });
        }
        Ok(Token(value.into()))
    }

    /// A fresh random token (two v4 UUIDs: 244 random bits).
    pub fn generate() -> Token {
        let a = uuid::Uuid::new_v4().simple().to_string();
        let b = uuid::Uuid::new_v4().simple().to_string();
        Token(format!("{a}{b}").into())
    }

    /// The secret itself, for sending it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The bearer token of job `job`'s OpenAI-compatible endpoint
    /// (`[rl.serve]`), derived from this admin token: HMAC-SHA256 of the
    /// job id, hex. It opens that job's endpoint and nothing else, and
    /// needs no storage: whoever holds the admin token computes it
    /// (`accrue endpoint-token JOB`), and a restarted coordinator agrees.
    pub fn endpoint_token(&self, job: &str) -> Token {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, self.0.as_bytes());
        let tag = ring::hmac::sign(&key, format!("accrue endpoint {job}").as_bytes());
        let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Token(format!("accrue-ep-{hex}").into())
    }

    pub fn matches(&self, presented: &[u8]) -> bool {
        // Constant-time in the content; only the length can leak.
        self.0.as_bytes().ct_eq(presented).into()
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Reads a token file: trailing whitespace (the newline editors add) is
/// trimmed; an unreadable or empty file is an error naming it.
pub fn read_token_file(path: &Path) -> Result<Token, AuthError> {
    let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let value = text.trim_end();
    if value.is_empty() {
        return Err(AuthError::Empty {
            path: path.to_path_buf(),
        });
    }
    Token::new(value, &format!("token file {}", path.display()))
}

/// The token from `file` if given (it wins), else from the environment
/// value `env_value` of variable `env_name` (empty counts as unset).
pub fn resolve_token(
    env_name: &str,
    env_value: Option<&str>,
    file: Option<&Path>,
) -> Result<Option<Token>, AuthError> {
    if let Some(f) = file {
        return read_token_file(f).map(Some);
    }
    match env_value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => Token::new(v, env_name).map(Some),
    }
}

/// The coordinator's tokens; `None` leaves that audience's services open.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    pub admin: Option<Token>,
    pub worker: Option<Token>,
}

impl Tokens {
    fn for_role(&self, role: Role) -> Option<&Token> {
        match role {
            Role::Admin => self.admin.as_ref(),
            Role::Worker => self.worker.as_ref(),
        }
    }
}

/// Default limit on one gRPC message, each way (`--max-message-mb`).
pub const DEFAULT_MAX_MESSAGE_MB: usize = 64;

/// The coordinator's security settings (from `accrue-coordinator` flags).
#[derive(Debug, Clone)]
pub struct Security {
    pub tokens: Tokens,
    /// Serve services without a token on a non-loopback address.
    pub insecure_no_auth: bool,
    /// TLS files; None serves plain HTTP/2.
    pub tls: Option<crate::shell::tls::ServerTls>,
    /// Largest gRPC message decoded or encoded, in bytes; larger ones are
    /// refused with `ResourceExhausted` before a handler runs.
    pub max_message_bytes: usize,
}

impl Default for Security {
    fn default() -> Self {
        Self {
            tokens: Tokens::default(),
            insecure_no_auth: false,
            tls: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_MB << 20,
        }
    }
}

impl Security {
    /// Logs, once at startup, which audiences are served without a token.
    pub fn warn_if_open(&self, listen: SocketAddr) {
        for role in [Role::Admin, Role::Worker] {
            if self.tokens.for_role(role).is_none() {
                warn!(%listen, "{} rpcs are unauthenticated: no {} token configured ({} or --{}-token-file)",
                    role.name(), role.name(), role.env(), role.name());
            }
        }
    }
}

/// Startup rule: the tokens differ, and a service without a token is only
/// served on a loopback address or with `insecure_no_auth`.
pub fn check_policy(
    tokens: &Tokens,
    listen: SocketAddr,
    insecure_no_auth: bool,
) -> Result<(), AuthError> {
    if let (Some(a), Some(w)) = (&tokens.admin, &tokens.worker) {
        if a == w {
            return Err(AuthError::SameTokens);
        }
    }
    if insecure_no_auth || listen.ip().is_loopback() {
        return Ok(());
    }
    let mut missing = Vec::new();
    let mut hint = Vec::new();
    for role in [Role::Admin, Role::Worker] {
        if tokens.for_role(role).is_none() {
            missing.push(format!("{} token", role.name()));
            hint.push(format!("{} or --{}-token-file", role.env(), role.name()));
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(AuthError::Unprotected {
        missing: missing.join(" and "),
        listen,
        hint: hint.join(" and "),
    })
}

/// The token of an `authorization: Bearer <token>` header value (the
/// scheme in any case), None for any other scheme.
pub fn bearer(header: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = header.split_at(header.len().min(7));
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
}

/// Checks one request's `authorization` header against the token its path
/// needs. `Err` is the status to answer with. The health service needs
/// none (probes carry no credentials).
pub fn authorize(tokens: &Tokens, path: &str, header: Option<&[u8]>) -> Result<(), Status> {
    if path.starts_with(HEALTH_SERVICE_PREFIX) {
        return Ok(());
    }
    let role = Role::of_path(path);
    let Some(expected) = tokens.for_role(role) else {
        return Ok(());
    };
    let presented = header.and_then(bearer);
    let what = format!("the {} token ({})", role.name(), role.env());
    match presented {
        None => Err(Status::unauthenticated(format!(
            "{path} needs {what} as `authorization: Bearer <token>`; none was sent"
        ))),
        Some(t) if expected.matches(t) => Ok(()),
        Some(_) => Err(Status::unauthenticated(format!(
            "{path} needs {what}; the token sent is not it"
        ))),
    }
}

/// Tower layer applying [`authorize`] to every gRPC request.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    tokens: Arc<Tokens>,
}

impl AuthLayer {
    pub fn new(tokens: Tokens) -> Self {
        Self {
            tokens: Arc::new(tokens),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

/// The service [`AuthLayer`] wraps around the router.
#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    tokens: Arc<Tokens>,
}

fn peer<B>(req: &http::Request<B>) -> Option<SocketAddr> {
    let ext = req.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
}

type BoxFuture<T, E> = Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let header = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        if let Err(status) = authorize(&self.tokens, req.uri().path(), header) {
            let peer = peer(&req).map_or_else(|| "unknown".to_string(), |a| a.to_string());
            warn!(%peer, method = req.uri().path(), reason = status.message(), "rpc refused: unauthenticated");
            return Box::pin(async move { Ok(status.into_http()) });
        }
        // The clone is not ready; the ready one serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move { inner.call(req).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    const ADMIN: &str = "/accrue.v1.Admin/ListJobs";
    const WORKER: &str = "/accrue.v1.WorkerService/Register";

    fn tokens() -> Tokens {
        Tokens {
            admin: Some(Token::new("adm1n", "t").unwrap()),
            worker: Some(Token::new("w0rker", "t").unwrap()),
        }
    }

    #[test]
    fn each_path_needs_its_own_token() {
        let t = tokens();
        assert!(authorize(&t, ADMIN, Some(b"Bearer adm1n")).is_ok());
        assert!(authorize(&t, ADMIN, Some(b"bearer adm1n")).is_ok());
        assert!(authorize(&t, WORKER, Some(b"Bearer w0rker")).is_ok());
        for (path, header) in [
            (ADMIN, Some("Bearer w0rker")),
            (WORKER, Some("Bearer adm1n")),
            (ADMIN, Some("Bearer adm1n2")),
            (ADMIN, Some("adm1n")),
            (ADMIN, None),
            ("/accrue.v1.Rollouts/Push", Some("Bearer w0rker")),
        ] {
            let header = header.map(str::as_bytes);
            let e = authorize(&t, path, header).unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{path} {header:?}");
            assert!(e.message().starts_with(path), "{}", e.message());
            assert!(
                !e.message().contains("adm1n") && !e.message().contains("w0rker"),
                "the message must not leak a token: {}",
                e.message()
            );
        }
        let e = authorize(&t, WORKER, None).unwrap_err();
        assert!(e.message().contains("worker token (ACCRUE_WORKER_TOKEN)"));
        assert!(e.message().contains("none was sent"));
        let e = authorize(&t, ADMIN, Some(b"Bearer nope")).unwrap_err();
        assert!(e.message().contains("admin token (ACCRUE_ADMIN_TOKEN)"));
        assert!(e.message().contains("is not it"));
    }

    #[test]
    fn the_health_service_needs_no_token_and_opens_nothing_else() {
        let t = tokens();
        for path in [
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
        ] {
            assert!(authorize(&t, path, None).is_ok(), "{path}");
            assert!(authorize(&t, path, Some(b"Bearer wrong")).is_ok(), "{path}");
        }
        // Only that exact service: look-alikes stay admin-only.
        for path in [
            "/grpc.health.v1.HealthX/Check",
            "/grpc.health.v2.Health/Check",
            "/accrue.v1.Admin/grpc.health.v1.Health/",
        ] {
            assert!(authorize(&t, path, None).is_err(), "{path}");
        }
        assert!(authorize(&t, ADMIN, None).is_err());
    }

    #[test]
    fn an_unconfigured_token_leaves_that_audience_open() {
        let t = Tokens {
            admin: Some(Token::new("a", "t").unwrap()),
            worker: None,
        };
        assert!(authorize(&t, WORKER, None).is_ok());
        assert!(authorize(&t, ADMIN, None).is_err());
    }

    #[test]
    fn policy_refuses_open_services_off_loopback() {
        let public: SocketAddr = "0.0.0.0:7070".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:7070".parse().unwrap();
        assert!(check_policy(&Tokens::default(), local, false).is_ok());
        assert!(check_policy(&Tokens::default(), public, true).is_ok());
        assert!(check_policy(&tokens(), public, false).is_ok());
        let e = check_policy(&Tokens::default(), public, false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("admin token and worker token"), "{msg}");
        assert!(msg.contains("--insecure-no-auth"), "{msg}");
        let half = Tokens {
            admin: tokens().admin,
            worker: None,
        };
        let msg = check_policy(&half, public, false).unwrap_err().to_string();
        assert!(msg.starts_with("no worker token configured"), "{msg}");
        assert!(
            msg.contains("ACCRUE_WORKER_TOKEN or --worker-token-file"),
            "{msg}"
        );
        let same = Tokens {
            admin: Some(Token::new("x", "t").unwrap()),
            worker: Some(Token::new("x", "t").unwrap()),
        };
        assert!(matches!(
            check_policy(&same, local, true),
            Err(AuthError::SameTokens)
        ));
    }

    #[test]
    fn token_files_are_trimmed_and_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("admin.token");
        std::fs::write(&f, "s3cret\n").unwrap();
        assert_eq!(read_token_file(&f).unwrap().expose(), "s3cret");
        std::fs::write(&f, "\n").unwrap();
        let e = read_token_file(&f).unwrap_err().to_string();
        assert_eq!(e, format!("token file {} is empty", f.display()));
        let missing = dir.path().join("nope");
        let e = read_token_file(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&format!("cannot read token file {}", missing.display())));
        std::fs::write(&f, "two words\n").unwrap();
        assert!(matches!(
            read_token_file(&f),
            Err(AuthError::NotAscii { .. })
        ));
        // The file wins over the environment; empty env is unset.
        std::fs::write(&f, "fromfile").unwrap();
        let t = resolve_token("X", Some("fromenv"), Some(&f)).unwrap();
        assert_eq!(t.unwrap().expose(), "fromfile");
        let t = resolve_token("X", Some("fromenv"), None).unwrap();
        assert_eq!(t.unwrap().expose(), "fromenv");
        assert!(resolve_token("X", Some(" "), None).unwrap().is_none());
    }

    #[test]
    fn tokens_do_not_print_and_generated_ones_differ() {
        let t = Token::generate();
        assert_eq!(t.expose().len(), 64);
        assert_ne!(t, Token::generate());
        assert!(!format!("{t:?}").contains(t.expose()));
    }
}
