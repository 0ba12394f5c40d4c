//! How the worker reaches the coordinator safely: the worker bearer token
//! (`$ACCRUE_WORKER_TOKEN` or `--token-file`), optional TLS (`--tls-ca`,
//! `--tls-domain`, and `--tls-cert`/`--tls-key` for mutual TLS) and the
//! message size limit. The coordinator's side is `accrue_coordinator::shell::auth`
//! and `::tls`; this crate cannot depend on it, so the few lines of file
//! handling are repeated here.

use std::path::{Path, PathBuf};
use std::time::Duration;

use accrue_proto::v1::worker_service_client::WorkerServiceClient;
use anyhow::Context as _;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

/// Default limit on one gRPC message, each way, in MiB.
pub const DEFAULT_MAX_MESSAGE_MB: usize = 64;

/// TLS files of a worker.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM CA bundle that signed the coordinator's certificate.
    pub ca: PathBuf,
    /// Name the coordinator's certificate must carry (default: URL host).
    pub domain: Option<String>,
    /// Client certificate and key, for a coordinator requiring mutual TLS.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// Token, TLS and limits for the worker's connection.
#[derive(Clone)]
pub struct Security {
    /// The worker token, sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    pub tls: Option<TlsFiles>,
    pub max_message_bytes: usize,
}

impl Default for Security {
    fn default() -> Self {
        Self {
            token: None,
            tls: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_MB << 20,
        }
    }
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .field("max_message_bytes", &self.max_message_bytes)
            .finish()
    }
}

/// The token from `file` (trailing whitespace trimmed; unreadable or empty
/// is an error naming it), else from `env_value`.
pub fn resolve_token(
    env_value: Option<&str>,
    file: Option<&Path>,
) -> anyhow::Result<Option<String>> {
    let (value, what) = match file {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read token file {}", f.display()))?;
            let v = text.trim_end().to_string();
            anyhow::ensure!(!v.is_empty(), "token file {} is empty", f.display());
            (v, format!("token file {}", f.display()))
        }
        None => match env_value.map(str::trim).filter(|v| !v.is_empty()) {
            Some(v) => (v.to_string(), "ACCRUE_WORKER_TOKEN".to_string()),
            None => return Ok(None),
        },
    };
    anyhow::ensure!(
        value.bytes().all(|b| b.is_ascii_graphic()),
        "{what}: a token must be visible ASCII without spaces"
    );
    Ok(Some(value))
}

/// Adds the bearer token to every call.
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.0 {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// The worker's client type.
pub type Client = WorkerServiceClient<InterceptedService<Channel, Bearer>>;

fn read_pem(what: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))?;
    anyhow::ensure!(
        String::from_utf8_lossy(&bytes).contains("-----BEGIN "),
        "{what} {}: no PEM block found",
        path.display()
    );
    Ok(bytes)
}

/// The tonic TLS config of `files`.
pub fn tls_config(files: &TlsFiles) -> anyhow::Result<ClientTlsConfig> {
    let mut cfg = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read_pem("tls CA", &files.ca)?));
    if let Some(d) = &files.domain {
        cfg = cfg.domain_name(d.clone());
    }
    if let Some((cert, key)) = &files.identity {
        cfg = cfg.identity(Identity::from_pem(
            read_pem("tls certificate", cert)?,
            read_pem("tls key", key)?,
        ));
    }
    Ok(cfg)
}

/// `url` with the scheme the settings need (`https` with TLS).
pub fn url_for(url: &str, tls: bool) -> String {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    match (rest, tls) {
        (Some(r), true) => format!("https://{r}"),
        (None, true) => format!("https://{url}"),
        (Some(_), false) => url.to_string(),
        (None, false) => format!("http://{url}"),
    }
}

/// The coordinator's address with the session's transport settings. Nagle
/// stays off (tonic's default, set here so it cannot drift): a plan or
/// result would otherwise wait for the peer's delayed ACK.
fn endpoint(url: &str) -> anyhow::Result<Endpoint> {
    Ok(Endpoint::from_shared(url.to_string())
        .with_context(|| format!("bad coordinator url {url}"))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_while_idle(true))
}

/// Connects to the coordinator at `url` with `sec`.
pub async fn connect(url: &str, sec: &Security) -> anyhow::Result<Client> {
    let url = url_for(url.trim(), sec.tls.is_some());
    let mut endpoint = endpoint(&url)?;
    if let Some(files) = &sec.tls {
        endpoint = endpoint
            .tls_config(tls_config(files)?)
            .with_context(|| format!("tls settings for {url}"))?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let header = match &sec.token {
        None => None,
        Some(t) => Some(
            MetadataValue::try_from(format!("Bearer {t}"))
                .map_err(|_| anyhow::anyhow!("the worker token must be visible ASCII"))?,
        ),
    };
    Ok(
        WorkerServiceClient::with_interceptor(channel, Bearer(header))
            .max_decoding_message_size(sec.max_message_bytes)
            .max_encoding_message_size(sec.max_message_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_connection_has_nagle_off() {
        assert!(endpoint("http://127.0.0.1:1").unwrap().get_tcp_nodelay());
    }

    #[test]
    fn token_file_wins_and_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t");
        std::fs::write(&f, "abc\n").unwrap();
        assert_eq!(
            resolve_token(Some("env"), Some(&f)).unwrap().as_deref(),
            Some("abc")
        );
        assert_eq!(
            resolve_token(Some("env"), None).unwrap().as_deref(),
            Some("env")
        );
        assert_eq!(resolve_token(None, None).unwrap(), None);
        std::fs::write(&f, "").unwrap();
        let e = resolve_token(None, Some(&f)).unwrap_err().to_string();
        assert_eq!(e, format!("token file {} is empty", f.display()));
        assert!(format!(
            "{:?}",
            Security {
                token: Some("s3cret".into()),
                ..Default::default()
            }
        )
        .contains("redacted"));
    }

    #[test]
    fn tls_forces_https() {
        assert_eq!(url_for("h:1", true), "https://h:1");
        assert_eq!(url_for("http://h:1", true), "https://h:1");
        assert_eq!(url_for("h:1", false), "http://h:1");
    }
}
