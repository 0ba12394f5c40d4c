//! Optional TLS (rustls, ring provider, through tonic's `tls-ring`) for the
//! coordinator and its clients: PEM files in, tonic configs out. Every
//! error names the file that was wrong; PEM contents are checked here
//! because rustls's own errors, raised later at handshake or bind time, do
//! not say which file they came from.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Problems with TLS files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {}: no PEM `{label}` block found", path.display())]
    NoPem {
        what: &'static str,
        path: PathBuf,
        label: &'static str,
    },
    #[error("{0} is given without {1}; give both")]
    Half(&'static str, &'static str),
}

/// The coordinator's TLS files (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// PEM certificate chain served to clients.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM CA bundle; when set, clients must present a certificate it
    /// signed (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// A client's TLS files (`--tls-ca`, `--tls-domain`, and for mutual TLS
/// `--tls-cert`/`--tls-key`).
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM CA bundle that signed the coordinator's certificate.
    pub ca: Option<PathBuf>,
    /// Name to verify the coordinator's certificate against (default: the
    /// URL's host).
    pub domain: Option<String>,
    /// Client certificate for mutual TLS.
    pub cert: Option<PathBuf>,
    /// Key of `cert`.
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// Whether any TLS setting was given (then the client speaks https).
    pub fn enabled(&self) -> bool {
        self.ca.is_some() || self.domain.is_some() || self.cert.is_some() || self.key.is_some()
    }
}

/// Reads a PEM file and checks it holds at least one block whose label ends
/// with `label` (`CERTIFICATE`, `PRIVATE KEY`).
fn read_pem(what: &'static str, path: &Path, label: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text.lines().any(|l| {
        l.trim()
            .strip_prefix("-----BEGIN ")
            .and_then(|r| r.strip_suffix("-----"))
            .is_some_and(|l| l.ends_with(label))
    });
    if !found {
        return Err(TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            label,
        });
    }
    Ok(bytes)
}

fn identity(cert: &Path, key: &Path) -> Result<Identity, TlsError> {
    let c = read_pem("tls certificate", cert, "CERTIFICATE")?;
    let k = read_pem("tls key", key, "PRIVATE KEY")?;
    Ok(Identity::from_pem(c, k))
}

/// The server's tonic TLS config.
pub fn server_config(tls: &ServerTls) -> Result<ServerTlsConfig, TlsError> {
    let mut cfg = ServerTlsConfig::new().identity(identity(&tls.cert, &tls.key)?);
    if let Some(ca) = &tls.client_ca {
        let pem = read_pem("tls client CA", ca, "CERTIFICATE")?;
        cfg = cfg.client_ca_root(Certificate::from_pem(pem));
    }
    Ok(cfg)
}

/// A client's tonic TLS config (None when no TLS setting was given).
pub fn client_config(tls: &ClientTls) -> Result<Option<ClientTlsConfig>, TlsError> {
    if !tls.enabled() {
        return Ok(None);
    }
    let mut cfg = ClientTlsConfig::new();
    match &tls.ca {
        Some(ca) => {
            let pem = read_pem("tls CA", ca, "CERTIFICATE")?;
            cfg = cfg.ca_certificate(Certificate::from_pem(pem));
        }
        // No CA given: trust nothing rather than guess; rustls would fail
        // every handshake, so say so now.
        None => return Err(TlsError::Half("a client tls setting", "--tls-ca")),
    }
    if let Some(d) = &tls.domain {
        cfg = cfg.domain_name(d.clone());
    }
    match (&tls.cert, &tls.key) {
        (Some(c), Some(k)) => cfg = cfg.identity(identity(c, k)?),
        (None, None) => {}
        (Some(_), None) => return Err(TlsError::Half("--tls-cert", "--tls-key")),
        (None, Some(_)) => return Err(TlsError::Half("--tls-key", "--tls-cert")),
    }
    Ok(Some(cfg))
}

/// `url` with the scheme TLS needs: `host:port` and `http://` become
/// `https://` when `tls` is on; otherwise a bare `host:port` gets `http://`.
pub fn url_for(url: &str, tls: bool) -> String {
    let url = url.trim();
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    match (rest, tls) {
        (Some(r), true) => format!("https://{r}"),
        (None, true) => format!("https://{url}"),
        (Some(_), false) => url.to_string(),
        (None, false) if url.contains("://") => url.to_string(),
        (None, false) => format!("http://{url}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem").unwrap();
        let e = server_config(&ServerTls {
            cert: missing.clone(),
            key: junk.clone(),
            client_ca: None,
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(&format!(
                "cannot read tls certificate {}",
                missing.display()
            )),
            "{e}"
        );
        let e = client_config(&ClientTls {
            ca: Some(junk.clone()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            format!(
                "tls CA {}: no PEM `CERTIFICATE` block found",
                junk.display()
            )
        );
        let e = client_config(&ClientTls {
            domain: Some("x".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("--tls-ca"), "{e}");
        assert!(client_config(&ClientTls::default()).unwrap().is_none());
    }

    #[test]
    fn tls_urls_use_https() {
        assert_eq!(url_for("127.0.0.1:1", true), "https://127.0.0.1:1");
        assert_eq!(url_for("http://h:1", true), "https://h:1");
        assert_eq!(url_for("https://h:1", false), "https://h:1");
        assert_eq!(url_for("h:1", false), "http://h:1");
    }
}
