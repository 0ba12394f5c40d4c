//! A restarted coordinator: the jobs it restores wait for their last
//! generation's members, which continue from what they hold or restore and
//! replay; exactly once over a run with losses, joins and replays.

use super::*;

/// Runs a job to committed step 3 (checkpoint at 2) and hands back what a
/// restarted coordinator reads from its store, plus the held states the
/// workers report when they re-register.
pub(super) fn run_then_restart(
    sharding: Sharding,
) -> (Sim, JobRecord, Vec<CommittedStep>, Vec<HeldState>) {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit(
        with(spec("steps = 6", "docs_per_step = 4", 2, 2), sharding, 2),
        docs(30),
    );
    s.run_until(|s| s.committed.len() == 3);
    let rec = s.persisted.last().unwrap().clone();
    assert_eq!(rec.step, 3);
    let history = s
        .committed
        .iter()
        .filter(|(m, _)| m.step > rec.history_from)
        .map(|(m, docs)| CommittedStep {
            step: m.step,
            lr: m.lr,
            docs: docs.clone().into(),
            cursor_after: m.cursor.clone(),
        })
        .collect();
    let held = ["a", "b"]
        .iter()
        .map(|w| s.c.worker(w).unwrap().held.clone().unwrap())
        .collect();
    (s, rec, history, held)
}

pub(super) fn restarted(rec: &JobRecord, history: Vec<CommittedStep>, sharding: Sharding) -> Sim {
    let mut r = Sim::new();
    r.handle(Event::RestoreJob {
        rec: Box::new(rec.clone()),
        spec: Arc::new(with(
            spec("steps = 6", "docs_per_step = 4", 2, 2),
            sharding,
            2,
        )),
        docs: docs(30),
        reference: Default::default(),
        history,
    })
    .unwrap();
    r
}

impl Sim {
    /// Lets a restarted coordinator's wait for old members run out.
    pub(super) fn after_rejoin_grace(&mut self) {
        self.now += CoordinatorOptions::default().rejoin_grace_ms;
        let alive: Vec<WorkerId> = self
            .c
            .workers()
            .filter(|w| w.connected() && !self.dead.contains(&w.id))
            .map(|w| w.id.clone())
            .collect();
        for worker in alive {
            self.handle(heartbeat(worker)).unwrap();
        }
        self.handle(Event::Tick { stalled_ms: 0 }).unwrap();
    }

    pub(super) fn worker_holding(&mut self, id: &str, held: Option<HeldState>) {
        self.handle(Event::RegisterWorker {
            id: id.into(),
            reg: Registration {
                hostname: "h".into(),
                collective_addr: format!("127.0.0.1:1{id}"),
                relay_addr: format!("127.0.0.1:2{id}"),
                held,
                ..Default::default()
            },
        })
        .unwrap();
        self.handle(Event::SessionOpened { worker: id.into() })
            .unwrap();
    }
}

#[test]
fn after_a_coordinator_restart_workers_holding_the_committed_step_continue() {
    for sharding in [Sharding::Ddp, Sharding::Fsdp] {
        let (full, rec, history, held) = run_then_restart(sharding);
        assert!(held.iter().all(|h| h.step == 3));
        let mut r = restarted(&rec, history, sharding);
        r.worker_holding("a", Some(held[0].clone()));
        r.worker_holding("b", Some(held[1].clone()));
        let gen = r.configures_of(rec.generation + 1);
        assert_eq!(gen.len(), 2, "{sharding:?}");
        assert!(gen.iter().all(|c| c.step == 3 && c.restore_from.is_none()));
        assert!(gen[0].priors.iter().all(Option::is_some));
        r.run();
        assert_eq!(r.state(), JobState::Completed);
        assert!(r.replayed().is_empty());
        let steps: Vec<u64> = r.committed.iter().map(|(m, _)| m.step).collect();
        assert_eq!(steps, vec![4, 5, 6]);
        drop(full);
    }
}

#[test]
fn after_a_restart_a_sharded_job_missing_a_rank_restores_and_replays() {
    let (full, rec, history, held) = run_then_restart(Sharding::Fsdp);
    let mut r = restarted(&rec, history, Sharding::Fsdp);
    r.worker_holding("a", Some(held[0].clone()));
    r.worker("z");
    assert!(
        r.configures.is_empty(),
        "b may still come back with its shard"
    );
    let reason = r.c.job("job").unwrap().rec.reason.clone();
    assert!(reason.contains("1 member(s) of generation"), "{reason}");
    r.after_rejoin_grace(); // b never came back
    let gen = r.configures_of(rec.generation + 1);
    assert!(gen.iter().all(|c| c.step == 2
        && c.restore_from
            .as_ref()
            .is_some_and(|d| d.ends_with("step-2"))));
    r.run();
    assert_eq!(r.state(), JobState::Completed);
    let replayed = r.replayed();
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].docs, full.committed[2].1, "step 3's manifest");
    let steps: Vec<u64> = r.committed.iter().map(|(m, _)| m.step).collect();
    assert_eq!(steps, vec![4, 5, 6]);
}

/// Losses, joins and a drain over two epochs, under ddp and fsdp: every
/// document of each epoch is committed exactly once, and replays re-run
/// exactly the committed documents.
#[test]
fn exactly_once_over_a_run_with_losses_joins_and_replays() {
    let runs = [Sharding::Ddp, Sharding::Fsdp, Sharding::Zero2]
        .into_iter()
        .flat_map(|sharding| [(sharding, false), (sharding, true)]);
    for (sharding, gather) in runs {
        let mut s = Sim::new();
        s.gather = gather;
        s.worker("a");
        s.worker("b");
        let d = docs(53);
        s.submit(
            with(spec("epochs = 2", "docs_per_step = 5", 1, 3), sharding, 3),
            d.clone(),
        );
        let at = |n: usize| move |s: &Sim| s.committed.len() >= n;
        s.run_until(at(4));
        s.worker("c"); // 2 → 3
        s.run_until(at(7));
        s.kill("b"); // mid-step, stale plans still queued
        s.run_until(at(9));
        s.worker("d");
        s.run_until(at(11));
        s.handle(Event::DrainWorker { worker: "a".into() }).unwrap();
        s.run_until(at(14));
        s.kill("c");
        s.worker("e");
        s.run();
        assert_eq!(
            s.state(),
            JobState::Completed,
            "{sharding:?}, gather {gather}"
        );
        assert_exactly_once(&s, &d, 2);
        if sharding == Sharding::Ddp {
            assert!(s.replayed().is_empty(), "ddp never restores");
        } else {
            assert!(
                !s.replayed().is_empty(),
                "{sharding:?} restores and replays"
            );
        }
    }
}
