//! State sync between live members (issue 6, "recovery of model state"):
//! ranks train a few steps, the membership changes, and members without
//! state (or whose shard layout changes) get it over the new generation's
//! collective — no disk. The strongest check: the final parameters and
//! AdamW moments equal those of one process training every step's
//! documents in one microbatch (the update does not depend on world size).
//! Ranks are threads (one per worker, kept across generations) joined by
//! `LocalGroup`; the final state is read back through a checkpoint the
//! last generation writes.

mod common;

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use accrue_worker::batch::PackedBatch;
use accrue_worker::collective::local::LocalGroup;
use accrue_worker::collective::reshard::SyncPlan;
use accrue_worker::collective::Collective;
use accrue_worker::config::JobConfig;
use accrue_worker::runner::{default_factory, run_step, StepOutcome};
use accrue_worker::train::{ReplicatedTrainer, Trainer};
use accrue_worker::wire;

/// Relative per-tensor tolerance: parameters (measured ≤ 2e-7).
const TOL: f64 = 1e-6;
/// AdamW moments (measured ≤ 7e-7: second moments square the rounding).
const MOMENT_TOL: f64 = 2e-6;
const LR: f64 = 1e-3;

type Docs = Vec<(Vec<i64>, Vec<i64>)>;

fn steps() -> Vec<Docs> {
    [
        (&[37usize, 5, 61, 12, 2, 28][..], 31u64),
        (&[50, 3, 17, 8, 33][..], 32),
        (&[21, 64, 6, 7, 7, 40, 11][..], 33),
        (&[9, 30, 14, 22][..], 34),
    ]
    .iter()
    .map(|(l, s)| common::synthetic_documents(l, *s))
    .collect()
}

/// Rank `rank` of `world`'s plan for a step: every `world`-th document,
/// split over two microbatches (one may be padding).
fn plan(docs: &Docs, step: u64, rank: usize, world: usize) -> wire::StepPlan {
    let mine: Docs = docs.iter().skip(rank).step_by(world).cloned().collect();
    let half = mine.len() / 2;
    wire::StepPlan {
        job_id: "j".into(),
        step,
        rank: rank as u32,
        lr: LR,
        normalizers: Some(wire::Normalizers {
            loss_tokens: PackedBatch::from_documents(docs).loss_tokens(),
            ..Default::default()
        }),
        microbatches: vec![
            common::to_wire(&mine[..half]),
            common::to_wire(&mine[half..]),
        ],
        kind: wire::PlanKind::Train as i32,
        ..Default::default()
    }
}

enum Cmd {
    /// Join a generation: the collective and, for state sync, the plan.
    Join(Box<dyn Collective>, Option<SyncPlan>),
    Step(Box<wire::StepPlan>),
    Save(PathBuf),
}

/// One worker: a thread holding its executor across generations.
struct Worker {
    tx: mpsc::Sender<Cmd>,
    done: mpsc::Receiver<Result<(), String>>,
}

impl Worker {
    fn spawn(cfg: JobConfig) -> Worker {
        let (tx, rx) = mpsc::channel::<Cmd>();
        let (done_tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            tch::set_num_threads(1);
            let factory = default_factory();
            let mut exec: Option<Box<dyn Trainer>> = None;
            for cmd in rx {
                let r: anyhow::Result<()> = (|| {
                    match cmd {
                        Cmd::Join(coll, sync) => {
                            if let Some(e) = exec.as_mut() {
                                match sync {
                                    Some(p) => e.sync_state(Some(coll), &p)?,
                                    None => e.set_collective(coll)?,
                                }
                            } else {
                                let mut e = factory(&cfg, None, coll)?;
                                if let Some(p) = sync {
                                    e.sync_state(None, &p)?;
                                }
                                exec = Some(e);
                            }
                        }
                        Cmd::Step(p) => {
                            let e = exec.as_mut().expect("joined");
                            match run_step(e.as_mut(), &p, 0.0, &|| false) {
                                StepOutcome::Done(_) => {}
                                other => anyhow::bail!("step {}: {other:?}", p.step),
                            }
                        }
                        Cmd::Save(dir) => {
                            let write = exec.as_mut().expect("joined").checkpoint_snapshot()?;
                            write(&dir)?;
                        }
                    }
                    Ok(())
                })();
                let _ = done_tx.send(r.map_err(|e| format!("{e:#}")));
            }
        });
        Worker { tx, done }
    }

    fn wait(&self) {
        self.done.recv().unwrap().unwrap();
    }
}

/// `members[new rank] = worker index`; `priors[new rank]` as in Configure.
struct Generation {
    members: Vec<usize>,
    priors: Vec<Option<(usize, usize)>>,
    steps: std::ops::Range<usize>,
}

/// Runs the generations over the workers; returns the final checkpoint dir.
fn run(cfg: &JobConfig, gens: &[Generation], dir: &Path, sync: bool) -> PathBuf {
    let docs = steps();
    let n = gens.iter().flat_map(|g| g.members.iter()).max().unwrap() + 1;
    let workers: Vec<Worker> = (0..n).map(|_| Worker::spawn(cfg.clone())).collect();
    let sharded = cfg.sharding != accrue_worker::config::Sharding::Ddp;
    let mut first = true;
    for g in gens {
        let world = g.members.len();
        // As the runner decides: someone lacks the state, or a shard moves.
        let needs_sync = sync
            && !first
            && g.priors.iter().enumerate().any(|(r, p)| match p {
                None => true,
                Some(l) => sharded && *l != (r, world),
            });
        for (coll, &w) in LocalGroup::new(world).into_iter().zip(&g.members) {
            let plan = needs_sync.then(|| SyncPlan {
                priors: g.priors.clone(),
                chunk: 1000,
            });
            workers[w].tx.send(Cmd::Join(Box::new(coll), plan)).unwrap();
        }
        for &w in &g.members {
            workers[w].wait();
        }
        first = false;
        for s in g.steps.clone() {
            for (rank, &w) in g.members.iter().enumerate() {
                let p = plan(&docs[s], s as u64 + 1, rank, world);
                workers[w].tx.send(Cmd::Step(Box::new(p))).unwrap();
            }
            for &w in &g.members {
                workers[w].wait();
            }
        }
    }
    let last = gens.last().unwrap();
    let out = dir.join("final");
    for &w in &last.members {
        workers[w].tx.send(Cmd::Save(out.clone())).unwrap();
    }
    for &w in &last.members {
        workers[w].wait();
    }
    out
}

/// One process, each step's documents in one microbatch.
fn reference(cfg: &JobConfig) -> ReplicatedTrainer {
    let mut t = ReplicatedTrainer::single(cfg, None).unwrap();
    for docs in steps() {
        let b = PackedBatch::from_documents(&docs);
        t.microbatch(0, &b, b.loss_tokens()).unwrap();
        t.optimizer_step(LR).unwrap();
    }
    t
}

fn check(label: &str, ddp_cfg: &JobConfig, out: &Path, want: &mut ReplicatedTrainer) {
    let mut got = ReplicatedTrainer::single(ddp_cfg, Some(out)).unwrap();
    let (pw, pn) = common::worst_rel(&got.named_parameters(), &want.named_parameters());
    println!("{label}: worst parameter difference {pw:e} ({pn})");
    assert!(pw <= TOL, "{label}: parameter {pn} differs by {pw:e}");
    let (gs, gm) = got.optimizer_state().unwrap();
    let (ws, wm) = want.optimizer_state().unwrap();
    assert_eq!(gs, ws, "{label}: optimizer step count");
    let moments = |m: &[(String, tch::Tensor, tch::Tensor)], which: usize| {
        m.iter()
            .map(|(n, a, s)| (n.clone(), if which == 0 { a } else { s }.copy()))
            .collect::<Vec<_>>()
    };
    for which in 0..2 {
        let (mw, mn) = common::worst_rel(&moments(&gm, which), &moments(&wm, which));
        println!("{label}: worst moment {which} difference {mw:e} ({mn})");
        assert!(
            mw <= MOMENT_TOL,
            "{label}: moment {which} of {mn} differs by {mw:e}"
        );
    }
}

fn scenario(sharding: &str, label: &str, gens: &[Generation]) {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(
        dir.path(),
        &format!("[parallel]\nsharding = \"{sharding}\"\n"),
    );
    let ddp_cfg = common::random_job(dir.path(), "");
    let out = run(&cfg, gens, dir.path(), true);
    let mut want = reference(&ddp_cfg);
    check(&format!("{sharding} {label}"), &ddp_cfg, &out, &mut want);
}

/// 2 ranks train 2 steps; a third joins (state sync; the holders'
/// layout changes from 2 to 3 shards) and all three train 2 more.
fn grow() -> Vec<Generation> {
    vec![
        Generation {
            members: vec![0, 1],
            priors: vec![None, None],
            steps: 0..2,
        },
        Generation {
            members: vec![0, 1, 2],
            priors: vec![Some((0, 2)), Some((1, 2)), None],
            steps: 2..4,
        },
    ]
}

/// 3 ranks train 2 steps; the same three come back with ranks permuted
/// (every shard moves), then 2 steps more.
fn permute() -> Vec<Generation> {
    vec![
        Generation {
            members: vec![0, 1, 2],
            priors: vec![None; 3],
            steps: 0..2,
        },
        Generation {
            members: vec![2, 0, 1],
            priors: vec![Some((2, 3)), Some((0, 3)), Some((1, 3))],
            steps: 2..4,
        },
    ]
}

#[test]
fn ddp_joiner_gets_the_replica_by_broadcast() {
    scenario("ddp", "2 → 3", &grow());
}

#[test]
fn ddp_survivors_continue_without_reloading() {
    // 3 → 2: whole replicas at any rank, nothing moves.
    let gens = vec![
        Generation {
            members: vec![0, 1, 2],
            priors: vec![None; 3],
            steps: 0..2,
        },
        Generation {
            members: vec![0, 2],
            priors: vec![Some((0, 3)), Some((2, 3))],
            steps: 2..4,
        },
    ];
    scenario("ddp", "3 → 2", &gens);
}

#[test]
fn zero2_reshards_the_moments_for_a_joiner() {
    scenario("zero2", "2 → 3", &grow());
}

#[test]
fn zero2_reshards_when_ranks_are_permuted() {
    scenario("zero2", "3 → 3 permuted", &permute());
}

#[test]
fn fsdp_reshards_parameters_and_moments_for_a_joiner() {
    scenario("fsdp", "2 → 3", &grow());
}

#[test]
fn fsdp_reshards_when_ranks_are_permuted() {
    scenario("fsdp", "3 → 3 permuted", &permute());
}

#[test]
fn fsdp_3_to_2_is_a_state_sync_error_naming_the_missing_shard() {
    // Only shards 0 and 2 of 3 survive: nothing in memory can rebuild
    // shard 1 (the coordinator restores from a checkpoint instead).
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(dir.path(), "[parallel]\nsharding = \"fsdp\"\n");
    let plan = SyncPlan {
        priors: vec![Some((0, 3)), Some((2, 3))],
        chunk: 1000,
    };
    let handles: Vec<_> = LocalGroup::new(2)
        .into_iter()
        .map(|coll| {
            let (cfg, plan) = (cfg.clone(), plan.clone());
            std::thread::spawn(move || {
                let mut e = default_factory()(&cfg, None, Box::new(coll)).unwrap();
                e.sync_state(None, &plan).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert!(e.contains("shard 1 of 3"), "{e}");
    }
}

#[test]
fn a_joiner_without_state_sync_fails_the_check() {
    // The control: the third rank trains from the model's init instead.
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::random_job(dir.path(), "");
    let out = run(&cfg, &grow(), dir.path(), false);
    let got = ReplicatedTrainer::single(&cfg, Some(&out)).unwrap();
    let want = reference(&cfg);
    let (pw, pn) = common::worst_rel(&got.named_parameters(), &want.named_parameters());
    println!("no sync: worst parameter difference {pw:e} ({pn})");
    assert!(
        pw > 100.0 * TOL,
        "skipping the sync should show, got {pw:e}"
    );
}
