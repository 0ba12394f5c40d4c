//! The RL loop on an external engine (`[rl.engine]`, issue 17 item 6) with
//! the real coordinator binary: a fake OpenAI-compatible engine (axum on
//! 127.0.0.1) answers `/v1/completions` and records its reloads; two fake
//! workers train and publish the policy. The workers never generate; the
//! engine loads every published policy; every prompt is trained once per
//! epoch; errors are retried, or fail the job naming what was wrong.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use common::*;

/// How the fake engine misbehaves.
#[derive(Debug, Clone, Copy, Default)]
enum Mode {
    #[default]
    Healthy,
    /// The first `n` completions requests get HTTP 500.
    Fail500(usize),
    /// Choices come without log-probs.
    NoLogprobs,
    /// Completions requests number `from..from + n` are taken (recorded,
    /// generated) but the engine dies before answering: the connection
    /// drops mid-request.
    DieOn { from: usize, n: usize },
    /// vLLM serving a LoRA job's adapter (`/v1/load_lora_adapter`).
    Lora,
}

#[derive(Debug, Default)]
struct Engine {
    mode: Mode,
    /// (prompt ids, seed) of every completions request, in arrival order.
    requests: Vec<(Vec<u64>, u64)>,
    /// Per reload: the directory and the files it held at the call.
    reloads: Vec<(String, BTreeSet<String>)>,
}

type Shared = Arc<Mutex<Engine>>;

/// Answers `n` samples of the prompt: sample k is "0" (right: every
/// prompt's answer is 0) for even k and "1" for odd k, then the stop
/// token, with plausible log-probs, as vLLM returns them with
/// `return_tokens_as_token_ids`.
async fn completions(State(e): State<Shared>, Json(body): Json<Value>) -> Response {
    let prompt: Vec<u64> = body["prompt"]
        .as_array()
        .expect("the prompt as token ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let seed = body["seed"].as_u64().expect("a seed");
    let n = body["n"].as_u64().expect("n");
    let stop = body["stop_token_ids"][0].as_u64().expect("a stop token id");
    assert_eq!(body["return_tokens_as_token_ids"], true);
    // A LoRA job asks for its adapter by the name it was loaded under.
    let want = if matches!(e.lock().unwrap().mode, Mode::Lora) {
        "accrue-policy"
    } else {
        "policy"
    };
    assert_eq!(body["model"], want);
    let (mode, i) = {
        let mut e = e.lock().unwrap();
        e.requests.push((prompt, seed));
        (e.mode, e.requests.len() - 1)
    };
    match mode {
        Mode::Fail500(k) if i < k => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "engine overloaded").into_response()
        }
        // The connection's task dies with the handler: no answer.
        Mode::DieOn { from, n } if (from..from + n).contains(&i) => {
            panic!("fake engine dies mid-request {i}")
        }
        _ => {}
    }
    let choices: Vec<Value> = (0..n)
        .map(|k| {
            let digit = if k % 2 == 0 { b'0' } else { b'1' };
            let ids = [u64::from(digit), stop];
            let tokens: Vec<String> = ids.iter().map(|t| format!("token_id:{t}")).collect();
            let logprobs = match mode {
                Mode::NoLogprobs => Value::Null,
                _ => json!({"tokens": tokens, "token_logprobs": [-0.7, -0.05],
                            "top_logprobs": null, "text_offset": [0, 1]}),
            };
            json!({"index": k, "text": (digit as char).to_string(),
                   "logprobs": logprobs, "finish_reason": "stop"})
        })
        .collect();
    Json(
        json!({"id": "cmpl-1", "object": "text_completion", "model": "policy",
                "choices": choices}),
    )
    .into_response()
}

/// The file names in `dir` (none when it cannot be read).
fn files_in(dir: &str) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// SGLang's reload: records the directory and what it held.
async fn reload(State(e): State<Shared>, Json(body): Json<Value>) -> Json<Value> {
    let dir = body["model_path"].as_str().expect("model_path").to_string();
    let files = files_in(&dir);
    e.lock().unwrap().reloads.push((dir, files));
    Json(json!({"success": true, "message": "Succeeded to update model weights."}))
}

/// vLLM's runtime LoRA loading: records the adapter folder and what it held.
async fn load_lora(State(e): State<Shared>, Json(body): Json<Value>) -> Response {
    assert_eq!(body["lora_name"], "accrue-policy");
    assert_eq!(body["load_inplace"], true);
    let dir = body["lora_path"].as_str().expect("lora_path").to_string();
    let files = files_in(&dir);
    e.lock().unwrap().reloads.push((dir, files));
    "Success: LoRA adapter 'accrue-policy' added successfully.".into_response()
}

async fn reset_prefix_cache() -> StatusCode {
    StatusCode::OK
}

/// Starts the fake engine on 127.0.0.1; its base URL and state.
async fn start_engine(mode: Mode) -> (String, Shared) {
    let state: Shared = Arc::new(Mutex::new(Engine {
        mode,
        ..Default::default()
    }));
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/update_weights_from_disk", post(reload))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, state)
}

/// A 6-step GRPO job on the engine at `url`: 8 prompts whose answer is
/// 0, groups of 2, 2 prompts a step (12 prompt uses: epoch 0 whole, 4 of
/// epoch 1), the policy published every 2 steps, rollouts at most 2
/// policies old.
fn write_spec(dir: &std::path::Path, url: &str) -> std::path::PathBuf {
    let rows: String = (0..8)
        .map(|i| format!("{{\"question\": \"{i} times 0?\", \"answer\": \"#### 0\"}}\n"))
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows).unwrap();
    std::fs::write(dir.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
    let spec = dir.join("engine.toml");
    std::fs::write(
        &spec,
        format!(
            "[job]\nname = \"engine\"\nsteps = 6\noutput_dir = \"out\"\n\
             [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
             [data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"prompts.jsonl\"]\nmax_tokens = 256\n\
             [batch]\ndocs_per_step = 4\n[objective]\nkind = \"pg\"\n\
             [parallel]\nmin_workers = 2\nmax_workers = 2\n\
             [rl]\ngroup_size = 2\npublish_every = 2\nmax_staleness = 2\n\
             [rl.sampling]\nmax_new_tokens = 8\n\
             [rl.verifier]\nkind = \"gsm8k\"\n\
             [rl.engine]\nurl = \"{url}\"\nmodel = \"policy\"\nreload = \"sglang\"\nmax_concurrency = 2\nretries = 3\ntimeout_s = 30\n"
        ),
    )
    .unwrap();
    spec
}

/// Runs the job with two fake workers until it ends; their reports.
async fn run_job(dir: &std::path::Path, url: &str) -> (Coordinator, FakeReport, FakeReport) {
    let spec = write_spec(dir, url);
    let coord = Coordinator::start(&dir.join("state"));
    let a = tokio::spawn(fake_worker(coord.url.clone(), None));
    let b = tokio::spawn(fake_worker(coord.url.clone(), None));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let out = accrue(&coord.url, &["submit", spec.to_str().unwrap()], dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = a.await.unwrap().unwrap();
    let b = b.await.unwrap().unwrap();
    (coord, a, b)
}

/// The job's metrics lines: 6 steps of 4 rollouts (2 groups), the
/// stream's head moving 2 groups a step.
fn steps_of(dir: &std::path::Path) -> Vec<Value> {
    let metrics: Vec<Value> = std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let heads: Vec<u64> = metrics
        .iter()
        .map(|m| m["cursor"]["position"].as_u64().unwrap())
        .collect();
    assert_eq!(heads, [2, 4, 6, 8, 10, 12]);
    for m in &metrics {
        assert_eq!(m["docs"], 4, "{m}");
    }
    metrics
}

/// The engine was asked for 12 prompt uses (a seed per stream position:
/// a re-asked request repeats its seed): each of the 8 prompts once in
/// epoch 0, and 4 of them again in epoch 1.
fn assert_prompts_once_per_epoch(e: &Engine) {
    let uses: BTreeSet<&(Vec<u64>, u64)> = e.requests.iter().collect();
    assert_eq!(uses.len(), 12);
    let mut per_prompt: BTreeMap<&Vec<u64>, usize> = BTreeMap::new();
    for (p, _) in uses {
        *per_prompt.entry(p).or_default() += 1;
    }
    assert_eq!(per_prompt.len(), 8);
    let twice = per_prompt.values().filter(|&&n| n == 2).count();
    let once = per_prompt.values().filter(|&&n| n == 1).count();
    assert_eq!((once, twice), (4, 4), "{per_prompt:?}");
}

/// Every rollout the workers trained, each once: 6 steps × 4.
fn assert_rollouts_once(a: &FakeReport, b: &FakeReport) {
    let trained: Vec<&String> = a.docs.iter().chain(&b.docs).map(|(_, d)| d).collect();
    let unique: BTreeSet<&&String> = trained.iter().collect();
    assert_eq!((trained.len(), unique.len()), (24, 24), "{trained:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_generates_while_workers_train_and_reloads_every_published_policy() {
    let dir = tempfile::tempdir().unwrap();
    let (url, engine) = start_engine(Mode::Healthy).await;
    let (_coord, a, b) = run_job(dir.path(), &url).await;
    assert!(a.released && b.released, "the job completes");
    assert!(
        a.rounds.is_empty() && b.rounds.is_empty(),
        "no worker got a Generate plan"
    );
    let metrics = steps_of(dir.path());
    assert_rollouts_once(&a, &b);
    // A step reports the rounds scored since the previous one: the engine
    // runs ahead, so under load one step can carry two rounds and the next
    // none. Every trained rollout was scored by the step that trained it.
    let mut scored = 0.0;
    for m in &metrics {
        if let Some(n) = m["extra"]["rl/completions"].as_f64() {
            scored += n;
            assert_eq!(m["extra"]["rl/accuracy"], 0.5, "{m}");
            assert!(m["extra"]["rl/reward_mean"].is_number(), "{m}");
        }
        let stale = m["extra"]["staleness/max"].as_f64().unwrap();
        assert!(stale <= 2.0, "within rl.max_staleness: {m}");
    }
    assert!(
        scored >= 24.0,
        "24 trained rollouts, {scored} reported scored"
    );
    let e = engine.lock().unwrap();
    assert_prompts_once_per_epoch(&e);
    assert_eq!(
        e.requests.len(),
        12,
        "one request per prompt use, none repeated"
    );
    // The engine loaded the starting weights, then each published policy
    // before the last step, each a whole model folder at an absolute path.
    let steps: Vec<&str> = e
        .reloads
        .iter()
        .map(|(d, _)| d.rsplit('/').next().unwrap())
        .collect();
    assert_eq!(steps, ["step-0", "step-2", "step-4"], "{:?}", e.reloads);
    for (d, files) in &e.reloads {
        assert!(std::path::Path::new(d).is_absolute(), "{d}");
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(files.contains(f), "{d} lacked {f} when reloaded: {files:?}");
        }
    }
    assert_eq!(a.published, [0, 2, 4, 6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_500s_are_retried_and_the_job_trains_on() {
    let dir = tempfile::tempdir().unwrap();
    let (url, engine) = start_engine(Mode::Fail500(3)).await;
    let (_coord, a, b) = run_job(dir.path(), &url).await;
    assert!(a.released, "the job completes");
    steps_of(dir.path());
    assert_rollouts_once(&a, &b);
    let e = engine.lock().unwrap();
    assert_prompts_once_per_epoch(&e);
    // The three refused requests were asked again.
    assert_eq!(e.requests.len(), 12 + 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dying_mid_round_loses_no_prompt_and_counts_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    // Requests 3 and 4 (of round 2) are generated, but their answers are
    // lost with the engine.
    let (url, engine) = start_engine(Mode::DieOn { from: 3, n: 2 }).await;
    let (_coord, a, b) = run_job(dir.path(), &url).await;
    assert!(a.released && b.released, "the job completes");
    steps_of(dir.path());
    assert_rollouts_once(&a, &b);
    let e = engine.lock().unwrap();
    assert_prompts_once_per_epoch(&e);
    // The prompts whose answers were lost were asked again with the same
    // seed (a retry may be lost too): 2 requests more than prompt uses,
    // yet every use trained once.
    let mut seen: BTreeMap<&(Vec<u64>, u64), usize> = BTreeMap::new();
    for r in &e.requests {
        *seen.entry(r).or_default() += 1;
    }
    assert_eq!((e.requests.len(), seen.len()), (14, 12));
    assert!(seen.values().any(|&n| n > 1), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_engine_answer_fails_the_job_naming_the_field_and_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _engine) = start_engine(Mode::NoLogprobs).await;
    let (coord, a, _) = run_job(dir.path(), &url).await;
    assert!(a.released, "the failed job releases its workers");
    assert!(a.steps.is_empty(), "nothing trained");
    let jobs = wait_for_jobs(&coord.url, dir.path(), 10, |v| {
        v.to_string().contains("\"failed\"")
    });
    let text = jobs.to_string();
    assert!(
        text.contains("choices[0].logprobs") && text.contains("prompt 0:") && text.contains(&url),
        "{text}"
    );
}

/// A LoRA job on the engine (issue 35), with two real workers
/// (`accrue local`): every published policy is the adapter folder PEFT and
/// vLLM load (`adapter_model.safetensors`, `adapter_config.json`), loaded
/// with `/v1/load_lora_adapter` in place under one name, and the rounds ask
/// for that name; the job trains to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_job_hands_the_engine_its_adapter_folder_every_publication() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (url, engine) = start_engine(Mode::Lora).await;
    let spec = write_spec(d, &url);
    let text = std::fs::read_to_string(&spec)
        .unwrap()
        .replace("reload = \"sglang\"", "reload = \"vllm\"")
        + "[lora]\nrank = 4\nalpha = 8\n";
    std::fs::write(&spec, text).unwrap();
    let bin = bin_dir().join("accrue");
    let spec_arg = spec.display().to_string();
    let cwd = d.to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin)
            .args(["local", &spec_arg, "--workers", "2"])
            .current_dir(cwd)
            .output()
            .expect("running accrue local")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let e = engine.lock().unwrap();
    let steps: Vec<&str> = e
        .reloads
        .iter()
        .map(|(d, _)| d.rsplit('/').next().unwrap())
        .collect();
    assert_eq!(steps, ["step-0", "step-2", "step-4"], "{:?}", e.reloads);
    for (d, files) in &e.reloads {
        for f in [
            "adapter_model.safetensors",
            "adapter_config.json",
            "tokenizer.json",
        ] {
            assert!(files.contains(f), "{d} lacked {f} when loaded: {files:?}");
        }
        assert!(
            !files.iter().any(|f| f.starts_with("optimizer")),
            "{d}: a published policy carries no optimizer state: {files:?}"
        );
    }
    assert_prompts_once_per_epoch(&e);
    steps_of(d);
}
