//! A follower's connection to its hub.

use std::time::Duration;

use accrue_proto::v1 as wire;
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};

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
}

/// Connects to the hub at `addr`, introduces itself with `hello`, and
/// returns the messages the hub forwards, in order; the last item is an
/// error when the connection fails or ends. Dropping the receiver closes
/// the connection.
pub fn dial(
    addr: String,
    hello: wire::RelayHello,
    connect_timeout: Duration,
    max_frame: usize,
) -> mpsc::UnboundedReceiver<Result<wire::CoordinatorMessage, LinkError>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let sock = match tokio::time::timeout(connect_timeout, TcpStream::connect(&addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let why = e.to_string();
                let _ = tx.send(Err(LinkError::Connect { addr, why }));
                return;
            }
            Err(_) => {
                let why = format!("no connection within {connect_timeout:?}");
                let _ = tx.send(Err(LinkError::Connect { addr, why }));
                return;
            }
        };
        let _ = sock.set_nodelay(true);
        let (read, write) = sock.into_split();
        let mut out = FramedWrite::new(write, crate::codec::codec(max_frame));
        if let Err(e) = out.send(bytes::Bytes::from(hello.encode_to_vec())).await {
            let why = e.to_string();
            let _ = tx.send(Err(LinkError::Connect { addr, why }));
            return;
        }
        let mut frames = FramedRead::new(read, crate::codec::codec(max_frame));
        loop {
            let item = tokio::select! {
                f = frames.next() => f,
                // The session dropped the receiver: close.
                () = tx.closed() => return,
            };
            let msg = match item {
                Some(Ok(b)) => wire::CoordinatorMessage::decode(b)
                    .map_err(|e| LinkError::Read(format!("a message that does not decode: {e}"))),
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
