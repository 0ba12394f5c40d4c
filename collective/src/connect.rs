//! Forming the ring: every rank dials its next rank and accepts a
//! connection from its previous one, each with a handshake carrying magic,
//! version, generation, ranks and world size.
//!
//! The listener is bound once per worker process and reused by every
//! generation, so its backlog may hold connections meant for an older (or a
//! newer) generation: the accepting side answers those with a refusal and
//! keeps accepting until the expected rank arrives. A dialer refused by a
//! peer still at an older generation retries until the deadline (the peer is
//! catching up); refused by a peer at a newer generation it fails at once
//! (this rank is the stale one).

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use crate::config::RingConfig;
use crate::error::{CollectiveError, CollectiveResult};
use crate::wire::{Hello, HELLO_LEN, HELLO_MAGIC, VERSION};

/// The two connections of one rank.
pub(crate) struct Links {
    pub to_next: TcpStream,
    pub from_prev: TcpStream,
}

const OP: &str = "connect";

/// Connects `cfg.rank` to its ring neighbours before `deadline`.
pub(crate) fn connect(
    listener: &TcpListener,
    cfg: &RingConfig,
    deadline: Instant,
) -> CollectiveResult<Links> {
    thread::scope(|s| {
        let dialer = s.spawn(|| dial_next(cfg, deadline));
        let accepted = accept_prev(listener, cfg, deadline);
        let dialed = dialer.join().expect("ring dialer panicked");
        Ok(Links {
            to_next: dialed?,
            from_prev: accepted?,
        })
    })
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (left >= Duration::from_millis(1)).then_some(left)
}

fn tune(s: &TcpStream) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)
}

fn hello(cfg: &RingConfig, to_or_accepted: u32) -> Hello {
    Hello {
        magic: HELLO_MAGIC,
        version: VERSION,
        generation: cfg.generation,
        rank: cfg.rank as u32,
        world: cfg.world as u32,
        to_or_accepted,
    }
}

fn describe(h: &Hello) -> String {
    format!(
        "rank {} of {} at generation {} (wire version {})",
        h.rank, h.world, h.generation, h.version
    )
}

fn exchange(s: &TcpStream, send: &Hello, deadline: Instant) -> io::Result<Hello> {
    // Wait for the answer until the deadline: a dialer that gave up early
    // could leave behind a connection the peer later accepts as its ring link.
    let left = remaining(deadline).ok_or(io::ErrorKind::TimedOut)?;
    s.set_write_timeout(Some(left))?;
    s.set_read_timeout(Some(left))?;
    (&*s).write_all(&send.encode())?;
    let mut b = [0u8; HELLO_LEN];
    (&*s).read_exact(&mut b)?;
    Ok(Hello::decode(&b))
}

fn dial_next(cfg: &RingConfig, deadline: Instant) -> CollectiveResult<TcpStream> {
    let next = (cfg.rank + 1) % cfg.world;
    let addr = &cfg.peers[next];
    let lost = |detail: String| CollectiveError::PeerLost {
        op: OP,
        seq: 0,
        peer: next,
        detail,
    };
    let mut last: Option<CollectiveError> = None;
    loop {
        let Some(left) = remaining(deadline) else {
            return Err(last.unwrap_or(CollectiveError::Timeout {
                op: OP,
                seq: 0,
                peer: next,
                secs: cfg.timeout.as_secs_f64(),
            }));
        };
        let attempt = addr
            .to_socket_addrs()
            .and_then(|mut a| a.next().ok_or_else(|| io::ErrorKind::NotFound.into()))
            .and_then(|a| TcpStream::connect_timeout(&a, left.min(Duration::from_secs(1))))
            .and_then(|s| tune(&s).map(|()| s))
            .and_then(|s| exchange(&s, &hello(cfg, next as u32), deadline).map(|h| (s, h)));
        match attempt {
            Ok((s, h)) if h.magic == HELLO_MAGIC && h.to_or_accepted == 1 => return Ok(s),
            Ok((_, h)) => {
                let mismatch = CollectiveError::Mismatch {
                    op: OP,
                    peer: next,
                    expected: format!(
                        "rank {next} of {} at generation {} (wire version {VERSION})",
                        cfg.world, cfg.generation
                    ),
                    got: if h.magic == HELLO_MAGIC {
                        describe(&h)
                    } else {
                        format!("something that is not an accrue ring at {addr}")
                    },
                };
                // Only a peer still at an older generation may yet come round.
                if h.magic != HELLO_MAGIC || h.generation >= cfg.generation {
                    return Err(mismatch);
                }
                last = Some(mismatch);
            }
            // A peer seen at an older generation that never caught up is the
            // better explanation than the transport error its listener
            // closing (as it gives up) causes at the end.
            Err(_) if matches!(last, Some(CollectiveError::Mismatch { .. })) => {}
            Err(e) => last = Some(lost(format!("dialing {addr}: {e}"))),
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn accept_prev(
    listener: &TcpListener,
    cfg: &RingConfig,
    deadline: Instant,
) -> CollectiveResult<TcpStream> {
    let prev = (cfg.rank + cfg.world - 1) % cfg.world;
    listener
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::Setup(format!("{OP}: listener: {e}")))?;
    let result = loop {
        let (s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                if remaining(deadline).is_none() {
                    break Err(CollectiveError::Timeout {
                        op: OP,
                        seq: 0,
                        peer: prev,
                        secs: cfg.timeout.as_secs_f64(),
                    });
                }
                thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "ring listener accept failed; retrying");
                thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let expected = |h: &Hello| {
            h.magic == HELLO_MAGIC
                && h.version == VERSION
                && h.generation == cfg.generation
                && h.world as usize == cfg.world
                && h.rank as usize == prev
                && h.to_or_accepted as usize == cfg.rank
        };
        let got = tune(&s).and_then(|()| {
            let left = remaining(deadline).ok_or(io::ErrorKind::TimedOut)?;
            // Real dialers send their hello at once; do not let a silent
            // stranger hold up the peer queued behind it.
            s.set_read_timeout(Some(left.min(Duration::from_millis(500))))?;
            let mut b = [0u8; HELLO_LEN];
            (&s).read_exact(&mut b)?;
            Ok(Hello::decode(&b))
        });
        match got {
            Ok(h) if expected(&h) => match (&s).write_all(&hello(cfg, 1).encode()) {
                Ok(()) => break Ok(s),
                Err(e) => tracing::warn!(%from, error = %e, "ring peer vanished during handshake"),
            },
            Ok(h) => {
                let _ = (&s).write_all(&hello(cfg, 0).encode());
                tracing::warn!(%from, got = %describe(&h), rank = cfg.rank,
                    generation = cfg.generation, "refused a ring connection");
                if h.magic == HELLO_MAGIC && h.generation == cfg.generation {
                    // Same generation, wrong rank or world: the peer lists differ.
                    break Err(CollectiveError::Mismatch {
                        op: OP,
                        peer: h.rank as usize,
                        expected: format!(
                            "rank {prev} of {} at generation {} (wire version {VERSION})",
                            cfg.world, cfg.generation
                        ),
                        got: describe(&h),
                    });
                }
            }
            Err(e) => tracing::debug!(%from, error = %e, "dropped a silent ring connection"),
        }
    };
    let _ = listener.set_nonblocking(false);
    result
}
