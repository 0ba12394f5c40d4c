//! Issue 19's W = 4096 failure in miniature: the state lock held longer
//! than the heartbeat timeout while workers keep heartbeating. Their
//! heartbeats sit unread until the lock is free; the coordinator's own
//! stall must not be counted as their silence. A worker that really went
//! silent must still be lost.

use std::sync::Arc;
use std::time::Duration;

use accrue_proto::v1 as wire;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use wire::worker_message::Msg as Out;

use super::{Server, ServerConfig};
use crate::core::WorkerState;
use crate::shell::service::Shared;

const INTERVAL_MS: u64 = 100;
const TIMEOUT_MS: i64 = 1_000;

/// A registered worker with an open session; heartbeats every
/// [`INTERVAL_MS`] while `beating` (dropping the returned sender's last
/// clone would close the session: the silent worker keeps it open).
async fn worker(url: &str, beating: bool) -> (String, mpsc::Sender<wire::WorkerMessage>) {
    let mut c = wire::worker_service_client::WorkerServiceClient::connect(url.to_string())
        .await
        .unwrap();
    let id = c
        .register(wire::RegisterRequest {
            hostname: "h".into(),
            device: "cpu".into(),
            collective_addr: "127.0.0.1:1".into(),
            protocol: accrue_proto::PROTOCOL,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .worker_id;
    let (tx, rx) = mpsc::channel(64);
    let msg = |m| wire::WorkerMessage { msg: Some(m) };
    tx.send(msg(Out::Hello(wire::Hello {
        worker_id: id.clone(),
    })))
    .await
    .unwrap();
    let mut inbound = c
        .session(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });
    if beating {
        let beat = tx.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(INTERVAL_MS));
            loop {
                every.tick().await;
                if beat
                    .send(msg(Out::Heartbeat(wire::Heartbeat::default())))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
    (id, tx)
}

fn state(shared: &Shared, id: &str) -> WorkerState {
    shared.lock().core.worker(id).expect("registered").state
}

#[test]
fn a_lock_held_past_the_heartbeat_timeout_loses_no_heartbeating_worker() {
    // The coordinator on its own runtime, as in production: when the lock
    // is held, its threads block on it and read no heartbeats.
    let coord = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path().join("state"));
    cfg.heartbeat_interval_ms = INTERVAL_MS as u32;
    cfg.heartbeat_timeout_ms = TIMEOUT_MS;
    cfg.tick_ms = 20;
    let server = coord.block_on(Server::bind(cfg)).unwrap();
    let url = format!("http://{}", server.local_addr());
    let shared: Arc<Shared> = server.shared();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = coord.spawn(server.run(stop.clone()));

    let (beating, silent) = clients.block_on(async {
        let mut beating = Vec::new();
        for _ in 0..4 {
            beating.push(worker(&url, true).await);
        }
        (beating, worker(&url, false).await)
    });
    let live = |id: &str| state(&shared, id) == WorkerState::Idle;
    assert!(beating.iter().all(|(id, _)| live(id)) && live(&silent.0));

    // Held three heartbeat timeouts, as a big step's planning holds it.
    {
        let _held = shared.lock();
        std::thread::sleep(Duration::from_millis(3 * TIMEOUT_MS as u64));
        // The sessions kept reading heartbeats meanwhile: they wait for
        // the tick, not for the lock.
        let queued = shared.queued_heartbeats();
        assert!(queued >= 4 * 10, "{queued} heartbeats read during the hold");
    }
    // Ticks after the stall, with the heartbeats read meanwhile.
    std::thread::sleep(Duration::from_millis(TIMEOUT_MS as u64 / 2));
    for (id, _) in &beating {
        assert_eq!(
            state(&shared, id),
            WorkerState::Idle,
            "worker {id} was lost during the coordinator's own stall"
        );
    }

    // The silent one is lost once it has been silent a timeout while the
    // coordinator listened (not before the stall's credit runs out).
    std::thread::sleep(Duration::from_millis(2 * TIMEOUT_MS as u64));
    assert_eq!(state(&shared, &silent.0), WorkerState::Lost);
    for (id, _) in &beating {
        assert_eq!(state(&shared, id), WorkerState::Idle);
    }
    stop.cancel();
    let _ = coord.block_on(served);
    drop((beating, silent));
    clients.shutdown_timeout(Duration::from_secs(1));
    coord.shutdown_timeout(Duration::from_secs(1));
}
