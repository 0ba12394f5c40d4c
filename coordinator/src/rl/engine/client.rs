//! The external engine's HTTP calls (`rl.engine`), off the state lock:
//! a round's prompts as concurrent `/v1/completions` requests (at most
//! `max_concurrency` in flight), and the reloads of published policies.
//! A request that finds the engine unreachable, times out, or gets a 5xx
//! or 429 is retried with exponential backoff; after `retries` more
//! attempts the round fails naming the URL and the last status. A request
//! re-sent after a lost answer asks for the same samples (same seed), and
//! only the one answer that arrives counts: the round is answered once.
//! An answer is read up to a limit ([`answer_limit`]): a larger one fails
//! the round at once, naming the limit (an engine that answers too much
//! once will again).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tracing::warn;

use crate::job::engine::EngineSection;
use crate::rl::engine::wire::{
    answer_limit, completion_request, parse_completions, prompts_of, reload_refused,
    reload_requests, ANSWER_FLOOR_BYTES,
};
use crate::rl::generation::GenCompletion;
use crate::rl::rounds::EngineRound;

/// Why an engine call failed (after its retries).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{url}: {message} (after {attempts} attempts)")]
    Unreachable {
        url: String,
        message: String,
        attempts: u32,
    },
    #[error("{url} answered HTTP {status}: {body} (after {attempts} attempts)")]
    Status {
        url: String,
        status: u16,
        body: String,
        attempts: u32,
    },
    #[error("{url}: prompt {prompt}: {error}")]
    Malformed {
        url: String,
        prompt: crate::stream::doc::DocId,
        error: crate::rl::engine::wire::Malformed,
    },
    #[error("{url} refused to load {dir}: {message}")]
    Refused {
        url: String,
        dir: String,
        message: String,
    },
    #[error("{url}: the answer is over its limit of {limit} bytes")]
    TooLarge { url: String, limit: usize },
    #[error("rl.engine.api_key_env: environment variable {0} is not set")]
    NoKey(String),
    #[error("rl.engine.timeout_s: {0}")]
    Timeout(std::time::TryFromFloatSecsError),
}

/// Why one attempt got no answer to hand back.
enum Failed {
    /// Unreachable, or the answer broke off: worth another attempt.
    Transport(String),
    /// The answer went past the limit: not worth another.
    TooLarge,
}

/// A pooled HTTP/1 client shared by every job's engine calls.
#[derive(Clone)]
pub(crate) struct EngineClient {
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Default for EngineClient {
    fn default() -> Self {
        EngineClient {
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

/// The first backoff; it doubles per attempt.
const BACKOFF: Duration = Duration::from_millis(200);

impl EngineClient {
    /// [`Self::post_limited`] for an answer of any kind (at most
    /// [`ANSWER_FLOOR_BYTES`]).
    async fn post(
        &self,
        engine: &EngineSection,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Bytes, EngineError> {
        self.post_limited(engine, path, body, ANSWER_FLOOR_BYTES)
            .await
    }

    /// POSTs `body` to `engine`'s `path`, retrying what may pass; the
    /// answer's body on a 2xx, at most `limit` bytes of it.
    async fn post_limited(
        &self,
        engine: &EngineSection,
        path: &str,
        body: &serde_json::Value,
        limit: usize,
    ) -> Result<Bytes, EngineError> {
        let url = format!("{}{path}", engine.base());
        let key = match &engine.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| EngineError::NoKey(var.clone()))?),
            None => None,
        };
        let bytes = Bytes::from(serde_json::to_vec(body).expect("JSON values serialize"));
        // Bounded at submit; a stored spec from before must not panic.
        let timeout =
            Duration::try_from_secs_f64(engine.timeout_s).map_err(EngineError::Timeout)?;
        let attempts = engine.retries + 1;
        let mut last = None;
        for attempt in 1..=attempts {
            if attempt > 1 {
                tokio::time::sleep(BACKOFF * 2u32.saturating_pow(attempt - 2).min(64)).await;
            }
            let mut req = hyper::Request::post(&url).header("content-type", "application/json");
            if let Some(k) = &key {
                req = req.header("authorization", format!("Bearer {k}"));
            }
            let req = req
                .body(Full::new(bytes.clone()))
                .map_err(|e| EngineError::Unreachable {
                    url: url.clone(),
                    message: format!("not a valid request URL: {e}"),
                    attempts: attempt,
                })?;
            let sent = tokio::time::timeout(timeout, async {
                let resp = self
                    .http
                    .request(req)
                    .await
                    .map_err(|e| Failed::Transport(chain(&e)))?;
                let status = resp.status().as_u16();
                let body = http_body_util::Limited::new(resp.into_body(), limit)
                    .collect()
                    .await
                    .map_err(|e| match e.downcast::<http_body_util::LengthLimitError>() {
                        Ok(_) => Failed::TooLarge,
                        Err(e) => Failed::Transport(format!("reading the answer: {e}")),
                    })?;
                Ok::<_, Failed>((status, body.to_bytes()))
            })
            .await;
            let error = match sent {
                Ok(Ok((status, body))) if (200..300).contains(&status) => return Ok(body),
                Ok(Ok((status, body))) => {
                    let e = EngineError::Status {
                        url: url.clone(),
                        status,
                        body: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned(),
                        attempts: attempt,
                    };
                    // A client error will not pass by asking again.
                    if status < 500 && status != 429 {
                        return Err(e);
                    }
                    e
                }
                Ok(Err(Failed::TooLarge)) => {
                    return Err(EngineError::TooLarge {
                        url: url.clone(),
                        limit,
                    })
                }
                Ok(Err(Failed::Transport(message))) => EngineError::Unreachable {
                    url: url.clone(),
                    message,
                    attempts: attempt,
                },
                Err(_) => EngineError::Unreachable {
                    url: url.clone(),
                    message: format!("no answer in {} s (rl.engine.timeout_s)", engine.timeout_s),
                    attempts: attempt,
                },
            };
            warn!(%url, attempt, error = %error, "engine request failed");
            last = Some(error);
        }
        Err(last.expect("at least one attempt"))
    }

    /// Every completion of round `r`: one request per prompt, at most
    /// `max_concurrency` at once; the first failure fails the round.
    pub async fn generate(
        &self,
        r: &EngineRound,
        vocab: u32,
    ) -> Result<Vec<GenCompletion>, EngineError> {
        let path = "/v1/completions";
        let url = format!("{}{path}", r.engine.base());
        // Owned per call: the futures must not borrow across the stream.
        let calls: Vec<_> = prompts_of(r)
            .map(|q| {
                let (client, engine, url) = (self.clone(), r.engine.clone(), url.clone());
                let (prompt, body, group) = (q.prompt, completion_request(r, q), r.group);
                let limit = answer_limit(group, r.plan.sampling.max_new_tokens);
                async move {
                    let answer = client.post_limited(&engine, path, &body, limit).await?;
                    parse_completions(&answer, prompt, group, vocab)
                        .map_err(|error| EngineError::Malformed { url, prompt, error })
                }
            })
            .collect();
        let groups: Vec<Vec<GenCompletion>> = futures::stream::iter(calls)
            .buffer_unordered(r.engine.max_concurrency.max(1) as usize)
            .try_collect()
            .await?;
        Ok(groups.into_iter().flatten().collect())
    }

    /// Tells the engine to load the policy in `dir`.
    pub async fn reload(
        &self,
        engine: &EngineSection,
        dir: &std::path::Path,
        adapter: bool,
    ) -> Result<(), EngineError> {
        for (path, body) in reload_requests(engine, dir, adapter) {
            let answer = self.post(engine, path, &body).await?;
            if let Some(message) = reload_refused(&answer) {
                return Err(EngineError::Refused {
                    url: format!("{}{path}", engine.base()),
                    dir: dir.display().to_string(),
                    message,
                });
            }
        }
        Ok(())
    }
}

/// An error and its sources, `: `-joined ("client error (SendRequest):
/// connection closed before message completed").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The files a policy directory must hold before an engine loads it (the
/// tokenizer's are written by the coordinator beside the workers'
/// weights, on another thread).
const POLICY_FILES: [&str; 2] = ["config.json", "tokenizer.json"];

/// Waits (up to `limit`) until `dir` holds the files an engine loads.
pub(crate) async fn wait_for_files(dir: &std::path::Path, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let missing: Vec<&str> = POLICY_FILES
            .into_iter()
            .filter(|f| !dir.join(f).exists())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{} lacks {} after {} s",
                dir.display(),
                missing.join(", "),
                limit.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;

    use super::*;

    /// A server answering every POST with `status` (and counting them),
    /// 200 only with the right bearer token when `status` is 200.
    async fn serve(status: u16) -> (String, Arc<AtomicU32>) {
        let hits = Arc::new(AtomicU32::new(0));
        let h = hits.clone();
        let app = axum::Router::new().route(
            "/x",
            post(move |headers: HeaderMap| {
                let h = h.clone();
                async move {
                    h.fetch_add(1, Ordering::SeqCst);
                    let auth = headers
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_string());
                    match status {
                        200 if auth.as_deref() != Some("Bearer sekrit") => {
                            (StatusCode::UNAUTHORIZED, "who?")
                        }
                        s => (StatusCode::from_u16(s).unwrap(), "{\"ok\": true}"),
                    }
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        (url, hits)
    }

    fn engine(url: &str, key: Option<&str>) -> EngineSection {
        EngineSection {
            url: url.into(),
            model: "m".into(),
            api: crate::job::engine::EngineApi::Completions,
            reload: crate::job::engine::EngineReload::None,
            timeout_s: 10.0,
            max_concurrency: 1,
            retries: 1,
            api_key_env: key.map(Into::into),
        }
    }

    #[tokio::test]
    async fn server_errors_are_retried_then_named_with_the_url_and_status() {
        let (url, hits) = serve(503).await;
        let c = EngineClient::default();
        let e = c
            .post(&engine(&url, None), "/x", &serde_json::json!({}))
            .await
            .unwrap_err();
        assert_eq!(hits.load(Ordering::SeqCst), 2, "one retry");
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("{url}/x answered HTTP 503")),
            "{text}"
        );
        assert!(text.ends_with("(after 2 attempts)"), "{text}");
    }

    #[tokio::test]
    async fn client_errors_are_not_retried_and_the_bearer_token_comes_from_the_env() {
        let (url, hits) = serve(200).await;
        let c = EngineClient::default();
        let e = c
            .post(&engine(&url, None), "/x", &serde_json::json!({}))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("answered HTTP 401"), "{e}");
        assert_eq!(hits.load(Ordering::SeqCst), 1, "a 4xx is not asked again");
        let var = "TEST_ENGINE_KEY_7f3a";
        let missing = c
            .post(&engine(&url, Some(var)), "/x", &serde_json::json!({}))
            .await;
        assert!(missing.unwrap_err().to_string().contains(var));
        std::env::set_var(var, "sekrit");
        let body = c
            .post(&engine(&url, Some(var)), "/x", &serde_json::json!({}))
            .await
            .unwrap();
        assert_eq!(&body[..], b"{\"ok\": true}");
    }

    #[tokio::test]
    async fn an_answer_over_the_body_limit_is_refused_naming_it() {
        // 70 MiB: over the floor every request may answer with.
        let big = bytes::Bytes::from(vec![b' '; 70 << 20]);
        let app = axum::Router::new().route("/big", post(move || async move { big.clone() }));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        let c = EngineClient::default();
        let answer = c
            .post(&engine(&url, None), "/big", &serde_json::json!({}))
            .await;
        // Not unwrap_err: it would print the 70 MiB.
        let Err(e) = answer else {
            panic!("a 70 MiB answer was accepted")
        };
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "{url}/big: the answer is over its limit of 67108864 bytes"
            )),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_engine_is_named() {
        // A port nobody listens on any more.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let c = EngineClient::default();
        let e = c
            .post(&engine(&url, None), "/x", &serde_json::json!({}))
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, EngineError::Unreachable { .. }), "{text}");
        assert!(
            text.starts_with(&format!("{url}/x: ")) && text.ends_with("(after 2 attempts)"),
            "{text}"
        );
    }
}
