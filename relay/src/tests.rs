use std::time::Duration;

use accrue_proto::v1 as wire;
use prost::Message;
use tokio::net::TcpListener;
use wire::coordinator_message::Msg;

use crate::{dial, Fault, Follower, Hub, HubOptions, LinkError};

const MAX: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(10);

async fn hub(
    connect_timeout: Duration,
) -> (Hub, tokio::sync::mpsc::UnboundedReceiver<Fault>, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let opts = HubOptions {
        connect_timeout,
        max_frame: MAX,
    };
    let (h, faults) = Hub::start(l, opts);
    (h, faults, addr)
}

const K: [u8; 32] = [7; 32];
const OTHER: [u8; 32] = [8; 32];

fn plan(generation: u64, step: u64) -> wire::CoordinatorMessage {
    wire::CoordinatorMessage {
        msg: Some(Msg::StepPlan(wire::StepPlan {
            job_id: "j".into(),
            generation,
            step,
            ..Default::default()
        })),
    }
}

fn relay(generation: u64, to: &[(u32, u64)]) -> wire::Relay {
    wire::Relay {
        job_id: "j".into(),
        generation,
        messages: to
            .iter()
            .map(|&(rank, step)| wire::Relayed {
                rank,
                message: plan(generation, step).encode_to_vec(),
            })
            .collect(),
    }
}

fn hello(rank: u32, key: &[u8]) -> Follower {
    Follower {
        job: "j".into(),
        generation: 3,
        rank,
        key: key.to_vec(),
    }
}

async fn next_step(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Result<wire::CoordinatorMessage, LinkError>>,
) -> Result<u64, LinkError> {
    let m = tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("in time")
        .expect("an item")?;
    match m.msg {
        Some(Msg::StepPlan(p)) => Ok(p.step),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn messages_reach_each_follower_in_order_whether_sent_before_or_after_it_connected() {
    let (hub, _faults, addr) = hub(WAIT).await;
    hub.open("j", 3, &K, &[1, 2]);
    // Before anyone connected: queued.
    // The hub's own messages come back to it, in order.
    let own = hub.forward(relay(3, &[(1, 10), (0, 1), (2, 20), (1, 11), (0, 2)]), 0);
    let steps: Vec<u64> = own
        .into_iter()
        .map(|m| match m.msg {
            Some(Msg::StepPlan(p)) => p.step,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(steps, [1, 2]);
    let mut one = dial(addr.clone(), hello(1, &K), WAIT, MAX);
    let mut two = dial(addr, hello(2, &K), WAIT, MAX);
    assert_eq!(next_step(&mut one).await, Ok(10));
    assert_eq!(next_step(&mut one).await, Ok(11));
    assert_eq!(next_step(&mut two).await, Ok(20));
    // Connected: straight through, still in order.
    hub.forward(relay(3, &[(2, 21), (1, 12), (2, 22)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(12));
    assert_eq!(next_step(&mut two).await, Ok(21));
    assert_eq!(next_step(&mut two).await, Ok(22));
}

#[tokio::test]
async fn a_wrong_token_or_generation_is_refused_and_the_follower_that_never_came_is_a_fault() {
    let (hub, mut faults, addr) = hub(Duration::from_millis(600)).await;
    hub.open("j", 3, &K, &[1]);
    hub.forward(relay(3, &[(1, 10)]), 0);
    let refused = |r: Result<u64, LinkError>| matches!(r, Err(LinkError::Connect { why, .. }) if why.contains("refused"));
    let mut wrong = dial(addr.clone(), hello(1, &OTHER), WAIT, MAX);
    let r = next_step(&mut wrong).await;
    assert!(refused(r.clone()), "{r:?}");
    let mut stale = hello(1, &K);
    stale.generation = 2;
    let mut old = dial(addr, stale, WAIT, MAX);
    let r = next_step(&mut old).await;
    assert!(refused(r.clone()), "{r:?}");
    let f = tokio::time::timeout(WAIT, faults.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((f.generation, f.rank), (3, 1));
    assert!(f.why.contains("did not connect"), "{f:?}");
}

#[tokio::test]
async fn a_new_generation_closes_the_old_ones_connections_and_drops_its_relays() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    hub.open("j", 3, &K, &[1]);
    let mut one = dial(addr.clone(), hello(1, &K), WAIT, MAX);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
    hub.open("j", 4, &OTHER, &[2]);
    assert_eq!(next_step(&mut one).await, Err(LinkError::Closed));
    // A late relay of generation 3 reaches nobody and blames nobody.
    hub.forward(relay(3, &[(1, 11)]), 0);
    let mut h = hello(2, &OTHER);
    h.generation = 4;
    let mut two = dial(addr, h, WAIT, MAX);
    hub.forward(relay(4, &[(2, 40)]), 0);
    assert_eq!(next_step(&mut two).await, Ok(40));
    assert!(faults.try_recv().is_err());
}

#[tokio::test]
async fn a_message_for_a_rank_that_is_not_a_follower_is_a_fault_naming_it() {
    let (hub, mut faults, _addr) = hub(WAIT).await;
    hub.open("j", 3, &K, &[1]);
    hub.forward(relay(3, &[(5, 10)]), 0);
    let f = faults.recv().await.unwrap();
    assert_eq!((f.generation, f.rank), (3, 5));
    assert!(f.why.contains("not a follower"), "{f:?}");
}

#[tokio::test]
async fn a_follower_gone_is_a_fault_naming_it_when_its_messages_cannot_be_written() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    hub.open("j", 3, &K, &[1]);
    let mut one = dial(addr, hello(1, &K), WAIT, MAX);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
    drop(one);
    // The first write after the close may still succeed (the peer's reset
    // comes back with it): keep sending until the hub notices.
    let f = tokio::time::timeout(WAIT, async {
        let mut step = 11;
        loop {
            hub.forward(relay(3, &[(1, step)]), 0);
            step += 1;
            if let Ok(f) = tokio::time::timeout(Duration::from_millis(20), faults.recv()).await {
                return f.unwrap();
            }
        }
    })
    .await
    .expect("a fault in time");
    assert_eq!((f.generation, f.rank), (3, 1));
    assert!(f.why.contains("writing"), "{f:?}");
}

#[tokio::test]
async fn a_hub_that_cannot_be_reached_is_the_links_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let mut rx = dial(addr.clone(), hello(1, &K), WAIT, MAX);
    match next_step(&mut rx).await {
        Err(LinkError::Connect { addr: a, .. }) => assert_eq!(a, addr),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_follower_that_dials_before_its_hub_opened_the_generation_waits_for_it() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    let mut one = dial(addr, hello(1, &K), WAIT, MAX);
    tokio::time::sleep(Duration::from_millis(100)).await;
    hub.open("j", 3, &K, &[1]);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
    assert!(faults.try_recv().is_err());
}

#[tokio::test]
async fn hubs_sharing_a_listener_serve_each_others_followers_whenever_they_open() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    hub.open("j", 3, &K, &[1]);
    // Rank 5 follows another hub of generation 3 on this listener, which
    // has not opened yet: it waits rather than being refused.
    let mut five = dial(addr, hello(5, &K), WAIT, MAX);
    tokio::time::sleep(Duration::from_millis(100)).await;
    hub.open("j", 3, &K, &[5]);
    let own = hub.forward(relay(3, &[(5, 50), (4, 4)]), 4);
    assert_eq!(own.len(), 1, "rank 4's own message");
    assert_eq!(next_step(&mut five).await, Ok(50));
    assert!(faults.try_recv().is_err());
}

/// A hub that speaks the handshake with `key` and then sends `frames`
/// (sealed, when it holds the key), as a compromised or forged hub would.
async fn fake_hub(key: &'static [u8], frames: Vec<wire::CoordinatorMessage>) -> String {
    use futures::{SinkExt, StreamExt};
    use tokio_util::codec::{FramedRead, FramedWrite};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (sock, _) = l.accept().await.unwrap();
        let (r, w) = sock.into_split();
        let mut out = FramedWrite::new(w, crate::codec::codec(MAX + 16));
        let mut inp = FramedRead::new(r, crate::codec::codec(4096));
        let challenge = [1u8; 32];
        out.send(bytes::Bytes::copy_from_slice(&challenge))
            .await
            .unwrap();
        let h = wire::RelayHello::decode(inp.next().await.unwrap().unwrap()).unwrap();
        let k = crate::secure::group_key(key).unwrap();
        let answer = crate::secure::accept(&k, &challenge, &h);
        out.send(bytes::Bytes::copy_from_slice(&answer))
            .await
            .unwrap();
        let mut sealing = crate::secure::sealing(&k, &challenge, &h);
        for f in frames {
            let sealed = sealing.seal(&[], &f.encode_to_vec()).to_vec();
            out.send(bytes::Bytes::from(sealed)).await.unwrap();
        }
        tokio::time::sleep(WAIT).await;
    });
    addr
}

/// Issue 33: a follower obeyed any frame from its hub link. An
/// authenticated hub (any worker of the group) still cannot make it exit,
/// reconfigure or act for another generation: a Release, a Configure, an
/// Abort or another generation's plan ends the link with the hub blamed,
/// and nothing of it reaches the session.
#[tokio::test]
async fn a_follower_refuses_what_is_never_relayed_and_other_generations() {
    let release = wire::CoordinatorMessage {
        msg: Some(Msg::Release(wire::Release {
            job_id: "j".into(),
            reason: "bye".into(),
        })),
    };
    let configure = wire::CoordinatorMessage {
        msg: Some(Msg::Configure(wire::Configure {
            job_id: "j".into(),
            generation: 3,
            world_size: 1 << 30,
            ..Default::default()
        })),
    };
    for (bad, what) in [
        (release, "a Release"),
        (configure, "a Configure"),
        (plan(4, 1), "generation 4"),
    ] {
        let addr = fake_hub(&K, vec![plan(3, 10), bad]).await;
        let mut rx = dial(addr, hello(1, &K), WAIT, MAX);
        assert_eq!(next_step(&mut rx).await, Ok(10));
        let end = tokio::time::timeout(WAIT, rx.recv())
            .await
            .unwrap()
            .unwrap();
        match end {
            Err(LinkError::Refused(why)) => assert!(why.contains(what), "{why}"),
            other => panic!("{what}: {other:?}"),
        }
        assert!(tokio::time::timeout(WAIT, rx.recv())
            .await
            .unwrap()
            .is_none());
    }
}

/// A hub without the group's key (anyone who can reach the follower's
/// dial address) is refused before any frame is read.
#[tokio::test]
async fn a_hub_without_the_groups_key_is_unauthenticated() {
    let addr = fake_hub(&OTHER, vec![plan(3, 10)]).await;
    let mut rx = dial(addr, hello(1, &K), WAIT, MAX);
    match next_step(&mut rx).await {
        Err(LinkError::Unauthenticated { why, .. }) => assert!(why.contains("key"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Issue 33: the hub read a 4-byte length and reserved up to the message
/// limit before any authentication. A 64 MiB length prefix now closes the
/// connection at once (a hello is at most 4 KiB), and the hub goes on
/// serving its real followers.
#[tokio::test]
async fn a_64_mib_length_prefix_is_refused_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let opts = HubOptions {
        connect_timeout: WAIT,
        max_frame: 256 << 20,
    };
    let (hub, _faults) = Hub::start(l, opts);
    hub.open("j", 3, &K, &[1]);
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut challenge = [0u8; 36];
    s.read_exact(&mut challenge).await.unwrap();
    s.write_all(&(64u32 << 20).to_be_bytes()).await.unwrap();
    s.write_all(&[0u8; 1024]).await.unwrap();
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest))
        .await
        .expect("closed within 2 s");
    assert!(n.is_ok_and(|n| n == 0) || rest.is_empty(), "{rest:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    let mut one = dial(addr, hello(1, &K), WAIT, MAX);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
}
