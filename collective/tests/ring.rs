//! The TCP ring between threads of this process (each rank with its own
//! listener on 127.0.0.1:0) and, for the killed-peer case, a real child
//! process: exact sums, every layout edge case, divergence, dead and stalled
//! peers.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accrue_collective::{shard_range, CollectiveError, LinkKey, RingConfig, TcpRing};
use std::sync::mpsc;

fn listeners(world: usize) -> (Vec<TcpListener>, Vec<String>) {
    let ls: Vec<_> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    (ls, addrs)
}

/// A generation's link secret, as the coordinator would hand it out (the
/// same on every rank of the generation, another for every generation).
fn secret(generation: u64) -> [u8; 32] {
    let mut s = [0x5a; 32];
    s[..8].copy_from_slice(&generation.to_le_bytes());
    s
}

fn config(rank: usize, peers: &[String], generation: u64, timeout: Duration) -> RingConfig {
    RingConfig {
        rank,
        world: peers.len(),
        peers: peers.to_vec(),
        generation,
        timeout,
        link: LinkKey::new(&secret(generation), false).unwrap(),
    }
}

fn sealed(mut cfg: RingConfig) -> RingConfig {
    cfg.link = LinkKey::new(&secret(cfg.generation), true).unwrap();
    cfg
}

/// Runs `f` on every rank of a fresh ring (one thread per rank); returns the
/// results by rank.
fn on_ring<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&mut TcpRing) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let (ls, peers) = listeners(world);
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let (peers, f) = (peers.clone(), f.clone());
            std::thread::spawn(move || {
                let mut ring = TcpRing::connect(&l, config(rank, &peers, 1, timeout)).unwrap();
                f(&mut ring)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank `r`'s element `i`: small integers, so every summation order is exact.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0)
        .collect()
}

fn sequential_sum(world: usize, len: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; len];
    for r in 0..world {
        for (a, x) in acc.iter_mut().zip(input(r, len)) {
            *a += x;
        }
    }
    acc
}

fn lengths(world: usize) -> Vec<usize> {
    vec![0, 1, world - 1, 7, 1001, 65_537, 10_000_003]
}

const T: Duration = Duration::from_secs(30);

#[test]
fn all_reduce_equals_the_sequential_sum() {
    for world in [2, 3, 4] {
        for len in lengths(world) {
            let out = on_ring(world, T, move |ring| {
                let mut v = input(ring.rank(), len);
                ring.all_reduce_sum(&mut v).unwrap();
                v
            });
            let want = sequential_sum(world, len);
            for (rank, v) in out.iter().enumerate() {
                assert!(v == &want, "world {world} len {len} rank {rank}");
            }
        }
    }
}

#[test]
fn reduce_scatter_fills_own_shard_and_all_gather_completes_it() {
    for world in [2, 3, 4] {
        for len in lengths(world).into_iter().filter(|&l| l < 1_000_000) {
            let out = on_ring(world, T, move |ring| {
                let mut v = input(ring.rank(), len);
                ring.reduce_scatter_sum(&mut v).unwrap();
                let own = shard_range(len, ring.world_size(), ring.rank());
                let shard = v[own.clone()].to_vec();
                // Everything outside the own shard is garbage for all_gather.
                for (i, x) in v.iter_mut().enumerate() {
                    if !own.contains(&i) {
                        *x = f32::NAN;
                    }
                }
                ring.all_gather(&mut v).unwrap();
                (shard, v)
            });
            let want = sequential_sum(world, len);
            for (rank, (shard, full)) in out.iter().enumerate() {
                let own = shard_range(len, world, rank);
                assert!(shard == &want[own], "world {world} len {len} rank {rank}");
                assert!(full == &want, "world {world} len {len} rank {rank}");
            }
        }
    }
}

#[test]
fn random_floats_sum_bit_identically_on_every_rank() {
    use rand::{Rng, SeedableRng};
    let len = 100_003;
    for world in [2, 3, 4] {
        let out = on_ring(world, T, move |ring| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(ring.rank() as u64);
            let mut v: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
            let orig = v.clone();
            ring.all_reduce_sum(&mut v).unwrap();
            (orig, v)
        });
        for (rank, (_, v)) in out.iter().enumerate() {
            let same = v
                .iter()
                .zip(&out[0].1)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "world {world}: rank {rank} differs from rank 0");
        }
        for i in 0..len {
            let exact: f64 = out.iter().map(|(o, _)| f64::from(o[i])).sum();
            assert!((f64::from(out[0].1[i]) - exact).abs() < 1e-5, "element {i}");
        }
    }
}

#[test]
fn broadcast_from_every_root_and_broadcast_bytes() {
    for world in [2, 3, 4] {
        for root in 0..world {
            let out = on_ring(world, T, move |ring| {
                let mut v = input(ring.rank(), 70_001);
                ring.broadcast(&mut v, root).unwrap();
                let mut id = if ring.rank() == root {
                    (0..128u8).collect()
                } else {
                    vec![9; 3]
                };
                ring.broadcast_bytes(&mut id, root).unwrap();
                let mut empty = if ring.rank() == root {
                    Vec::new()
                } else {
                    vec![1; 5]
                };
                ring.broadcast_bytes(&mut empty, root).unwrap();
                ring.barrier().unwrap();
                (v, id, empty, ring.seq())
            });
            for (v, id, empty, seq) in out {
                assert!(v == input(root, 70_001), "world {world} root {root}");
                assert_eq!(id, (0..128u8).collect::<Vec<_>>());
                assert!(empty.is_empty());
                assert_eq!(seq, 4);
            }
        }
    }
}

#[test]
fn world_of_one_is_the_identity_and_bad_roots_are_refused() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let peers = vec![l.local_addr().unwrap().to_string()];
    let mut ring = TcpRing::connect(&l, config(0, &peers, 1, T)).unwrap();
    let mut v = vec![1.0, 2.0, 3.0];
    ring.all_reduce_sum(&mut v).unwrap();
    ring.reduce_scatter_sum(&mut v).unwrap();
    ring.all_gather(&mut v).unwrap();
    ring.barrier().unwrap();
    assert_eq!(v, vec![1.0, 2.0, 3.0]);
    let e = ring.broadcast(&mut v, 1).unwrap_err();
    assert_eq!(e.to_string(), "broadcast: root 1 outside world 1");
    let mut bad = config(0, &[], 1, T);
    bad.world = 2;
    bad.rank = 2;
    let e = TcpRing::connect(&l, bad).unwrap_err();
    assert!(
        matches!(&e, CollectiveError::Setup(d) if d == "rank 2 outside world 2; 0 peer addresses for world 2"),
        "{e}"
    );
}

#[test]
fn many_operations_in_a_row_and_a_small_chunk_size() {
    let out = on_ring(3, T, |ring| {
        ring.set_chunk_bytes(12);
        let mut total = 0.0f32;
        for k in 0..200usize {
            let len = k % 37;
            let mut v = input(ring.rank(), len);
            ring.all_reduce_sum(&mut v).unwrap();
            assert!(v == sequential_sum(3, len), "op {k}");
            total += v.iter().sum::<f32>();
        }
        total
    });
    assert!(out.iter().all(|t| *t == out[0]));
}

#[test]
fn a_reused_listener_refuses_stale_generations_and_strangers() {
    let (ls, peers) = listeners(2);
    let ls: Vec<_> = ls.into_iter().map(std::sync::Arc::new).collect();
    for generation in [1u64, 2, 3] {
        // A stranger and a stale dialer sit in rank 0's backlog.
        let mut junk = std::net::TcpStream::connect(&peers[0]).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (l, peers) = (ls[rank].clone(), peers.clone());
                std::thread::spawn(move || {
                    let mut ring =
                        TcpRing::connect(&l, config(rank, &peers, generation, T)).unwrap();
                    let mut v = vec![rank as f32 + generation as f32; 5];
                    ring.all_reduce_sum(&mut v).unwrap();
                    v
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![1.0 + 2.0 * generation as f32; 5]);
        }
    }
}

/// Issue 33: the ring's sockets accept anyone on the network. A stranger
/// who read the current generation off the status page sends rank 0's
/// hello first, MAC'd with the wrong key: before, it took the link (or
/// failed the generation blaming rank 0); now it is refused, nothing
/// changes, and the real rank 0 forms the ring.
#[test]
fn a_forged_hello_with_the_current_generation_takes_nothing_and_blames_nobody() {
    let (ls, peers) = listeners(2);
    // The forger's hello: rank 0 of 2 at generation 4, to rank 1, signed
    // with another key; it waits for the answer.
    let forged = {
        let mut cfg = config(0, &peers, 4, T);
        cfg.link = LinkKey::new(&[0x11; 32], false).unwrap();
        cfg
    };
    let forger = {
        let peers = peers.clone();
        std::thread::spawn(move || {
            // It dials rank 1 as rank 0 would, alone: without rank 1's
            // acceptance it cannot form anything.
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut cfg = forged;
            cfg.peers = vec![l.local_addr().unwrap().to_string(), peers[1].clone()];
            cfg.timeout = Duration::from_secs(2);
            TcpRing::connect(&l, cfg).map(|_| ())
        })
    };
    // Rank 1 starts at once and accepts; the real rank 0 comes late.
    let (l0, l1) = {
        let mut it = ls.into_iter();
        (it.next().unwrap(), it.next().unwrap())
    };
    let p1 = peers.clone();
    let rank1 = std::thread::spawn(move || {
        let mut ring = TcpRing::connect(&l1, config(1, &p1, 4, T)).unwrap();
        let mut v = vec![2.0f32; 3];
        ring.all_reduce_sum(&mut v).unwrap();
        v
    });
    let refused = forger.join().unwrap().unwrap_err();
    assert!(
        matches!(
            refused,
            CollectiveError::Mismatch { .. }
                | CollectiveError::Timeout { .. }
                | CollectiveError::PeerLost { .. }
        ),
        "{refused}"
    );
    let mut ring = TcpRing::connect(&l0, config(0, &peers, 4, T)).unwrap();
    let mut v = vec![1.0f32; 3];
    ring.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, vec![3.0; 3]);
    assert_eq!(rank1.join().unwrap(), vec![3.0; 3]);
}

/// With the link key sealing (a coordinator with TLS), every piece is
/// AES-GCM sealed: the sums are the plain ring's, bit for bit, at every
/// length and piece size.
#[test]
fn a_sealed_ring_sums_bit_identically_to_the_plain_one() {
    let mut plain: Option<Vec<Vec<f32>>> = None;
    for (seal, chunk) in [(false, None), (true, None), (true, Some(4096usize))] {
        let (ls, peers) = listeners(3);
        let handles: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let peers = peers.clone();
                std::thread::spawn(move || {
                    let mut cfg = config(rank, &peers, 9, T);
                    if seal {
                        cfg = sealed(cfg);
                    }
                    let mut ring = TcpRing::connect(&l, cfg).unwrap();
                    if let Some(c) = chunk {
                        ring.set_chunk_bytes(c);
                    }
                    let mut out = Vec::new();
                    for len in [1usize, 7, 1001, 65_537, 300_001] {
                        let mut v: Vec<f32> = (0..len)
                            .map(|i| ((i * 31 + rank * 17) as f32).sin() * 1e3)
                            .collect();
                        ring.all_reduce_sum(&mut v).unwrap();
                        out.push(v);
                    }
                    let mut b = if rank == 2 {
                        b"weights".to_vec()
                    } else {
                        Vec::new()
                    };
                    ring.broadcast_bytes(&mut b, 2).unwrap();
                    assert_eq!(b, b"weights");
                    out
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for r in &results[1..] {
            assert_eq!(r, &results[0], "seal {seal}: ranks differ");
        }
        // The plain ring's bits (the first run) are every run's.
        let first = plain.get_or_insert_with(|| results[0].clone());
        assert_eq!(first, &results[0], "seal {seal}, chunk {chunk:?}");
    }
}

#[test]
fn generation_mismatch_fails_on_both_sides_naming_both() {
    let (ls, peers) = listeners(2);
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let handles: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let peers = peers.clone();
            std::thread::spawn(move || {
                TcpRing::connect(&l, config(rank, &peers, 5 + rank as u64, timeout)).map(|_| ())
            })
        })
        .collect();
    let errs: Vec<CollectiveError> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap_err())
        .collect();
    assert!(start.elapsed() < timeout + Duration::from_secs(2));
    assert_eq!(
        errs[0].to_string(),
        "connect: ranks diverged: expected rank 1 of 2 at generation 5 (wire version 2), \
         rank 1 sent rank 1 of 2 at generation 6 (wire version 2)"
    );
    assert!(
        matches!(errs[1], CollectiveError::Mismatch { peer: 0, .. }),
        "{}",
        errs[1]
    );
    assert!(errs[1].to_string().contains("generation 5"), "{}", errs[1]);
}

#[test]
fn diverging_operations_fail_loudly_naming_both_sides() {
    let out = on_ring(2, Duration::from_secs(5), |ring| {
        let mut v = vec![1.0f32; 10];
        if ring.rank() == 0 {
            ring.all_reduce_sum(&mut v)
        } else {
            ring.all_gather(&mut v)
        }
    });
    // Whichever rank reads the other's header first names both sides; the
    // other may instead see that rank hang up (it shuts its sockets at once).
    let errs: Vec<String> = out
        .iter()
        .map(|r| r.as_ref().unwrap_err().to_string())
        .collect();
    let named = errs.iter().any(|e| {
        e.contains("ranks diverged") && e.contains("all_gather #1") && e.contains("all_reduce #1")
    });
    assert!(named, "{errs:?}");
    for e in &errs {
        assert!(
            e.contains("ranks diverged") || e.contains("closed the connection"),
            "{errs:?}"
        );
    }
    // The ring is broken for good afterwards.
    let out = on_ring(2, Duration::from_secs(5), |ring| {
        let mut v = vec![1.0f32; 10];
        let first = if ring.rank() == 0 {
            ring.all_reduce_sum(&mut v[..4])
        } else {
            ring.all_reduce_sum(&mut v)
        };
        (first.is_err(), ring.barrier().unwrap_err())
    });
    for (first_failed, e) in out {
        assert!(first_failed);
        assert!(matches!(e, CollectiveError::Broken { seq: 2, .. }), "{e}");
    }
}

#[test]
fn a_peer_dropping_its_sockets_mid_operation_is_an_error_within_seconds() {
    let out = on_ring(3, Duration::from_secs(60), |ring| {
        let mut v = input(ring.rank(), 4_000_000);
        if ring.rank() == 2 {
            ring.all_reduce_sum(&mut v).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            return Ok(Duration::ZERO); // drops its sockets while the others wait
        }
        ring.all_reduce_sum(&mut v).unwrap();
        let start = Instant::now();
        ring.all_reduce_sum(&mut v)?;
        Ok(start.elapsed())
    });
    for (rank, r) in out.iter().enumerate().take(2) {
        let e = r.as_ref().unwrap_err();
        assert!(
            matches!(e, CollectiveError::PeerLost { seq: 2, .. }),
            "rank {rank}: {e}"
        );
        assert!(e.to_string().starts_with("all_reduce #2: rank "), "{e}");
    }
}

#[test]
fn a_stalled_peer_times_out_naming_the_operation() {
    let timeout = Duration::from_millis(800);
    let out = on_ring(3, timeout, move |ring| {
        let mut v = vec![1.0f32; 1000];
        ring.barrier().unwrap();
        if ring.rank() == 1 {
            std::thread::sleep(timeout * 3); // stalls, then leaves
            return None;
        }
        let start = Instant::now();
        let e = ring.all_reduce_sum(&mut v).unwrap_err();
        Some((e, start.elapsed()))
    });
    for (e, took) in out.into_iter().flatten() {
        assert!(took < timeout + Duration::from_millis(700), "took {took:?}");
        assert!(
            matches!(
                e,
                CollectiveError::Timeout {
                    op: "all_reduce",
                    seq: 2,
                    ..
                }
            ) || matches!(
                e,
                CollectiveError::PeerLost {
                    op: "all_reduce",
                    seq: 2,
                    ..
                }
            ),
            "{e}"
        );
    }
}

const CHILD_ENV: &str = "ACCRUE_RING_TEST_CHILD";

/// Not a test: the body of the child process of
/// `a_killed_peer_process_is_an_error_within_seconds` (re-executed test binary).
#[test]
#[ignore]
fn ring_child_process() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("ADDR {}", l.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let peers: Vec<String> = line.split_whitespace().map(String::from).collect();
    let mut ring = TcpRing::connect(&l, config(1, &peers, 1, T)).unwrap();
    let mut v = input(1, 4_000_000);
    loop {
        ring.all_reduce_sum(&mut v).unwrap();
    }
}

#[test]
fn a_killed_peer_process_is_an_error_within_seconds() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["ring_child_process", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let child_addr = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
        if let Some(a) = line.strip_prefix("ADDR ") {
            break a.trim().to_string();
        }
    };
    // World 3: ranks 0 and 2 are threads here, rank 1 is the child.
    let (mut ls, mut peers) = listeners(3);
    peers[1] = child_addr;
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{}", peers.join(" ")).unwrap();
    let (kill_tx, kill_rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = [2, 0]
        .into_iter()
        .map(|rank| {
            let (l, peers, kill_tx) = (ls.remove(rank), peers.clone(), kill_tx.clone());
            std::thread::spawn(move || {
                // A long timeout: the error must come from the dead socket.
                let mut ring =
                    TcpRing::connect(&l, config(rank, &peers, 1, Duration::from_secs(60))).unwrap();
                let mut v = input(rank, 4_000_000);
                for _ in 0..3 {
                    ring.all_reduce_sum(&mut v).unwrap();
                }
                let _ = kill_tx.send(());
                loop {
                    if let Err(e) = ring.all_reduce_sum(&mut v) {
                        return (e, Instant::now());
                    }
                }
            })
        })
        .collect();
    kill_rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(30)); // land inside an operation
    let killed_at = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    for h in handles {
        let (e, at) = h.join().unwrap();
        let took = at.saturating_duration_since(killed_at);
        assert!(took < Duration::from_secs(10), "took {took:?}: {e}");
        assert!(
            matches!(
                e,
                CollectiveError::PeerLost {
                    op: "all_reduce",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn an_abort_from_another_thread_ends_an_operation_blocked_on_a_frozen_peer() {
    // Rank 1 joins the ring, then freezes (never calls the operation), as
    // a SIGSTOPped process would; rank 0's timeout is far away.
    let (mut ls, peers) = listeners(2);
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let p1 = peers.clone();
    let l1 = ls.remove(1);
    let frozen = std::thread::spawn(move || {
        let ring = TcpRing::connect(&l1, config(1, &p1, 1, Duration::from_secs(60))).unwrap();
        let _ = release_rx.recv();
        drop(ring);
    });
    let mut ring = TcpRing::connect(&ls[0], config(0, &peers, 1, Duration::from_secs(60))).unwrap();
    let abort = ring.abort_handle().unwrap();
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let mut v = input(0, 1_000_000);
        let started = Instant::now();
        let r = ring.all_reduce_sum(&mut v);
        let _ = tx.send(());
        // A later operation fails at once: the ring is broken.
        let again = ring.barrier();
        (r, started.elapsed(), again)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "the operation must block on the frozen peer"
    );
    let aborted_at = Instant::now();
    abort.abort();
    assert!(abort.is_aborted());
    rx.recv_timeout(Duration::from_secs(5))
        .expect("the aborted operation did not return");
    let returned_after = aborted_at.elapsed();
    let (r, _, again) = worker.join().unwrap();
    assert!(
        returned_after < Duration::from_secs(1),
        "took {returned_after:?}"
    );
    let e = r.unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::Aborted {
                op: "all_reduce",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.peer(), None, "an abort blames no peer");
    let e = again.unwrap_err();
    assert!(matches!(e, CollectiveError::Broken { .. }), "{e}");
    release_tx.send(()).unwrap();
    frozen.join().unwrap();
}
