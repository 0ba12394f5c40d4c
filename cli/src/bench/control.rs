//! `accrue bench control-plane` (issue 19): the real coordinator (gRPC
//! server on 127.0.0.1, an OS port) against W simulated workers in this
//! process: tokio tasks speaking the real protocol over real sockets (one
//! connection each), heartbeating at the server's interval, answering
//! Configure with Ready and every plan at once with the sums a real worker
//! would report for it (so the coordinator's plan check passes).
//!
//! The coordinator runs on its own runtime with its own threads, so its CPU
//! time is read apart from the fake workers' (the process's, less the fake
//! workers' threads, from `/proc/self/stat` and `/proc/self/task/*/stat`). Reported per W: coordinator CPU per step (and
//! the whole process's, fakes included), the state lock's held time per
//! step, generation formation (wall time from the last session to the last
//! Configure received, and the longest single lock hold meanwhile), bytes
//! per worker of the Configure and of a step's plan, resident memory, and
//! store growth per step.
//!
//! Printing code, not domain logic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accrue_proto::v1 as wire;
use anyhow::{bail, Context};
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Semaphore};
use wire::coordinator_message::Msg as In;
use wire::worker_message::Msg as Out;

use accrue_coordinator::shell::server::{Server, ServerConfig};
use accrue_coordinator::shell::service::Shared;

/// Thread names: the coordinator's runtime and the fake workers'.
const COORD_THREADS: &str = "accrue-coord";
const FAKE_THREADS: &str = "bench-fake";
/// The thread that runs a measurement (it drives the fakes): named like
/// them so its CPU is not counted as the coordinator's.
pub const DRIVER_THREAD: &str = "bench-fake-driver";

/// What one run measures.
#[derive(Debug, Clone)]
pub struct ControlBenchOpts {
    pub workers: usize,
    /// Documents in the dataset.
    pub docs: u64,
    /// docs_per_step = this × workers.
    pub docs_per_worker: u64,
    /// Steps measured, after `warmup` steps.
    pub steps: u64,
    pub warmup: u64,
    /// Generations re-formed after the measured steps (one fake worker
    /// leaves and comes back each time), for the memory growth per
    /// generation and the re-formation time.
    pub reforms: u64,
    /// The fakes send one result each per step (as workers did before
    /// gathering) instead of rank 0 sending them all.
    pub per_rank_results: bool,
    /// Each fake takes this long over a train step before answering.
    pub fake_step_ms: u64,
    /// The coordinator's `relay_min_world` (every fake can relay).
    pub relay_min_world: u32,
    /// Scratch directory (dataset, state, outputs).
    pub work: PathBuf,
}

/// One output row.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct ControlRow {
    pub workers: usize,
    pub dataset_docs: u64,
    pub docs_per_step: u64,
    /// Steps inside the measured window (at least the steps asked for).
    pub steps: u64,
    /// Wall time per measured step.
    pub step_ms: f64,
    /// The share of the measured steps sent as planned while the step
    /// before ran (`core::ahead`).
    #[serde(default)]
    pub sent_ahead_share: f64,
    /// How long each fake took over a train step (`--fake-step-ms`).
    #[serde(default)]
    pub fake_step_ms: u64,
    /// `step_ms` less `fake_step_ms`: what the coordinator adds between
    /// steps (the last result in to every plan out), while workers idle.
    #[serde(default)]
    pub gap_ms_per_step: f64,
    /// CPU of the coordinator's threads per step.
    pub coordinator_cpu_ms_per_step: f64,
    /// CPU of the whole process per step (the fake workers included).
    pub process_cpu_ms_per_step: f64,
    /// Time the state lock was held per step (every event: results,
    /// heartbeats, planning, dispatch).
    pub locked_ms_per_step: f64,
    /// Time of the state-machine call that planned each step (the last
    /// result's commit included): what must not grow with the dataset.
    #[serde(default)]
    pub plan_ms_per_step: f64,
    /// From the last worker's session to the last Configure received.
    pub formation_ms: f64,
    /// The longest single lock hold while the generation formed.
    pub formation_locked_ms: f64,
    pub configure_bytes_per_worker: f64,
    pub plan_bytes_per_worker_per_step: f64,
    /// Result messages the coordinator received per measured step: 1 when
    /// rank 0 sends every rank's result gathered, W when each rank sends
    /// its own (`--per-rank-results`).
    #[serde(default)]
    pub result_messages_per_step: f64,
    /// Plans and relays the coordinator sent on sessions per measured step:
    /// W without relaying, about √W relayed (`core::relay`).
    #[serde(default)]
    pub plan_messages_per_step: f64,
    /// Resident memory of the process at the end (fakes included).
    pub rss_bytes: u64,
    /// Growth of the state store's file per measured step (redb grows
    /// its file in regions: 0 until one fills).
    pub store_bytes_per_step: f64,
    /// Bytes of step records stored per measured step.
    pub step_record_bytes: f64,
    /// Workers whose session the coordinator ended (declared lost).
    pub workers_lost: u64,
    /// The longest gap between two heartbeats a fake sent (the fakes share
    /// the machine: a gap near the heartbeat timeout makes a loss theirs).
    #[serde(default)]
    pub fake_heartbeat_gap_ms: u64,
    /// Generations formed (1 + `reforms` when nobody else was lost).
    pub generations: u64,
    /// Re-formed generations measured after the steps.
    #[serde(default)]
    pub reforms: u64,
    /// Mean wall time from a worker's leaving (the step in flight then
    /// aborts on every member) to the last Configure of the generation it
    /// rejoins received: how long the job stands still. (Measured from its
    /// return, as before, this hid the aborts whenever the worker came back
    /// after them.)
    #[serde(default)]
    pub reform_ms: f64,
    /// Growth of the resident set per re-formed generation after the
    /// first (the process, fakes included; allocator and page granularity
    /// make it noisy).
    #[serde(default)]
    pub rss_growth_per_generation_bytes: f64,
}

/// Counters the fake workers share.
#[derive(Debug, Default)]
struct Tally {
    configured: AtomicU64,
    configure_bytes: AtomicU64,
    plan_bytes: AtomicU64,
    plans: AtomicU64,
    /// Result messages sent (StepResult or StepResults).
    results: AtomicU64,
    /// Plans and relays that came on a session (not through a hub).
    session_plans: AtomicU64,
    /// Relays that came on a session.
    relays: AtomicU64,
    lost: AtomicU64,
    max_generation: AtomicU64,
    /// Sessions a fake ended on purpose (a re-formation), not losses.
    bounced: AtomicU64,
    /// The longest time between two heartbeats a fake sent.
    max_beat_gap_ms: AtomicU64,
    /// Why the first lost fake's session ended, as it saw it.
    first_loss: std::sync::Mutex<Option<String>>,
}

/// The fakes' stand-in for the workers' collective (`Configure.
/// gather_results`): each train result is deposited here, and the fake that
/// completes a step's set sends them all through rank 0's session, as rank
/// 0 does after the all-gather.
#[derive(Default)]
struct Gathering {
    inner: std::sync::Mutex<GatherState>,
}

#[derive(Default)]
struct GatherState {
    /// Rank 0's session of each live generation (weak: a session that
    /// ended must close, not be held open by this table).
    rank0: HashMap<u64, tokio::sync::mpsc::WeakSender<wire::WorkerMessage>>,
    /// Results deposited so far, by (generation, step).
    pending: HashMap<(u64, u64), Vec<wire::StepResult>>,
}

impl Gathering {
    /// A fake was configured as `rank` of `generation`: rank 0's session
    /// is where the generation's results go; older generations' are gone.
    fn configured(
        &self,
        generation: u64,
        rank: u32,
        session: &tokio::sync::mpsc::Sender<wire::WorkerMessage>,
    ) {
        if rank != 0 {
            return;
        }
        let mut g = self.inner.lock().expect("poisoned");
        g.rank0.retain(|&gen, _| gen >= generation);
        g.pending.retain(|&(gen, _), _| gen >= generation);
        g.rank0.insert(generation, session.downgrade());
    }

    /// Deposits `r`: rank 0's session and the whole set when `r`
    /// completes its step's `world` results.
    fn deposit(
        &self,
        r: wire::StepResult,
        world: u32,
    ) -> Option<(
        tokio::sync::mpsc::Sender<wire::WorkerMessage>,
        wire::StepResults,
    )> {
        let mut g = self.inner.lock().expect("poisoned");
        let key = (r.generation, r.step);
        let set = g.pending.entry(key).or_default();
        set.push(r);
        if set.len() < world as usize {
            return None;
        }
        let mut results = g.pending.remove(&key).unwrap_or_default();
        results.sort_by_key(|r| r.rank);
        let first = &results[0];
        let batch = wire::StepResults {
            job_id: first.job_id.clone(),
            generation: first.generation,
            step: first.step,
            results,
        };
        Some((g.rank0.get(&key.0)?.upgrade()?, batch))
    }
}

/// Runs one measurement: its own two runtimes, torn down at the end.
pub fn control_plane(opts: &ControlBenchOpts) -> anyhow::Result<ControlRow> {
    std::fs::create_dir_all(&opts.work)?;
    write_dataset(&opts.work, opts.docs)?;
    let coord = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(COORD_THREADS)
        .enable_all()
        .build()?;
    // The fakes' threads (2 unless ACCRUE_BENCH_FAKE_THREADS says): on a
    // machine with cores to spare, more keep 4,096 fake connections from
    // falling behind the coordinator they measure.
    let fake_threads = std::env::var("ACCRUE_BENCH_FAKE_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2);
    let fakes = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(fake_threads)
        .thread_name(FAKE_THREADS)
        // Never ended mid-run: the coordinator's CPU is the rest.
        .thread_keep_alive(Duration::from_secs(24 * 3600))
        .enable_all()
        .build()?;
    let state = opts.work.join(format!("state-{}", opts.workers));
    let _ = std::fs::remove_dir_all(&state);
    let out = opts.work.join(format!("out-{}", opts.workers));
    let _ = std::fs::remove_dir_all(&out);
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse()?, state.clone());
    cfg.relay_min_world = opts.relay_min_world;
    let server = coord.block_on(Server::bind(cfg))?;
    let url = format!("http://{}", server.local_addr());
    let shared = server.shared();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = coord.spawn(server.run(stop.clone()));
    let result = fakes.block_on(drive(opts, &url, &shared, &state, &out));
    stop.cancel();
    let _ = coord.block_on(served);
    fakes.shutdown_timeout(Duration::from_secs(2));
    coord.shutdown_timeout(Duration::from_secs(2));
    result
}

async fn drive(
    opts: &ControlBenchOpts,
    url: &str,
    shared: &Shared,
    state: &Path,
    out: &Path,
) -> anyhow::Result<ControlRow> {
    let w = opts.workers;
    let total_steps = opts.warmup + opts.steps + 1;
    // Room for the re-formations after the measured steps: the fakes
    // train on at full speed while one leaves and comes back (steps the
    // bench does not wait for are never run: it stops the coordinator).
    let job_steps = total_steps + 1000 * (opts.reforms + 1) + 2;
    let docs_per_step = opts.docs_per_worker * w as u64;
    let spec = format!(
        "[job]\nname = \"control-plane\"\nsteps = {job_steps}\noutput_dir = \"{}\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\nmax_tokens = 512\n\
         [batch]\ndocs_per_step = {docs_per_step}\n[optimizer]\nlr = 0.001\n\
         [parallel]\nmin_workers = {w}\nmax_workers = {w}\n",
        out.display()
    );
    let mut admin = wire::admin_client::AdminClient::connect(url.to_string()).await?;
    admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec,
            base_dir: opts.work.display().to_string(),
            new_job: false,
        })
        .await
        .context("submitting the bench job")?;
    let tally = Arc::new(Tally::default());
    let gathering = Arc::new(Gathering::default());
    let (step_tx, mut step_rx) = watch::channel(0u64);
    let step_tx = Arc::new(step_tx);
    // Fake 0 ends its session and comes back each time this moves.
    let (bounce_tx, bounce_rx) = watch::channel(0u64);
    // Bounds concurrent connects (the listener's backlog), not sessions.
    let connecting = Arc::new(Semaphore::new(64));
    let (session_tx, mut session_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut relays = Vec::with_capacity(RELAY_LISTENERS);
    for _ in 0..RELAY_LISTENERS.min(w) {
        relays.push(relay_hub(&tally).await?);
    }
    let mut tasks = tokio::task::JoinSet::new();
    let spawn = |tasks: &mut tokio::task::JoinSet<anyhow::Result<()>>, i: usize| {
        let fake = Fake {
            url: url.to_string(),
            index: i,
            tally: tally.clone(),
            gathering: gathering.clone(),
            per_rank_results: opts.per_rank_results,
            step_time: Duration::from_millis(opts.fake_step_ms),
            step_tx: step_tx.clone(),
            connecting: connecting.clone(),
            session_tx: session_tx.clone(),
            bounce: (i == 0).then(|| bounce_rx.clone()),
            relay: Some(relays[i % relays.len()].clone()),
        };
        tasks.spawn(fake.run());
    };
    for i in 0..w.saturating_sub(1) {
        spawn(&mut tasks, i);
    }
    for _ in 0..w.saturating_sub(1) {
        session_rx
            .recv()
            .await
            .context("a fake worker failed to start")?;
    }
    // The last session forms the generation: time it alone.
    shared.lock_stats(true);
    spawn(&mut tasks, w - 1);
    session_rx
        .recv()
        .await
        .context("the last fake worker failed")?;
    let last_session = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(600);
    while tally.configured.load(Ordering::Relaxed) < w as u64 {
        if Instant::now() > deadline {
            bail!("the generation did not form within 600 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let formation = last_session.elapsed();
    let formation_locked = shared.lock_stats(true).max_ns;
    let configure_bytes = tally.configure_bytes.load(Ordering::Relaxed);
    // Measure from the plan of step warmup + 1 to that of the last step.
    let at = |step_rx: &mut watch::Receiver<u64>, step: u64| {
        let mut rx = step_rx.clone();
        async move { rx.wait_for(|&s| s >= step).await.map(|_| ()) }
    };
    at(&mut step_rx, opts.warmup + 1).await?;
    // The steps actually inside the window, counted where everything else
    // is sampled: a driver woken late (tiny steps, a busy machine) finds
    // the job further on, and steps keep running while a sample is taken.
    let start = Sample::take(shared, state, &tally, &step_rx);
    at(&mut step_rx, start.step + opts.steps).await?;
    let end = Sample::take(shared, state, &tally, &step_rx);
    let measured = end.step - start.step;
    let results = end.results - start.results;
    let session_plans = end.session_plans - start.session_plans;
    let plan_bytes = end.plan_bytes - start.plan_bytes;
    let plans = end.sent_plans - start.sent_plans;
    let rss_bytes = rss();
    // Generations re-formed: fake 0 leaves, the step in flight aborts, the
    // job waits for min_workers, fake 0 comes back, a new generation forms
    // and trains a step.
    let mut reform = Duration::ZERO;
    let mut rss_first = rss_bytes;
    for k in 1..=opts.reforms {
        let generation = tally.max_generation.load(Ordering::Relaxed);
        let configured = tally.configured.load(Ordering::Relaxed);
        let left = Instant::now();
        bounce_tx.send_replace(k);
        session_rx
            .recv()
            .await
            .context("fake 0 did not come back")?;
        let deadline = Instant::now() + Duration::from_secs(600);
        while tally.max_generation.load(Ordering::Relaxed) <= generation
            || tally.configured.load(Ordering::Relaxed) < configured + w as u64
        {
            let lost = tally.lost.load(Ordering::Relaxed);
            if lost > 0 || Instant::now() > deadline {
                // A lost fake does not come back: the job would wait forever.
                let gap = tally.max_beat_gap_ms.load(Ordering::Relaxed);
                let why = tally.first_loss.lock().expect("poisoned").clone();
                bail!(
                    "re-formation {k} did not complete: {lost} fake workers lost \
                     (the first: {}; the longest gap between a fake's own heartbeats: {gap} ms)",
                    why.as_deref().unwrap_or("none lost: timed out")
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        reform += left.elapsed();
        tracing::info!(
            reform = k,
            ms = left.elapsed().as_secs_f64() * 1e3,
            longest_lock_hold_ms = shared.lock_stats(true).max_ns as f64 / 1e6,
            fake_heartbeat_gap_ms = tally.max_beat_gap_ms.load(Ordering::Relaxed),
            "generation re-formed"
        );
        let next = *step_rx.borrow() + 1;
        at(&mut step_rx, next).await?;
        if k == 1 {
            // Growth is counted from here: the first re-formation's is
            // one-off (the allocator's pools, the rejoin's connection).
            rss_first = rss();
        }
    }
    let rss_after = rss();
    drop(admin);
    tasks.abort_all();
    let steps = measured.max(1) as f64;
    let ms = |ns: u64| ns as f64 / 1e6;
    Ok(ControlRow {
        workers: w,
        dataset_docs: opts.docs,
        docs_per_step,
        steps: measured,
        step_ms: (end.at - start.at).as_secs_f64() * 1e3 / steps,
        fake_step_ms: opts.fake_step_ms,
        gap_ms_per_step: (end.at - start.at).as_secs_f64() * 1e3 / steps - opts.fake_step_ms as f64,
        coordinator_cpu_ms_per_step: ms(end.coord_cpu_ns - start.coord_cpu_ns) / steps,
        process_cpu_ms_per_step: ms(end.cpu_ns - start.cpu_ns) / steps,
        locked_ms_per_step: ms(end.locked_ns - start.locked_ns) / steps,
        plan_ms_per_step: (end.plan_s - start.plan_s) * 1e3
            / (end.plans - start.plans).max(1) as f64,
        formation_ms: formation.as_secs_f64() * 1e3,
        formation_locked_ms: ms(formation_locked),
        configure_bytes_per_worker: configure_bytes as f64 / w as f64,
        plan_bytes_per_worker_per_step: plan_bytes as f64 / plans.max(1) as f64,
        result_messages_per_step: results as f64 / steps,
        plan_messages_per_step: session_plans as f64 / steps,
        rss_bytes,
        store_bytes_per_step: (end.store_bytes as f64 - start.store_bytes as f64) / steps,
        step_record_bytes: (end.steps_bytes - start.steps_bytes) as f64 / steps,
        sent_ahead_share: (end.sent_ahead - start.sent_ahead) as f64 / steps,
        workers_lost: tally.lost.load(Ordering::Relaxed),
        fake_heartbeat_gap_ms: tally.max_beat_gap_ms.load(Ordering::Relaxed),
        generations: tally.max_generation.load(Ordering::Relaxed),
        reforms: opts.reforms,
        reform_ms: reform.as_secs_f64() * 1e3 / opts.reforms.max(1) as f64,
        rss_growth_per_generation_bytes: match opts.reforms {
            0 => 0.0,
            1 => rss_after as f64 - rss_bytes as f64,
            n => (rss_after as f64 - rss_first as f64) / (n - 1) as f64,
        },
    })
}

/// What is read at the start and end of the measured steps.
struct Sample {
    at: Instant,
    cpu_ns: u64,
    coord_cpu_ns: u64,
    /// The step planned last, the result messages and plans the fakes
    /// received and sent, read together with the CPU times.
    step: u64,
    results: u64,
    session_plans: u64,
    sent_plans: u64,
    plan_bytes: u64,
    locked_ns: u64,
    plan_s: f64,
    plans: u64,
    store_bytes: u64,
    steps_bytes: u64,
    sent_ahead: u64,
}

impl Sample {
    fn take(shared: &Shared, state: &Path, tally: &Tally, step: &watch::Receiver<u64>) -> Sample {
        let (cpu_ns, coord_cpu_ns) = thread_cpu_ns();
        let at = Instant::now();
        let step = *step.borrow();
        let results = tally.results.load(Ordering::Relaxed);
        let session_plans = tally.session_plans.load(Ordering::Relaxed);
        let sent_plans = tally.plans.load(Ordering::Relaxed);
        let plan_bytes = tally.plan_bytes.load(Ordering::Relaxed);
        let (job, sent_ahead) = shared.read(|c| {
            let job = c.jobs().next();
            (
                job.map(|j| j.rec.id.clone()),
                job.map_or(0, |j| j.ahead.sent),
            )
        });
        let (plan_s, plans) = job.as_deref().map_or((0.0, 0), |j| shared.plan_seconds(j));
        Sample {
            sent_ahead,
            plan_s,
            plans,
            at,
            step,
            results,
            session_plans,
            sent_plans,
            plan_bytes,
            cpu_ns,
            coord_cpu_ns,
            locked_ns: shared.lock_stats(false).total_ns,
            store_bytes: std::fs::metadata(state.join("accrue.redb")).map_or(0, |m| m.len()),
            steps_bytes: job.and_then(|j| shared.steps_bytes(&j).ok()).unwrap_or(0),
        }
    }
}

/// CPU time of this whole process (threads that ended included), and of
/// the coordinator's part: the whole less the fake workers' threads and
/// the main thread (which drives them). The fakes' threads live through
/// the run (their blocking pool is kept alive), so a thread that ended
/// was the coordinator's (its blocking pool, the cold-file mover) and is
/// counted as such.
fn thread_cpu_ns() -> (u64, u64) {
    // /proc counts in USER_HZ, 100 on every Linux architecture we run on.
    const HZ: u64 = 100;
    // "pid (comm) state ..." — comm may hold spaces, so split at ')';
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after it.
    let parse = |stat: &str| -> Option<(String, u64)> {
        let (open, close) = (stat.find('(')?, stat.rfind(')')?);
        let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some((
            stat[open + 1..close].to_string(),
            ticks * 1_000_000_000 / HZ,
        ))
    };
    let all = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| parse(&s))
        .map_or(0, |(_, ns)| ns);
    let main = std::process::id().to_string();
    let mut fakes = 0;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return (all, 0);
    };
    for t in dir.flatten() {
        let Some((comm, ns)) = std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| parse(&s))
        else {
            continue;
        };
        if comm.starts_with(FAKE_THREADS) || t.file_name().to_str() == Some(main.as_str()) {
            fakes += ns;
        }
    }
    (all, all.saturating_sub(fakes))
}

/// Resident set of this process.
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// `train.jsonl` of `docs` short SFT rows and the model config, unless a
/// dataset of that size is already there.
fn write_dataset(dir: &Path, docs: u64) -> anyhow::Result<()> {
    // v2: fixed-width numbers, so every dataset size has documents of
    // the same length (a bigger one must not plan longer documents).
    let marker = dir.join(format!("train.v2.{docs}.done"));
    if marker.is_file() {
        return Ok(());
    }
    let mut rows = String::with_capacity(docs as usize * 40);
    for i in 0..docs {
        rows.push_str(&format!(
            "{{\"prompt\": \"{i:010}+1=\", \"completion\": \"y\"}}\n"
        ));
    }
    std::fs::write(dir.join("train.jsonl"), rows)?;
    std::fs::write(
        dir.join("tiny.json"),
        r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )?;
    for old in std::fs::read_dir(dir)?.flatten() {
        if old.file_name().to_string_lossy().ends_with(".done") {
            let _ = std::fs::remove_file(old.path());
        }
    }
    std::fs::write(marker, "")?;
    Ok(())
}

/// The relay listener the fakes share, its faults noted as the first loss.
async fn relay_hub(tally: &Arc<Tally>) -> anyhow::Result<(accrue_relay::Hub, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let opts = accrue_relay::HubOptions {
        max_frame: RELAY_MAX_FRAME,
        ..Default::default()
    };
    let (hub, mut faults) = accrue_relay::Hub::start(listener, opts);
    let tally = tally.clone();
    tokio::spawn(async move {
        while let Some(f) = faults.recv().await {
            let mut first = tally.first_loss.lock().expect("poisoned");
            first.get_or_insert_with(|| format!("relay to rank {}: {}", f.rank, f.why));
        }
    });
    Ok((hub, addr))
}

/// One simulated worker.
struct Fake {
    url: String,
    index: usize,
    tally: Arc<Tally>,
    gathering: Arc<Gathering>,
    /// Ignores `Configure.gather_results` (`--per-rank-results`).
    per_rank_results: bool,
    /// Taken over each train step before answering (`--fake-step-ms`).
    step_time: Duration,
    step_tx: Arc<watch::Sender<u64>>,
    connecting: Arc<Semaphore>,
    session_tx: tokio::sync::mpsc::UnboundedSender<()>,
    /// Fake 0: ends its session and registers again (as the same worker)
    /// each time this moves.
    bounce: Option<watch::Receiver<u64>>,
    /// The relay hub (`accrue-relay`, as a worker runs it) and its
    /// address, shared with other fakes ([`RELAY_LISTENERS`]).
    relay: Option<(accrue_relay::Hub, String)>,
}

/// Relay listeners the fakes share (fake i uses listener i mod this; a
/// prime, so the hubs, every ⌈√W⌉th rank, spread over them). One each
/// would take ~4k more descriptors at W = 4096, past this machine's
/// limit; one for all queued ~4k connections on one backlog.
const RELAY_LISTENERS: usize = 67;

/// The relay frames a fake accepts.
const RELAY_MAX_FRAME: usize = 64 << 20;

impl Fake {
    async fn run(mut self) -> anyhow::Result<()> {
        let mut previous = String::new();
        loop {
            match self.session(&previous).await? {
                Some(id) => previous = id,
                None => return Ok(()),
            }
        }
    }

    /// One registration and session; Some(its worker id) when it ended to
    /// come back (a bounce).
    async fn session(&mut self, previous: &str) -> anyhow::Result<Option<String>> {
        let permit = self.connecting.acquire().await?;
        let mut c = wire::worker_service_client::WorkerServiceClient::connect(self.url.clone())
            .await?
            .max_decoding_message_size(usize::MAX);
        let reg = c
            .register(wire::RegisterRequest {
                hostname: format!("fake-{}", self.index),
                device: "cpu".into(),
                collective_addr: format!("127.0.0.1:{}", 10_000 + self.index),
                previous_worker_id: previous.to_string(),
                protocol: accrue_proto::PROTOCOL,
                relay_addr: self.relay.as_ref().map(|r| r.1.clone()).unwrap_or_default(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let worker_id = reg.worker_id.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let msg = |m| wire::WorkerMessage { msg: Some(m) };
        tx.send(msg(Out::Hello(wire::Hello {
            worker_id: reg.worker_id,
        })))
        .await?;
        let mut inbound = c
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        drop(permit);
        let _ = self.session_tx.send(());
        let beat = tx.clone();
        let every = Duration::from_millis(u64::from(reg.heartbeat_interval_ms.max(1)));
        let tally = self.tally.clone();
        let heartbeats = tokio::spawn(async move {
            let opened = Instant::now();
            let mut tick = tokio::time::interval(every);
            let mut last: Option<Instant> = None;
            loop {
                tick.tick().await;
                // How late this fake itself is: a starved fake (they share
                // the machine with the coordinator) goes silent by itself.
                let now = Instant::now();
                if let Some(l) = last {
                    let gap = (now - l).as_millis() as u64;
                    tally.max_beat_gap_ms.fetch_max(gap, Ordering::Relaxed);
                }
                last = Some(now);
                let hb = wire::Heartbeat {
                    sent_ms: opened.elapsed().as_millis() as u64 + 1,
                    ..Default::default()
                };
                if beat.send(msg(Out::Heartbeat(hb))).await.is_err() {
                    return;
                }
            }
        });
        let mut bounce = self.bounce.clone();
        if let Some(b) = bounce.as_mut() {
            b.borrow_and_update();
        }
        let bounced = async move {
            match bounce.as_mut() {
                Some(b) => b.changed().await.is_ok(),
                None => std::future::pending().await,
            }
        };
        tokio::pin!(bounced);
        // The generation's world size when its train results are gathered.
        let mut gather: Option<u32> = None;
        // A follower's connection to its hub: the messages it forwards.
        let mut link: Option<
            tokio::sync::mpsc::UnboundedReceiver<
                Result<wire::CoordinatorMessage, accrue_relay::LinkError>,
            >,
        > = None;
        let hub = self.relay.as_ref().map(|r| r.0.clone());
        // A hub's own messages, from the relay it forwarded.
        let mut own: std::collections::VecDeque<wire::CoordinatorMessage> = Default::default();
        let mut own_rank = 0;
        let ended = loop {
            let next = if let Some(m) = own.pop_front() {
                Ok(Some(m))
            } else {
                let relayed = async {
                    match link.as_mut() {
                        Some(l) => l.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    m = inbound.message() => {
                        if let Ok(Some(wire::CoordinatorMessage {
                            msg: Some(In::StepPlan(_) | In::Relay(_)),
                        })) = &m
                        {
                            self.tally.session_plans.fetch_add(1, Ordering::Relaxed);
                        }
                        m
                    }
                    r = relayed => match r {
                        Some(Ok(m)) => Ok(Some(m)),
                        // Its hub moved on to a newer generation (whose
                        // Configure is on its way here too), or went away
                        // (its session ends, and the generation re-forms).
                        Some(Err(accrue_relay::LinkError::Closed)) | None => {
                            link = None;
                            continue;
                        }
                        // It never reached its hub: a real worker reports
                        // it and the generation re-forms; here, a loss.
                        Some(Err(e)) => {
                            let mut first = self.tally.first_loss.lock().expect("poisoned");
                            first.get_or_insert_with(|| format!("fake {}: {e}", self.index));
                            break true;
                        }
                    },
                    true = &mut bounced => {
                        heartbeats.abort();
                        self.tally.bounced.fetch_add(1, Ordering::Relaxed);
                        return Ok(Some(worker_id));
                    }
                }
            };
            let m = match next {
                Ok(Some(m)) => m,
                Ok(None) => break false,
                Err(e) => {
                    let mut first = self.tally.first_loss.lock().expect("poisoned");
                    first.get_or_insert_with(|| format!("fake {}: {e}", self.index));
                    break true;
                }
            };
            let bytes = m.encoded_len() as u64;
            let reply = match m.msg {
                Some(In::Configure(c)) => {
                    self.tally
                        .configure_bytes
                        .fetch_add(bytes, Ordering::Relaxed);
                    self.tally.configured.fetch_add(1, Ordering::Relaxed);
                    self.tally
                        .max_generation
                        .fetch_max(c.generation, Ordering::Relaxed);
                    gather = (c.gather_results && !self.per_rank_results).then_some(c.world_size);
                    self.gathering.configured(c.generation, c.rank, &tx);
                    // As a worker's session does: a hub opens the
                    // generation (on the listener the fakes share), a
                    // follower dials its hub.
                    link = None;
                    own_rank = c.rank;
                    if let Some(hub) = &hub {
                        match &c.relay {
                            Some(r) if !r.followers.is_empty() => {
                                hub.open(&c.job_id, c.generation, &r.token, &r.followers)
                            }
                            Some(r) if !r.hub_addr.is_empty() => {
                                let me = accrue_relay::Follower {
                                    job: c.job_id.clone(),
                                    generation: c.generation,
                                    rank: c.rank,
                                    key: r.token.clone(),
                                };
                                link = Some(accrue_relay::dial(
                                    r.hub_addr.clone(),
                                    me,
                                    Duration::from_secs(10),
                                    RELAY_MAX_FRAME,
                                ));
                            }
                            _ => {}
                        }
                    }
                    Out::Ready(wire::Ready {
                        job_id: c.job_id,
                        generation: c.generation,
                        step: c.step,
                    })
                }
                Some(In::StepPlan(p)) => {
                    self.tally.plan_bytes.fetch_add(bytes, Ordering::Relaxed);
                    self.tally.plans.fetch_add(1, Ordering::Relaxed);
                    if p.rank == 0 {
                        self.step_tx.send_replace(p.step);
                    }
                    // A worker's compute, without its CPU: the heartbeats
                    // go on (their own task); later messages wait, as a
                    // real worker's queued work does.
                    if !self.step_time.is_zero() && p.kind == wire::PlanKind::Train as i32 {
                        tokio::time::sleep(self.step_time).await;
                    }
                    let result = wire::StepResult {
                        sums: Some(counted(&p)),
                        job_id: p.job_id,
                        generation: p.generation,
                        step: p.step,
                        rank: p.rank,
                        logps: Vec::new(),
                        nonfinite_microbatches: Vec::new(),
                    };
                    match gather.filter(|&w| w > 1 && p.kind == wire::PlanKind::Train as i32) {
                        None => {
                            self.tally.results.fetch_add(1, Ordering::Relaxed);
                            Out::StepResult(result)
                        }
                        Some(world) => {
                            let Some((rank0, batch)) = self.gathering.deposit(result, world) else {
                                continue;
                            };
                            self.tally.results.fetch_add(1, Ordering::Relaxed);
                            // Rank 0's session may have ended (a bounce).
                            let _ = rank0.send(msg(Out::StepResults(batch))).await;
                            continue;
                        }
                    }
                }
                Some(In::CheckpointRequest(c)) => Out::CheckpointDone(wire::CheckpointDone {
                    job_id: c.job_id,
                    step: c.step,
                    rank: 0,
                    path: c.dir,
                }),
                Some(In::Relay(r)) => {
                    self.tally.relays.fetch_add(1, Ordering::Relaxed);
                    if let Some(hub) = &hub {
                        own.extend(hub.forward(r, own_rank));
                    }
                    continue;
                }
                Some(In::Release(_)) => break false,
                _ => continue,
            };
            if tx.send(msg(reply)).await.is_err() {
                break true;
            }
        };
        heartbeats.abort();
        if ended {
            self.tally.lost.fetch_add(1, Ordering::Relaxed);
        }
        Ok(None)
    }
}

/// The sums a real worker reports for plan `p`: its microbatches, tokens,
/// documents (at their first sequence) and loss tokens (per sequence, the
/// labels after the first that are not ignored), a loss of 1 per token.
fn counted(p: &wire::StepPlan) -> wire::MetricSums {
    let mut s = wire::MetricSums {
        microbatches: p.microbatches.len() as u32,
        grad_norm: 1.0,
        ..Default::default()
    };
    for m in &p.microbatches {
        s.tokens += m.token_ids.len() as u64 / 4;
        s.documents += m.sequences.iter().filter(|q| q.role == 0).count() as u64;
        let ids = accrue_proto::unpack_u32(&m.token_ids).unwrap_or_default();
        let labels =
            accrue_proto::microbatch_labels(&ids, &m.labels, &m.loss_mask).unwrap_or_default();
        for w in m.cu_seq_lens.windows(2) {
            let seq = labels.get(w[0] as usize..w[1] as usize).unwrap_or(&[]);
            s.loss_tokens += seq.iter().skip(1).filter(|&&l| l != -100).count() as u64;
        }
    }
    s.loss_sum = s.loss_tokens as f64;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small run end to end: the generation forms, the steps are
    /// measured with plans checked by the coordinator (no fake is refused),
    /// and each re-formation brings the leaving fake back as a member of a
    /// new generation that trains.
    #[test]
    fn a_small_swarm_trains_and_re_forms_its_generation() {
        for (per_rank_results, relay) in [(false, false), (true, false), (false, true)] {
            let dir = tempfile::tempdir().unwrap();
            let opts = ControlBenchOpts {
                workers: 4,
                docs: 2_000,
                docs_per_worker: 4,
                // Enough that a step's messages early or late at either
                // edge of the window stay inside the bounds below.
                steps: 10,
                warmup: 1,
                reforms: 2,
                per_rank_results,
                fake_step_ms: 0,
                relay_min_world: if relay { 2 } else { 0 },
                work: dir.path().to_path_buf(),
            };
            let row = control_plane(&opts).unwrap();
            assert_eq!(row.workers_lost, 0, "{row:?}");
            assert_eq!(
                row.generations, 3,
                "one, then one per re-formation: {row:?}"
            );
            assert_eq!(row.docs_per_step, 16);
            assert!(row.plan_ms_per_step > 0.0, "{row:?}");
            assert!(row.reform_ms > 0.0, "{row:?}");
            assert!(row.plan_bytes_per_worker_per_step > 0.0, "{row:?}");
            assert!(row.step_record_bytes > 0.0, "{row:?}");
            // One step's results arrive per step: all four gathered in one
            // message, or one message per rank (the window's edges may
            // catch a step's messages early or late: at most one step's).
            let per_step = row.result_messages_per_step;
            match per_rank_results {
                true => assert!((2.5..=6.0).contains(&per_step), "{row:?}"),
                false => assert!((0.5..1.5).contains(&per_step), "{row:?}"),
            }
            // A plan per rank, or one relay per hub (ranks 0 and 2 of four,
            // each with its own plan and its follower's): 4 or 2 a step.
            let sent = row.plan_messages_per_step;
            match relay {
                false => assert!((3.5..=4.5).contains(&sent), "{row:?}"),
                true => assert!((1.5..=2.5).contains(&sent), "{row:?}"),
            }
        }
    }

    /// With a simulated step time, a step takes at least that long and the
    /// gap is the rest of its wall time.
    #[test]
    fn a_simulated_step_time_is_waited_for_and_taken_out_of_the_gap() {
        let dir = tempfile::tempdir().unwrap();
        let opts = ControlBenchOpts {
            workers: 2,
            docs: 500,
            docs_per_worker: 4,
            steps: 8,
            warmup: 1,
            reforms: 0,
            per_rank_results: false,
            fake_step_ms: 40,
            relay_min_world: 0,
            work: dir.path().to_path_buf(),
        };
        let row = control_plane(&opts).unwrap();
        assert_eq!(row.workers_lost, 0, "{row:?}");
        assert_eq!(row.fake_step_ms, 40);
        // Each step waits for its fakes' 40 ms (less at most a step's worth
        // of the window's edges, spread over its 8 steps).
        assert!(row.step_ms >= 40.0 * 7.0 / 8.0, "{row:?}");
        assert!(
            (row.gap_ms_per_step - (row.step_ms - 40.0)).abs() < 1e-9,
            "{row:?}"
        );
        // 40 ms is ample time to plan the next step while one runs: the
        // steps go out as planned ahead (a slow machine may miss a few).
        assert!(row.sent_ahead_share >= 0.75, "{row:?}");
    }
}
