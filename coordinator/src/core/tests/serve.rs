//! Scenario tests of a served job's endpoint calls (`[rl.serve]`): calls
//! go to the idle training workers between steps, a step due goes first,
//! a round lost with its generation is dealt again with the same seeds,
//! and every call is answered once.

use super::stream::{groups, stream_spec};
use super::*;
use crate::rl::serve::{ServeFull, ServeRequest, SERVE_FILE};

fn served_spec(max_waiting: u32) -> JobSpec {
    let mut sp = stream_spec("steps = 2", 2, 2, 8);
    sp.rl.serve = Some(crate::job::serve::ServeSection {
        max_waiting,
        ..Default::default()
    });
    sp
}

fn call(id: u64) -> Event {
    Event::Serve {
        job: "job".into(),
        request: ServeRequest {
            id,
            prompt_ids: vec![1, 2, id as u32].into(),
            seed: 1000 + id,
            sampling: Arc::new(Default::default()),
            stop_ids: vec![257].into(),
        },
    }
}

/// The serve requests sent to workers so far: (call, seed).
fn dealt(s: &Sim) -> Vec<(u64, u64)> {
    s.rounds
        .iter()
        .flat_map(|(_, p)| p.requests.iter())
        .filter(|r| r.prompt.file == SERVE_FILE)
        .map(|r| (r.prompt.line, r.seed))
        .collect()
}

#[test]
fn calls_run_between_steps_and_a_lost_round_is_dealt_again_with_its_seeds() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    s.submit_stream(served_spec(8));
    s.run();
    assert_eq!(s.state(), JobState::Running);
    assert_eq!(s.c.job("job").unwrap().gen().unwrap().world_size(), 2);
    // Idle, no step due: a call goes out at once; those that come while
    // its round runs wait for the next, which takes them all.
    for id in 1..=3 {
        s.handle(call(id)).unwrap();
    }
    assert_eq!(dealt(&s), [(1, 1001)]);
    let ranks: BTreeSet<u32> = s.rounds.iter().map(|(r, _)| *r).collect();
    assert_eq!(ranks, BTreeSet::from([0, 1]), "every rank takes part");
    // A worker dies before answering: the next generation deals the lost
    // call again with its seed, beside the waiting ones; each is answered
    // once.
    s.kill("b");
    s.run();
    let mut ids: Vec<u64> = s.served.iter().map(|x| x.id).collect();
    ids.sort();
    assert_eq!(ids, [1, 2, 3], "every call answered once");
    let again: BTreeSet<(u64, u64)> = dealt(&s)[1..].iter().copied().collect();
    assert_eq!(again, BTreeSet::from([(1, 1001), (2, 1002), (3, 1003)]));
    assert!(s.served.iter().all(|x| x.policy_version == 0));
    // A step due goes first: calls queued while it trains wait for its
    // commit and are drawn by its policy.
    s.push(groups("g", 1, 0)).unwrap();
    let sent = s.rounds.len();
    assert!(
        s.c.job("job").unwrap().inflight().is_some(),
        "the step is out"
    );
    s.handle(call(4)).unwrap();
    assert_eq!(s.rounds.len(), sent, "no call goes out while a step trains");
    s.run();
    assert_eq!(s.committed.len(), 1);
    let last = s.served.last().unwrap();
    assert_eq!((last.id, last.policy_version), (4, 1));
    assert_eq!(s.served.len(), 4);
}

#[test]
fn calls_are_bounded_and_refused_by_a_job_that_serves_none() {
    let mut s = Sim::new();
    // No worker: the job waits for its generation, calls wait with it.
    s.submit_stream(served_spec(1));
    s.handle(call(1)).unwrap();
    let full = s.handle(call(2)).unwrap_err();
    assert_eq!(
        full,
        CoreError::ServeFull {
            job: "job".into(),
            full: ServeFull { waiting: 1, max: 1 }
        }
    );
    // The waiting call goes out once workers come.
    s.worker("a");
    s.run();
    assert_eq!(s.served.iter().map(|x| x.id).collect::<Vec<_>>(), [1]);
    let mut t = Sim::new();
    t.submit_stream(stream_spec("steps = 2", 2, 2, 8));
    assert_eq!(
        t.handle(call(1)).unwrap_err(),
        CoreError::NotServed("job".into())
    );
}
