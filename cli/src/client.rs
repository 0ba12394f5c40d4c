//! Connecting to the coordinator's Admin service: endpoint parsing, a connect
//! timeout, the bearer-token interceptor, and turning a `tonic::Status` into
//! an error message that says what to do about it.

use std::time::Duration;

use anyhow::Context as _;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

use crate::args::Conn;
use accrue_coordinator::shell::auth::Token;
use accrue_coordinator::wire::admin_client::AdminClient;

/// How long to wait for the TCP/HTTP2 connection before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// An Admin client whose every call carries the bearer token, if any.
pub type AdminConn = AdminClient<InterceptedService<Channel, BearerAuth>>;

/// Adds `authorization: Bearer <token>` to every request when a token is set.
#[derive(Debug, Clone, Default)]
pub struct BearerAuth {
    header: Option<MetadataValue<Ascii>>,
}

impl BearerAuth {
    /// An interceptor for `token`; `None` or an empty token sends nothing.
    /// Fails if the token cannot travel in an HTTP header.
    pub fn new(token: Option<&str>) -> anyhow::Result<Self> {
        let header = match token.map(str::trim).filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => Some(
                MetadataValue::try_from(format!("Bearer {t}"))
                    .map_err(|_| anyhow::anyhow!("invalid --token: it must be visible ASCII"))?,
            ),
        };
        Ok(Self { header })
    }
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            request.metadata_mut().insert("authorization", h.clone());
        }
        Ok(request)
    }
}

/// Accepts `host:port` as well as a full URL: `http://` is assumed.
pub fn normalize_url(url: &str) -> String {
    let url = url.trim();
    if url.contains("://") {
        url.to_string()
    } else {
        format!("http://{url}")
    }
}

/// Connects to the coordinator `conn` names (eagerly, so an unreachable
/// coordinator is reported before anything else happens), with its token,
/// TLS settings and message size limit.
pub async fn connect(conn: &Conn) -> anyhow::Result<AdminConn> {
    let (channel, auth) = channel(conn).await?;
    let max = conn.max_message_mb << 20;
    Ok(AdminClient::with_interceptor(channel, auth)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max))
}

/// The channel and bearer-token interceptor for any of the coordinator's
/// admin-token services (Admin, Rollouts).
pub async fn channel(conn: &Conn) -> anyhow::Result<(Channel, BearerAuth)> {
    let token = conn.resolved_token()?;
    let auth = BearerAuth::new(token.as_ref().map(Token::expose))?;
    let tls = accrue_coordinator::shell::tls::client_config(&conn.tls())?;
    let url = accrue_coordinator::shell::tls::url_for(&conn.coordinator, tls.is_some());
    let mut endpoint = Endpoint::from_shared(url.clone())
        .with_context(|| format!("invalid coordinator address {url:?}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls)
            .with_context(|| format!("tls settings for {url}"))?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach coordinator at {url}: {} — is accrue-coordinator running?",
            error_chain(&e)
        )
    })?;
    Ok((channel, auth))
}

/// Refuses a request over this client's message limit before it is sent:
/// tonic fails such a request with an h2 "internal" protocol error that
/// names neither the limit nor the request. `what` names the request.
pub fn check_request_size(conn: &Conn, what: &str, bytes: usize) -> anyhow::Result<()> {
    let limit = conn.max_message_mb << 20;
    if bytes > limit {
        anyhow::bail!(
            "{what} is {bytes} bytes, more than the gRPC message limit of {} MiB ({limit} bytes; \
             --max-message-mb, which the coordinator has too)",
            conn.max_message_mb
        );
    }
    Ok(())
}

/// `e: cause: cause`, skipping links that repeat their predecessor.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let s = err.to_string();
        if parts.last() != Some(&s) {
            parts.push(s);
        }
        cur = err.source();
    }
    parts.join(": ")
}

/// A failed RPC as a user-facing error, with a hint for the codes a user can
/// act on (unreachable coordinator, missing token, version skew).
pub fn rpc_error(status: &Status, coordinator: &str) -> anyhow::Error {
    let url = normalize_url(coordinator);
    let msg = status.message();
    let text = match status.code() {
        Code::Unavailable => {
            format!("cannot reach coordinator at {url}: {msg} — is accrue-coordinator running?")
        }
        Code::Unauthenticated | Code::PermissionDenied => format!(
            "the coordinator at {url} refused the request: {msg} (pass --token or --token-file, or set ACCRUE_ADMIN_TOKEN)"
        ),
        Code::Unimplemented => format!(
            "the coordinator at {url} does not implement this call: {msg} (is it an older version?)"
        ),
        Code::DeadlineExceeded => format!("the coordinator at {url} did not answer in time: {msg}"),
        // tonic's length checks (the coordinator's on a request, ours on a
        // reply): say which limit and how to raise it.
        Code::OutOfRange => format!(
            "a gRPC message over the size limit: {msg} (--max-message-mb, on the coordinator \
             and on accrue: {} MiB by default)",
            accrue_coordinator::shell::auth::DEFAULT_MAX_MESSAGE_MB
        ),
        code => format!("{msg} ({})", code_name(code)),
    };
    anyhow::anyhow!(text)
}

/// The gRPC code as short lowercase words, e.g. `not found`.
fn code_name(code: Code) -> String {
    // Debug gives the variant name (`FailedPrecondition`): split the words.
    let mut out = String::new();
    for (i, ch) in format!("{code:?}").chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push(' ');
        }
        out.push(ch.to_ascii_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::DEFAULT_COORDINATOR;
    use tonic::service::Interceptor as _;

    #[test]
    fn bearer_auth_sets_the_header_only_with_a_token() {
        let mut auth = BearerAuth::new(Some("s3cret")).unwrap();
        let req = auth.call(Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
        for none in [None, Some(""), Some("  ")] {
            let mut auth = BearerAuth::new(none).unwrap();
            let req = auth.call(Request::new(())).unwrap();
            assert!(req.metadata().get("authorization").is_none(), "{none:?}");
        }
    }

    #[test]
    fn bearer_auth_rejects_a_token_that_cannot_be_a_header() {
        let err = BearerAuth::new(Some("bad\ntoken")).unwrap_err();
        assert!(err.to_string().contains("--token"), "{err}");
    }

    #[test]
    fn bare_host_port_gets_http() {
        assert_eq!(normalize_url("10.0.0.1:7070"), "http://10.0.0.1:7070");
        assert_eq!(
            normalize_url("https://c.example:443"),
            "https://c.example:443"
        );
    }

    #[test]
    fn rpc_errors_carry_hints() {
        let e = rpc_error(&Status::unavailable("connection refused"), "127.0.0.1:1");
        assert_eq!(
            e.to_string(),
            "cannot reach coordinator at http://127.0.0.1:1: connection refused — is accrue-coordinator running?"
        );
        let e = rpc_error(&Status::unauthenticated("bad token"), DEFAULT_COORDINATOR);
        assert!(e.to_string().contains("ACCRUE_ADMIN_TOKEN"), "{e}");
        let e = rpc_error(&Status::not_found("no job abc"), DEFAULT_COORDINATOR);
        assert_eq!(e.to_string(), "no job abc (not found)");
        let e = rpc_error(
            &Status::failed_precondition("job is done"),
            DEFAULT_COORDINATOR,
        );
        assert_eq!(e.to_string(), "job is done (failed precondition)");
        let e = rpc_error(
            &Status::out_of_range(
                "Error, decoded message length too large: found 9 bytes, the limit is: 4 bytes",
            ),
            DEFAULT_COORDINATOR,
        );
        assert!(
            e.to_string()
                .starts_with("a gRPC message over the size limit: Error, decoded")
                && e.to_string().contains("--max-message-mb"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn unreachable_coordinator_is_named_in_the_error() {
        // Bind then drop a listener so the port is (almost surely) closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let err = connect(&Conn::new(&url)).await.unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.starts_with(&format!("cannot reach coordinator at {url}: ")),
            "{msg}"
        );
        assert!(msg.ends_with("is accrue-coordinator running?"), "{msg}");
    }
}
