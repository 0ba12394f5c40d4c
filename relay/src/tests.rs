use std::time::Duration;

use accrue_proto::v1 as wire;
use prost::Message;
use tokio::net::TcpListener;
use wire::coordinator_message::Msg;

use crate::{dial, Fault, Hub, HubOptions, LinkError};

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

fn abort(step: u64) -> Vec<u8> {
    wire::CoordinatorMessage {
        msg: Some(Msg::Abort(wire::Abort {
            job_id: "j".into(),
            generation: 3,
            step,
            ..Default::default()
        })),
    }
    .encode_to_vec()
}

fn relay(generation: u64, to: &[(u32, u64)]) -> wire::Relay {
    wire::Relay {
        job_id: "j".into(),
        generation,
        messages: to
            .iter()
            .map(|&(rank, step)| wire::Relayed {
                rank,
                message: abort(step),
            })
            .collect(),
    }
}

fn hello(rank: u32, token: &[u8]) -> wire::RelayHello {
    wire::RelayHello {
        job_id: "j".into(),
        generation: 3,
        rank,
        token: token.to_vec(),
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
        Some(Msg::Abort(a)) => Ok(a.step),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn messages_reach_each_follower_in_order_whether_sent_before_or_after_it_connected() {
    let (hub, _faults, addr) = hub(WAIT).await;
    hub.open("j", 3, b"t", &[1, 2]);
    // Before anyone connected: queued.
    // The hub's own messages come back to it, in order.
    let own = hub.forward(relay(3, &[(1, 10), (0, 1), (2, 20), (1, 11), (0, 2)]), 0);
    let steps: Vec<u64> = own
        .into_iter()
        .map(|m| match m.msg {
            Some(Msg::Abort(a)) => a.step,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(steps, [1, 2]);
    let mut one = dial(addr.clone(), hello(1, b"t"), WAIT, MAX);
    let mut two = dial(addr, hello(2, b"t"), WAIT, MAX);
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
    hub.open("j", 3, b"secret", &[1]);
    hub.forward(relay(3, &[(1, 10)]), 0);
    let mut wrong = dial(addr.clone(), hello(1, b"guess"), WAIT, MAX);
    assert_eq!(next_step(&mut wrong).await, Err(LinkError::Closed));
    let mut stale = hello(1, b"secret");
    stale.generation = 2;
    let mut old = dial(addr, stale, WAIT, MAX);
    assert_eq!(next_step(&mut old).await, Err(LinkError::Closed));
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
    hub.open("j", 3, b"t", &[1]);
    let mut one = dial(addr.clone(), hello(1, b"t"), WAIT, MAX);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
    hub.open("j", 4, b"u", &[2]);
    assert_eq!(next_step(&mut one).await, Err(LinkError::Closed));
    // A late relay of generation 3 reaches nobody and blames nobody.
    hub.forward(relay(3, &[(1, 11)]), 0);
    let mut h = hello(2, b"u");
    h.generation = 4;
    let mut two = dial(addr, h, WAIT, MAX);
    hub.forward(relay(4, &[(2, 40)]), 0);
    assert_eq!(next_step(&mut two).await, Ok(40));
    assert!(faults.try_recv().is_err());
}

#[tokio::test]
async fn a_message_for_a_rank_that_is_not_a_follower_is_a_fault_naming_it() {
    let (hub, mut faults, _addr) = hub(WAIT).await;
    hub.open("j", 3, b"t", &[1]);
    hub.forward(relay(3, &[(5, 10)]), 0);
    let f = faults.recv().await.unwrap();
    assert_eq!((f.generation, f.rank), (3, 5));
    assert!(f.why.contains("not a follower"), "{f:?}");
}

#[tokio::test]
async fn a_follower_gone_is_a_fault_naming_it_when_its_messages_cannot_be_written() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    hub.open("j", 3, b"t", &[1]);
    let mut one = dial(addr, hello(1, b"t"), WAIT, MAX);
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
    let mut rx = dial(addr.clone(), hello(1, b"t"), WAIT, MAX);
    match next_step(&mut rx).await {
        Err(LinkError::Connect { addr: a, .. }) => assert_eq!(a, addr),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_follower_that_dials_before_its_hub_opened_the_generation_waits_for_it() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    let mut one = dial(addr, hello(1, b"t"), WAIT, MAX);
    tokio::time::sleep(Duration::from_millis(100)).await;
    hub.open("j", 3, b"t", &[1]);
    hub.forward(relay(3, &[(1, 10)]), 0);
    assert_eq!(next_step(&mut one).await, Ok(10));
    assert!(faults.try_recv().is_err());
}

#[tokio::test]
async fn hubs_sharing_a_listener_serve_each_others_followers_whenever_they_open() {
    let (hub, mut faults, addr) = hub(WAIT).await;
    hub.open("j", 3, b"t", &[1]);
    // Rank 5 follows another hub of generation 3 on this listener, which
    // has not opened yet: it waits rather than being refused.
    let mut five = dial(addr, hello(5, b"t"), WAIT, MAX);
    tokio::time::sleep(Duration::from_millis(100)).await;
    hub.open("j", 3, b"t", &[5]);
    let own = hub.forward(relay(3, &[(5, 50), (4, 4)]), 4);
    assert_eq!(own.len(), 1, "rank 4's own message");
    assert_eq!(next_step(&mut five).await, Ok(50));
    assert!(faults.try_recv().is_err());
}
