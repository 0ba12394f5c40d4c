//! The coordinator's HTTP side (axum on `--metrics-listen`): Prometheus
//! `GET /metrics`, the status page `GET /`, and the read-only JSON API the
//! page polls (`GET /api/status`, `GET /api/jobs/{id}/metrics?since=N`).
//!
//! Everything here is read-only. `/metrics` and the page itself need no
//! token, as Prometheus scrapes expect (its labels are job ids, sources and
//! enum values: no hosts, ranks or free text). The JSON API shows two
//! levels of [`Detail`] (issue 33): with the admin token as `authorization:
//! Bearer <token>` (or on a coordinator without one: loopback development)
//! everything — job reasons (file paths redacted, [`redact_paths`]),
//! generations, the workers with their hosts and ranks, reward components;
//! without it only what an operator outside the cluster may see: jobs,
//! their states, progress and losses, and how many workers there are. A
//! wrong token is refused (401), never answered as if none were sent. Bind
//! it to a private address (the default is 127.0.0.1:9090) or a
//! cluster-internal Service (the server warns at startup when it is bound
//! elsewhere, [`exposure_warning`]). Views are built by pure functions from the state
//! machine; the lock is held only to copy what a reply needs, never across
//! an `.await` and never while the store is read: step history is read
//! after, metrics only (never a step's documents or layout), at most
//! [`MAX_STEPS_PER_REPLY`] / [`MAX_STEPS_PER_STATUS`] steps a request and
//! [`MAX_READERS`] requests at a time (issue 33: one GET decoded a long
//! job's whole history under the global lock).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::core::{Coordinator, JobId, StepMetrics};
use crate::shell::auth::Token;
use crate::shell::service::{now_ms, Shared};
use crate::shell::store::Store;

/// The status page: one self-contained file (no CDN, no external fonts:
/// clusters may be offline).
const STATUS_PAGE: &str = include_str!("status_page.html");

/// Most steps one `/api/jobs/{id}/metrics` reply holds; `more` says when a
/// client should ask again from the last step it got.
pub const MAX_STEPS_PER_REPLY: usize = 2_000;

/// Most steps one `/api/status` adds to a job's cached totals; a longer
/// history is caught up over the next polls.
pub const MAX_STEPS_PER_STATUS: usize = 20_000;

/// Requests reading step history at once; more wait their turn.
pub const MAX_READERS: usize = 4;

/// How much a reply of the JSON API shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Detail {
    /// Everything (the admin token was sent, or the coordinator has none).
    Full,
    /// What an operator outside the cluster may see: no reasons,
    /// generations, hosts, ranks or reward components.
    Public,
}

/// Metric keys of a step the public view leaves out: reward components
/// are named by the verifier's output.
const PRIVATE_EXTRA_PREFIX: &str = "rl/reward/";

/// One job as the status API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub id: String,
    pub name: String,
    /// The objective: `sft`, `dpo` or `pg`.
    pub kind: String,
    /// `pending`, `running`, `paused`, `completed`, `failed` or `cancelled`.
    pub state: String,
    /// Why the job is pending, paused or failed (empty otherwise), file
    /// paths shown as `<path>`; absent from the public view (reasons name
    /// workers, ranks and what verifiers said).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Last committed step.
    pub step: u64,
    /// Total steps when known, else 0.
    pub total_steps: u64,
    /// The current generation; absent from the public view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Workers in the current generation (0 when none is formed).
    pub world_size: u32,
    /// Documents trained on in committed steps.
    pub docs_seen: u64,
    /// Real (non-padding) tokens trained on in committed steps.
    pub tokens_seen: u64,
    /// Loss of the last committed step.
    pub last_loss: Option<f64>,
}

/// One worker as the status API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerView {
    pub id: String,
    pub hostname: String,
    pub device: String,
    /// `registered`, `idle`, `configuring`, `active`, `draining` or `lost`.
    pub state: String,
    pub job: Option<String>,
    pub rank: Option<u32>,
    /// A generator of its job's disaggregated generation (`rank` among
    /// the generators).
    pub generator: bool,
    /// Seconds since the worker was last heard from.
    pub heartbeat_age_s: f64,
}

/// The reply of `GET /api/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusView {
    pub unix_ms: i64,
    pub detail: Detail,
    pub jobs: Vec<JobView>,
    /// Each worker (empty in the public view).
    pub workers: Vec<WorkerView>,
    /// How many workers are registered (either view).
    pub worker_count: usize,
}

/// The reply of `GET /api/jobs/{id}/metrics`: committed steps after `since`,
/// oldest first, each as a line of the job's metrics.jsonl.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsView {
    pub job: String,
    pub detail: Detail,
    /// In the public view without `generation` and reward components.
    pub steps: Vec<serde_json::Value>,
    /// More steps follow the last one here (the reply was capped at
    /// [`MAX_STEPS_PER_REPLY`]).
    pub more: bool,
}

/// Documents and tokens of a job's committed steps, summed up to `through`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub through: u64,
    pub docs: u64,
    pub tokens: u64,
}

/// The router's state: the coordinator and a per-job cache of totals, so a
/// poll reads only the steps committed since the previous one.
#[derive(Clone)]
struct AppState {
    shared: Arc<Shared>,
    /// The admin token the full views need (None: everything is shown).
    admin: Option<Token>,
    totals: Arc<Mutex<HashMap<JobId, Totals>>>,
    readers: Arc<tokio::sync::Semaphore>,
}

/// The HTTP routes over `shared`; `admin` opens the full views.
pub fn router(shared: Arc<Shared>, admin: Option<Token>) -> Router {
    let state = AppState {
        shared,
        admin,
        totals: Arc::default(),
        readers: Arc::new(tokio::sync::Semaphore::new(MAX_READERS)),
    };
    Router::new()
        .route("/", get(status_page))
        .route("/metrics", get(metrics))
        .route("/api/status", get(status))
        .route("/api/jobs/{id}/metrics", get(job_metrics))
        .fallback(not_found)
        // One request per connection: scrapers and the page's 2 s poll need
        // no keep-alive, and a plain reader sees the reply end.
        .layer(axum::middleware::map_response(
            |mut r: Response| async move {
                r.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                r
            },
        ))
        .with_state(state)
}

/// Serves [`router`] on `listener` until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    admin: Option<Token>,
    shutdown: CancellationToken,
) {
    serve_app(listener, router(shared, admin), shutdown, "http server").await;
}

/// Serves `app` on `listener` until `shutdown` fires; `what` names it in
/// the log line of a failure.
pub async fn serve_app(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
    what: &str,
) {
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
    {
        warn!(%e, "{what} stopped");
    }
}

async fn status_page() -> Html<&'static str> {
    Html(STATUS_PAGE)
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.shared.render_metrics(),
    )
}

async fn not_found() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        "not found: try /, /metrics, /api/status or /api/jobs/JOB/metrics\n",
    )
}

/// The detail a request may see: full with the admin token (or when the
/// coordinator has none), public without one; a wrong token is an error.
pub fn detail_for(admin: Option<&Token>, headers: &HeaderMap) -> Result<Detail, ApiError> {
    let Some(admin) = admin else {
        return Ok(Detail::Full);
    };
    let Some(h) = headers.get(header::AUTHORIZATION) else {
        return Ok(Detail::Public);
    };
    if crate::shell::auth::bearer(h.as_bytes()).is_some_and(|t| admin.matches(t)) {
        return Ok(Detail::Full);
    }
    Err(ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "the token sent is not the admin token (ACCRUE_ADMIN_TOKEN): send none for the public view".into(),
    })
}

async fn status(
    State(s): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<StatusView>, ApiError> {
    let detail = detail_for(s.admin.as_ref(), &headers)?;
    // Under the lock: what is behind, and the store's handle.
    let (store, behind) = {
        let inner = s.shared.lock();
        let totals = s.totals.lock().unwrap_or_else(|p| p.into_inner());
        let behind: Vec<(JobId, Totals)> = inner
            .core
            .jobs()
            .map(|j| (j, totals.get(&j.rec.id).copied().unwrap_or_default()))
            .filter(|(j, t)| j.rec.step > t.through)
            .map(|(j, t)| (j.rec.id.clone(), t))
            .collect();
        (inner.store.clone(), behind)
    };
    if !behind.is_empty() {
        let _turn = s.readers.acquire().await.map_err(ApiError::internal)?;
        let added = tokio::task::spawn_blocking(move || {
            behind
                .into_iter()
                .map(|(id, t)| {
                    let mut t2 = t;
                    store.step_metrics(&id, t.through + 1, MAX_STEPS_PER_STATUS, |m| {
                        t2 = add_steps(t2, [&m]);
                    })?;
                    Ok((id, t, t2))
                })
                .collect::<crate::shell::store::Result<Vec<_>>>()
        })
        .await
        .map_err(ApiError::internal)?
        .map_err(ApiError::internal)?;
        let mut totals = s.totals.lock().unwrap_or_else(|p| p.into_inner());
        for (id, was, now) in added {
            // Another request may have caught up meanwhile: keep the
            // furthest.
            let t = totals.entry(id).or_default();
            if t.through == was.through || now.through > t.through {
                *t = now;
            }
        }
    }
    let inner = s.shared.lock();
    let totals = s.totals.lock().unwrap_or_else(|p| p.into_inner());
    Ok(Json(status_view(&inner.core, &totals, now_ms(), detail)))
}

/// Query of `GET /api/jobs/{id}/metrics`.
#[derive(Debug, Deserialize)]
struct Since {
    /// Steps after this one (0: from the first).
    #[serde(default)]
    since: u64,
}

async fn job_metrics(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<Since>,
    headers: HeaderMap,
) -> Result<Json<MetricsView>, ApiError> {
    let detail = detail_for(s.admin.as_ref(), &headers)?;
    let store = {
        let inner = s.shared.lock();
        if inner.core.job(&id).is_err() {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("job {id} not found"),
            });
        }
        inner.store.clone()
    };
    let _turn = s.readers.acquire().await.map_err(ApiError::internal)?;
    let view = tokio::task::spawn_blocking(move || metrics_view(&store, &id, q.since, detail))
        .await
        .map_err(ApiError::internal)??;
    Ok(Json(view))
}

/// Committed steps of `job` after `since`, at most [`MAX_STEPS_PER_REPLY`]
/// (their metrics only), as `detail` may see them.
fn metrics_view(
    store: &Store,
    job: &str,
    since: u64,
    detail: Detail,
) -> Result<MetricsView, ApiError> {
    let mut steps = Vec::new();
    store
        .step_metrics(job, since.saturating_add(1), MAX_STEPS_PER_REPLY + 1, |m| {
            steps.push(m)
        })
        .map_err(ApiError::internal)?;
    let more = steps.len() > MAX_STEPS_PER_REPLY;
    steps.truncate(MAX_STEPS_PER_REPLY);
    let steps = steps
        .into_iter()
        .map(|m| step_view(m, detail))
        .collect::<Result<_, _>>()
        .map_err(ApiError::internal)?;
    Ok(MetricsView {
        job: job.to_string(),
        detail,
        steps,
        more,
    })
}

/// One step's metrics as `detail` may see them.
pub fn step_view(mut m: StepMetrics, detail: Detail) -> serde_json::Result<serde_json::Value> {
    if detail == Detail::Public {
        m.extra.retain(|k, _| !k.starts_with(PRIVATE_EXTRA_PREFIX));
    }
    let mut v = serde_json::to_value(m)?;
    if let (Detail::Public, Some(o)) = (detail, v.as_object_mut()) {
        o.remove("generation");
    }
    Ok(v)
}

/// `t` plus the given committed steps (those after `t.through`; a replayed
/// step already counted is not counted again).
pub fn add_steps<'a>(mut t: Totals, steps: impl IntoIterator<Item = &'a StepMetrics>) -> Totals {
    for m in steps {
        if m.step > t.through {
            t.through = m.step;
            t.docs += m.docs;
            t.tokens += m.tokens;
        }
    }
    t
}

/// The status view of `core` at `now_ms`, with documents and tokens from
/// `totals` (0 for a job missing there).
pub fn status_view(
    core: &Coordinator,
    totals: &HashMap<JobId, Totals>,
    now_ms: i64,
    detail: Detail,
) -> StatusView {
    let full = detail == Detail::Full;
    let jobs = core
        .jobs()
        .map(|j| {
            let t = totals.get(&j.rec.id).copied().unwrap_or_default();
            JobView {
                id: j.rec.id.clone(),
                name: j.rec.name.clone(),
                kind: j.spec.objective.kind.to_string(),
                state: j.rec.state.name().to_string(),
                reason: full.then(|| redact_paths(&j.rec.reason)),
                step: j.rec.step,
                total_steps: j.rec.total_steps,
                generation: full.then_some(j.rec.generation),
                world_size: j.gen().map_or(0, |g| g.world_size()),
                docs_seen: t.docs,
                tokens_seen: t.tokens,
                last_loss: j.rec.last_loss,
            }
        })
        .collect();
    let worker_count = core.workers().count();
    let workers = core
        .workers()
        .filter(|_| full)
        .map(|w| (w, core.generator_rank(w)))
        .map(|(w, generator)| WorkerView {
            id: w.id.clone(),
            hostname: w.reg.hostname.clone(),
            device: if w.reg.gpu_name.is_empty() {
                w.reg.device.clone()
            } else {
                format!("{} ({})", w.reg.device, w.reg.gpu_name)
            },
            state: w.state.name().to_string(),
            job: w.job.clone(),
            rank: w.rank.or(generator),
            generator: generator.is_some(),
            heartbeat_age_s: (now_ms - w.last_seen_ms()).max(0) as f64 / 1000.0,
        })
        .collect();
    StatusView {
        unix_ms: now_ms,
        detail,
        jobs,
        workers,
        worker_count,
    }
}

/// What stands for a redacted path.
pub const REDACTED_PATH: &str = "<path>";

/// `text` with every absolute (or `~/`) file path replaced by `<path>`:
/// reasons name the files at fault (`/data/x.jsonl:3: invalid json`), and
/// an unauthenticated page must not show where a job's data and outputs
/// live. A path starts at `/` or `~/` at the start of a word and runs to
/// whitespace, a quote, a bracket, `,`, `;` or `:` (so `:LINE` stays).
pub fn redact_paths(text: &str) -> String {
    let stops = |c: char| c.is_whitespace() || "\"'`()[]{}<>,;:".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.char_indices().peekable();
    let mut prev: Option<char> = None;
    while let Some((i, c)) = chars.next() {
        let at_word = prev.is_none_or(|p| stops(p) || p == '=');
        let starts = c == '/' || (c == '~' && text[i + 1..].starts_with('/'));
        if at_word && starts {
            out.push_str(REDACTED_PATH);
            let mut last = c;
            while let Some(&(_, n)) = chars.peek() {
                if stops(n) {
                    break;
                }
                last = n;
                chars.next();
            }
            prev = Some(last);
            continue;
        }
        out.push(c);
        prev = Some(c);
    }
    out
}

/// The warning to log when the unauthenticated HTTP side is bound to
/// `addr` off loopback, where others may reach it.
pub fn exposure_warning(addr: std::net::SocketAddr) -> Option<String> {
    (!addr.ip().is_loopback()).then(|| {
        format!(
            "the status page and /metrics on {addr} are not on loopback: whoever can reach \
             {addr} sees job names, states, progress and losses without a token (with no \
             admin token configured, also reasons, hosts and ranks); keep --metrics-listen \
             on 127.0.0.1 or a cluster-internal address"
        )
    })
}

/// A JSON error reply: `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn internal(e: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("reading the store: {e}"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message });
        (self.status, Json(body)).into_response()
    }
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod http_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, docs: u64, tokens: u64) -> StepMetrics {
        StepMetrics {
            step,
            docs,
            tokens,
            ..Default::default()
        }
    }

    #[test]
    fn totals_add_each_step_once() {
        let t = add_steps(Totals::default(), &[step(1, 4, 40), step(2, 4, 50)]);
        assert_eq!(
            t,
            Totals {
                through: 2,
                docs: 8,
                tokens: 90
            }
        );
        // A replayed step 2 (after a restore) is not counted twice.
        let t = add_steps(t, &[step(2, 4, 50), step(3, 2, 7)]);
        assert_eq!(
            t,
            Totals {
                through: 3,
                docs: 10,
                tokens: 97
            }
        );
    }

    /// Issue 14 item 9: the unauthenticated status JSON showed absolute
    /// file paths in job reasons.
    #[test]
    fn reasons_are_shown_without_their_paths() {
        for (reason, shown) in [
            (
                "data: /srv/data/train.jsonl:3: invalid json: expected value",
                "data: <path>:3: invalid json: expected value",
            ),
            (
                "after restart the dataset could not be loaded: file not found: /home/me/x.jsonl",
                "after restart the dataset could not be loaded: file not found: <path>",
            ),
            (
                "checkpoint step-4 failed to restore on w1: \"/runs/a b/ckpt\" (model.safetensors); falling back",
                "checkpoint step-4 failed to restore on w1: \"<path> b/ckpt\" (model.safetensors); falling back",
            ),
            ("model.init=~/ckpt/step-2 is bad", "model.init=<path> is bad"),
            ("waiting for 2 workers (have 1/2)", "waiting for 2 workers (have 1/2)"),
            ("", ""),
        ] {
            assert_eq!(redact_paths(reason), shown, "{reason}");
        }
    }

    #[test]
    fn binding_off_loopback_warns() {
        assert_eq!(exposure_warning("127.0.0.1:9090".parse().unwrap()), None);
        assert_eq!(exposure_warning("[::1]:9090".parse().unwrap()), None);
        let w = exposure_warning("0.0.0.0:9090".parse().unwrap()).unwrap();
        assert!(
            w.contains("0.0.0.0:9090") && w.contains("without a token"),
            "{w}"
        );
    }

    #[test]
    fn an_empty_coordinator_has_an_empty_status() {
        let core = Coordinator::new(Default::default());
        let v = status_view(&core, &HashMap::new(), 5_000, Detail::Full);
        assert_eq!(v.unix_ms, 5_000);
        assert!(v.jobs.is_empty() && v.workers.is_empty() && v.worker_count == 0);
    }
}
