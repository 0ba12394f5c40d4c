//! A follower's connection to its hub.

use std::time::Duration;

use accrue_collective::link::{MAC_LEN, NONCE_LEN, TAG_LEN};
use accrue_proto::v1 as wire;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::secure;

/// Why a follower's relay connection ended: the session reports it as a
/// step error blaming its hub.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("cannot reach its relay hub at {addr}: {why}")]
    Connect { addr: String, why: String },
    #[error("its relay hub closed the connection")]
    Closed,
    #[error("reading from its relay hub: {0}")]
    Read(String),
    /// The peer did not prove it holds the group's key, or sent a frame
    /// that does not open under it.
    #[error("its relay hub at {addr} is not authenticated: {why}")]
    Unauthenticated { addr: String, why: String },
    /// An authenticated frame this link does not take (a kind never
    /// relayed, or another job's or generation's).
    #[error("its relay hub sent {0}")]
    Refused(String),
}

/// Who a follower is on its link: the generation, its rank and its
/// group's key (`RelayRoute.token`).
#[derive(Clone)]
pub struct Follower {
    pub job: String,
    pub generation: u64,
    pub rank: u32,
    pub key: Vec<u8>,
}

/// Connects to the hub at `addr`, authenticates both ways with the
/// group's key, and returns the messages the hub forwards, in order; the
/// last item is an error when the connection fails or ends, or a frame
/// does not open or belongs to another job, generation or kind. Dropping
/// the receiver closes the connection.
pub fn dial(
    addr: String,
    me: Follower,
    connect_timeout: Duration,
    max_frame: usize,
) -> mpsc::UnboundedReceiver<Result<wire::CoordinatorMessage, LinkError>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let connected = tokio::time::timeout(connect_timeout, connect(&addr, &me, max_frame)).await;
        // The write half stays open while the link lives (the hub reads
        // nothing after the hello; closing it would read as leaving).
        let (mut frames, _out, mut sealing) = match connected {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = tx.send(Err(e));
                return;
            }
            Err(_) => {
                let why = format!("no authenticated connection within {connect_timeout:?}");
                let _ = tx.send(Err(LinkError::Connect { addr, why }));
                return;
            }
        };
        loop {
            let item = tokio::select! {
                f = frames.next() => f,
                // The session dropped the receiver: close.
                () = tx.closed() => return,
            };
            let msg = match item {
                Some(Ok(mut b)) => match sealing.open(&[], &mut b) {
                    None => Err(LinkError::Unauthenticated {
                        addr: addr.clone(),
                        why: "a frame that does not open under the group's key".into(),
                    }),
                    Some(plain) => wire::CoordinatorMessage::decode(plain)
                        .map_err(|e| {
                            LinkError::Read(format!("a message that does not decode: {e}"))
                        })
                        .and_then(|m| {
                            secure::relayable(&me.job, me.generation, &m)
                                .map(|()| m)
                                .map_err(LinkError::Refused)
                        }),
                },
                Some(Err(e)) => Err(LinkError::Read(e.to_string())),
                None => Err(LinkError::Closed),
            };
            let last = msg.is_err();
            if tx.send(msg).is_err() || last {
                return;
            }
        }
    });
    rx
}

type Frames = FramedRead<tokio::net::tcp::OwnedReadHalf, tokio_util::codec::LengthDelimitedCodec>;
type Writer = FramedWrite<tokio::net::tcp::OwnedWriteHalf, tokio_util::codec::LengthDelimitedCodec>;

/// The handshake: the hub's challenge, this follower's hello, the hub's
/// proof; then the frames and their sealing.
async fn connect(
    addr: &str,
    me: &Follower,
    max_frame: usize,
) -> Result<(Frames, Writer, accrue_collective::Sealing), LinkError> {
    let failed = |why: String| LinkError::Connect {
        addr: addr.to_string(),
        why,
    };
    let key = secure::group_key(&me.key).map_err(failed)?;
    let sock = TcpStream::connect(addr)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let _ = sock.set_nodelay(true);
    let (read, write) = sock.into_split();
    let mut frames = FramedRead::new(read, crate::codec::codec(max_frame + TAG_LEN));
    let mut out = FramedWrite::new(write, crate::codec::codec(secure::HELLO_MAX));
    let challenge = match frames.next().await {
        Some(Ok(c)) if c.len() == NONCE_LEN => c,
        Some(Ok(c)) => return Err(failed(format!("a challenge of {} bytes", c.len()))),
        Some(Err(e)) => return Err(failed(e.to_string())),
        None => return Err(failed("closed before its challenge".into())),
    };
    let hello = secure::hello(&key, &challenge, &me.job, me.generation, me.rank);
    out.send(Bytes::from(hello.encode_to_vec()))
        .await
        .map_err(|e| failed(e.to_string()))?;
    let answer = match frames.next().await {
        Some(Ok(a)) if a.len() == MAC_LEN => a,
        Some(Ok(a)) => return Err(failed(format!("an answer of {} bytes", a.len()))),
        Some(Err(e)) => return Err(failed(e.to_string())),
        None => return Err(failed("it refused this follower".into())),
    };
    if !secure::accept_is_authentic(&key, &challenge, &hello, &answer) {
        return Err(LinkError::Unauthenticated {
            addr: addr.to_string(),
            why: "its answer does not prove the group's key".into(),
        });
    }
    Ok((frames, out, secure::sealing(&key, &challenge, &hello)))
}
