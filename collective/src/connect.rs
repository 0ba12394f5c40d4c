//! Forming the ring: every rank dials its next rank and accepts a
//! connection from its previous one, each with a handshake carrying magic,
//! version, generation, ranks and world size, a nonce from each side and a
//! MAC under the generation's link key (`crate::link`). A hello whose MAC
//! does not verify is refused and changes nothing: the acceptor goes on
//! waiting for its real previous rank, so a stranger can neither take the
//! link nor fail the generation and blame an honest peer.
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
use crate::link::{rand_bytes, Sealing, NONCE_LEN};
use crate::wire::{Hello, HELLO_FRAME_LEN, HELLO_LEN, HELLO_MAGIC, VERSION};

/// The two connections of one rank.
pub(crate) struct Links {
    pub to_next: TcpStream,
    pub from_prev: TcpStream,
}

/// The sealing of what a rank sends and of what it receives, when the
/// link key seals.
pub(crate) struct Seals {
    pub out: Option<Sealing>,
    pub inward: Option<Sealing>,
}

const HELLO_LABEL: &[u8] = b"accrue ring hello";
const ANSWER_LABEL: &[u8] = b"accrue ring answer";

/// A hello frame: the hello, a nonce and a MAC.
struct Frame {
    hello: Hello,
    raw: [u8; HELLO_FRAME_LEN],
}

impl Frame {
    fn new(hello: Hello, nonce: &[u8; NONCE_LEN], mac: Option<[u8; 32]>) -> Frame {
        let mut raw = [0u8; HELLO_FRAME_LEN];
        raw[..HELLO_LEN].copy_from_slice(&hello.encode());
        raw[HELLO_LEN..HELLO_LEN + NONCE_LEN].copy_from_slice(nonce);
        if let Some(mac) = mac {
            raw[HELLO_LEN + NONCE_LEN..].copy_from_slice(&mac);
        }
        Frame { hello, raw }
    }

    fn decode(raw: [u8; HELLO_FRAME_LEN]) -> Frame {
        let hello = Hello::decode(raw[..HELLO_LEN].try_into().expect("hello bytes"));
        Frame { hello, raw }
    }

    fn base(&self) -> &[u8] {
        &self.raw[..HELLO_LEN]
    }

    fn nonce(&self) -> &[u8] {
        &self.raw[HELLO_LEN..HELLO_LEN + NONCE_LEN]
    }

    fn mac(&self) -> &[u8] {
        &self.raw[HELLO_LEN + NONCE_LEN..]
    }
}

/// A dialer's signed hello.
fn signed_hello(cfg: &RingConfig, to: u32) -> Frame {
    let nonce = rand_bytes::<NONCE_LEN>();
    let h = hello(cfg, to);
    let mac = cfg.link.mac(HELLO_LABEL, &[&h.encode(), &nonce]);
    Frame::new(h, &nonce, Some(mac))
}

/// An acceptor's answer taking the connection, bound to the hello.
fn signed_answer(cfg: &RingConfig, to: &Frame) -> Frame {
    let nonce = rand_bytes::<NONCE_LEN>();
    let h = hello(cfg, 1);
    let mac = cfg.link.mac(ANSWER_LABEL, &[&to.raw, &h.encode(), &nonce]);
    Frame::new(h, &nonce, Some(mac))
}

const OP: &str = "connect";

/// Connects `cfg.rank` to its ring neighbours before `deadline`.
pub(crate) fn connect(
    listener: &TcpListener,
    cfg: &RingConfig,
    deadline: Instant,
) -> CollectiveResult<(Links, Seals)> {
    thread::scope(|s| {
        let dialer = s.spawn(|| dial_next(cfg, deadline));
        let accepted = accept_prev(listener, cfg, deadline);
        let dialed = dialer.join().expect("ring dialer panicked");
        let ((to_next, out), (from_prev, inward)) = (dialed?, accepted?);
        Ok((Links { to_next, from_prev }, Seals { out, inward }))
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

fn exchange(s: &TcpStream, send: &Frame, deadline: Instant) -> io::Result<Frame> {
    // Wait for the answer until the deadline: a dialer that gave up early
    // could leave behind a connection the peer later accepts as its ring link.
    let left = remaining(deadline).ok_or(io::ErrorKind::TimedOut)?;
    s.set_write_timeout(Some(left))?;
    s.set_read_timeout(Some(left))?;
    (&*s).write_all(&send.raw)?;
    let mut b = [0u8; HELLO_FRAME_LEN];
    (&*s).read_exact(&mut b)?;
    Ok(Frame::decode(b))
}

type Link = (TcpStream, Option<Sealing>);

fn dial_next(cfg: &RingConfig, deadline: Instant) -> CollectiveResult<Link> {
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
            .and_then(|s| {
                let sent = signed_hello(cfg, next as u32);
                exchange(&s, &sent, deadline).map(|got| (s, sent, got))
            });
        match attempt {
            Ok((s, sent, got))
                if got.hello.magic == HELLO_MAGIC && got.hello.to_or_accepted == 1 =>
            {
                // Taken: by a peer holding the key, or by nobody we know.
                let parts: [&[u8]; 3] = [&sent.raw, got.base(), got.nonce()];
                if !cfg.link.verify(ANSWER_LABEL, &parts, got.mac()) {
                    return Err(CollectiveError::Mismatch {
                        op: OP,
                        peer: next,
                        expected: "an answer authenticated with this generation's link key".into(),
                        got: format!("an unauthenticated answer from {addr}"),
                    });
                }
                return Ok((s, cfg.link.sealing(sent.nonce(), got.nonce())));
            }
            Ok((_, _, got)) => {
                let h = got.hello;
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
) -> CollectiveResult<Link> {
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
            let mut b = [0u8; HELLO_FRAME_LEN];
            (&s).read_exact(&mut b)?;
            Ok(Frame::decode(b))
        });
        let authentic = |f: &Frame| {
            cfg.link
                .verify(HELLO_LABEL, &[f.base(), f.nonce()], f.mac())
        };
        match got {
            Ok(f) if expected(&f.hello) && authentic(&f) => {
                let answer = signed_answer(cfg, &f);
                match (&s).write_all(&answer.raw) {
                    Ok(()) => break Ok((s, cfg.link.sealing(f.nonce(), answer.nonce()))),
                    Err(e) => {
                        tracing::warn!(%from, error = %e, "ring peer vanished during handshake")
                    }
                }
            }
            Ok(f) => {
                let h = f.hello;
                let refusal = Frame::new(hello(cfg, 0), &[0; NONCE_LEN], None);
                let _ = (&s).write_all(&refusal.raw);
                if h.magic == HELLO_MAGIC && h.generation == cfg.generation && !authentic(&f) {
                    // Not from a holder of this generation's key: nobody
                    // to blame, nothing changes; the real rank may follow.
                    tracing::warn!(%from, got = %describe(&h), rank = cfg.rank,
                        generation = cfg.generation, "refused an unauthenticated ring connection");
                    continue;
                }
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
