//! The runner thread's handle: queue work, flag aborts (interrupting the
//! in-flight collective), join on shutdown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use tracing::info;

use super::thread::{lock, InFlight, PlanKey, Thread};
use super::weight_server::Cmd;
use super::work::{Factory, Progress, RunnerConfig, Work};
use super::writer::Writer;
use crate::wire;

/// The runner thread's handle: queue work, flag aborts, join on shutdown.
pub struct Runner {
    queue: Option<mpsc::Sender<Work>>,
    /// The last aborted plan.
    aborted: Arc<Mutex<Option<PlanKey>>>,
    in_flight: Arc<Mutex<InFlight>>,
    progress: Arc<Progress>,
    /// Work queued or running, and checkpoint writes in flight.
    pending: Arc<AtomicUsize>,
    /// Why the thread died (a panic outside a plan), if it did.
    died: Arc<Mutex<Option<String>>>,
    /// ReplicatedTrainer rank 0's weight server, when it serves one.
    weight_tx: Arc<Mutex<Option<std::sync::mpsc::Sender<Cmd>>>>,
    thread: Option<JoinHandle<()>>,
}

impl Runner {
    /// Starts the thread for world size 1 ([`RunnerConfig::new`]).
    pub fn spawn(factory: Factory, out: UnboundedSender<wire::WorkerMessage>) -> Runner {
        Runner::start(RunnerConfig::new(factory), out)
    }

    /// Starts the thread; its answers go to `out`.
    pub fn start(cfg: RunnerConfig, out: UnboundedSender<wire::WorkerMessage>) -> Runner {
        let (queue, rx) = mpsc::channel::<Work>();
        let aborted = Arc::new(Mutex::new(None));
        let in_flight = Arc::new(Mutex::new(InFlight::default()));
        let progress = Arc::new(Progress::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let left = pending.clone();
        let (a, p, f) = (aborted.clone(), progress.clone(), in_flight.clone());
        let died = Arc::new(Mutex::new(None));
        let dead = died.clone();
        let weight_tx = Arc::new(Mutex::new(None));
        let wtx = weight_tx.clone();
        let writes = pending.clone();
        // The trainer is built and lives on the thread: libtorch state
        // need not be Send.
        let thread = std::thread::Builder::new()
            .name("accrue-runner".into())
            .spawn(move || {
                let mut state = Thread {
                    factory: cfg.factory,
                    connector: cfg.connector,
                    listener: cfg.listener,
                    device: cfg.device,
                    out,
                    aborted: a,
                    in_flight: f,
                    progress: p,
                    job: None,
                    last_done: Instant::now(),
                    writer: Writer::new(writes),
                    weights: None,
                    weight_tx: wtx,
                    weight_ring: None,
                };
                while let Ok(w) = rx.recv() {
                    let what = w.name();
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        state.handle(w);
                    }));
                    if let Err(payload) = handled {
                        // Plans catch their own panics; one here (configure,
                        // checkpoint, publish) leaves the replica in an
                        // unknown state: report it, then stop, and the
                        // session ends the process with an error.
                        let e = crate::error::from_panic(payload.as_ref());
                        let why = format!("the training thread panicked handling {what}: {e:#}");
                        *lock(&dead) = Some(why.clone());
                        state.fatal(&why);
                        left.fetch_sub(1, Ordering::SeqCst);
                        break;
                    }
                    // After the answer is sent: zero means all answers are out.
                    left.fetch_sub(1, Ordering::SeqCst);
                }
                // Pending checkpoint writes finish before the thread ends.
                state.writer.wait();
            })
            .expect("spawning the runner thread");
        Runner {
            queue: Some(queue),
            aborted,
            in_flight,
            progress,
            pending,
            died,
            weight_tx,
            thread: Some(thread),
        }
    }

    /// Queues work. An abort also takes effect at once: between the current
    /// step's microbatches, and, when that step is the one running, by
    /// interrupting its collective (a peer may be frozen). A configure of a
    /// newer generation aborts a step of an older one still running.
    pub fn submit(&self, work: Work) {
        // ReplicatedTrainer rank 0 sends the policy from its weight server, never
        // behind the steps queued here.
        let work = match work {
            Work::Sync(s) => match lock(&self.weight_tx).as_ref() {
                Some(tx) => match tx.send(Cmd::Sync(s)) {
                    Ok(()) => return,
                    Err(std::sync::mpsc::SendError(Cmd::Sync(s))) => Work::Sync(s),
                    Err(_) => return,
                },
                None => Work::Sync(s),
            },
            other => other,
        };
        let target = match &work {
            Work::Abort(a) => Some(PlanKey {
                job: a.job_id.clone(),
                generation: a.generation,
                step: a.step,
            }),
            // A newer generation (or another job) ends the running step of
            // an older one.
            Work::Configure(c) => lock(&self.in_flight)
                .running
                .clone()
                .filter(|k| k.job != c.job_id || k.generation < c.generation),
            _ => None,
        };
        if let Some(key) = target {
            *lock(&self.aborted) = Some(key.clone());
            let f = lock(&self.in_flight);
            if f.running.as_ref() == Some(&key) {
                if let Some((g, abort)) = &f.collective {
                    if *g == key.generation {
                        let (generation, step) = (key.generation, key.step);
                        info!(generation, step, "aborting the in-flight collective");
                        abort();
                    }
                }
            }
        }
        if let Some(q) = &self.queue {
            self.pending.fetch_add(1, Ordering::SeqCst);
            // The thread only ends on shutdown; a send error cannot happen before.
            let _ = q.send(work);
        }
    }

    /// Work items queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Why the runner thread died, if it did: the worker cannot go on.
    pub fn died(&self) -> Option<String> {
        lock(&self.died).clone()
    }

    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Finishes the queued work (a final checkpoint included) and joins.
    pub fn shutdown(mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
