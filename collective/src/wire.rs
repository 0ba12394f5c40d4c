//! What goes over the ring's sockets: a fixed 48-byte little-endian header
//! before every payload piece, and the connection handshake. The header
//! carries everything a receiver can check (generation, sequence number,
//! operation, step, byte range and total length), so ranks that diverge fail
//! on the first piece with a message naming both sides.

use std::fmt;

#[cfg(not(target_endian = "little"))]
compile_error!(
    "accrue-collective sends f32 as raw little-endian bytes; big-endian targets are not supported"
);

/// First bytes of every header ("ACRL").
pub(crate) const MAGIC: u32 = 0x4143_524c;
/// First bytes of a connection handshake ("ACRH"), and of its answer.
pub(crate) const HELLO_MAGIC: u32 = 0x4143_5248;
/// Wire format version, checked at the handshake (2: hellos carry a nonce
/// and a MAC, see `crate::link`).
pub(crate) const VERSION: u32 = 2;

/// The ring operations, as numbered on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    BroadcastLen = 5,
    BroadcastBytes = 6,
    Barrier = 7,
}

impl Op {
    /// The name used in errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::BroadcastLen => "broadcast_bytes(len)",
            Op::BroadcastBytes => "broadcast_bytes",
            Op::Barrier => "barrier",
        }
    }

    fn from_u32(v: u32) -> Option<Op> {
        Some(match v {
            1 => Op::AllReduce,
            2 => Op::ReduceScatter,
            3 => Op::AllGather,
            4 => Op::Broadcast,
            5 => Op::BroadcastLen,
            6 => Op::BroadcastBytes,
            7 => Op::Barrier,
            _ => return None,
        })
    }
}

/// The header in front of every payload piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub magic: u32,
    pub op: u32,
    pub generation: u64,
    pub seq: u64,
    pub step: u32,
    pub nbytes: u32,
    pub offset: u64,
    pub total: u64,
}

pub(crate) const HEADER_LEN: usize = 48;

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..8].copy_from_slice(&self.op.to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.step.to_le_bytes());
        b[28..32].copy_from_slice(&self.nbytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Header {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Header {
            magic: u32_at(0),
            op: u32_at(4),
            generation: u64_at(8),
            seq: u64_at(16),
            step: u32_at(24),
            nbytes: u32_at(28),
            offset: u64_at(32),
            total: u64_at(40),
        }
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.magic != MAGIC {
            return write!(f, "garbage (magic {:#010x})", self.magic);
        }
        let op =
            Op::from_u32(self.op).map_or_else(|| format!("op {}", self.op), |o| o.name().into());
        write!(
            f,
            "{op} #{} (generation {}, step {}, bytes {}..{} of {})",
            self.seq,
            self.generation,
            self.step,
            self.offset,
            self.offset + u64::from(self.nbytes),
            self.total
        )
    }
}

/// The connection handshake: sent by the connecting rank, answered by the
/// accepting one with its own values and whether it took the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub magic: u32,
    pub version: u32,
    pub generation: u64,
    /// The sender's rank.
    pub rank: u32,
    pub world: u32,
    /// Which rank the sender meant to reach (its next rank), or, in an
    /// answer, 1 if the connection was accepted and 0 if not.
    pub to_or_accepted: u32,
}

pub(crate) const HELLO_LEN: usize = 28;
/// A hello on the wire: the hello, the sender's nonce and its MAC
/// (`crate::link`; zeros in a refusal, which proves nothing).
pub(crate) const HELLO_FRAME_LEN: usize = HELLO_LEN + crate::link::NONCE_LEN + crate::link::MAC_LEN;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.world.to_le_bytes());
        b[24..28].copy_from_slice(&self.to_or_accepted.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Hello {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Hello {
            magic: u32_at(0),
            version: u32_at(4),
            generation: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            rank: u32_at(16),
            world: u32_at(20),
            to_or_accepted: u32_at(24),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_hello_round_trip() {
        let h = Header {
            magic: MAGIC,
            op: Op::AllGather as u32,
            generation: 7,
            seq: u64::MAX - 3,
            step: 5,
            nbytes: 1 << 20,
            offset: 1 << 40,
            total: (1 << 40) + (1 << 21),
        };
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(
            h.to_string(),
            format!(
                "all_gather #{} (generation 7, step 5, bytes {}..{} of {})",
                u64::MAX - 3,
                1u64 << 40,
                (1u64 << 40) + (1 << 20),
                (1u64 << 40) + (1 << 21)
            )
        );
        let hello = Hello {
            magic: HELLO_MAGIC,
            version: VERSION,
            generation: 3,
            rank: 2,
            world: 4,
            to_or_accepted: 3,
        };
        assert_eq!(Hello::decode(&hello.encode()), hello);
    }

    #[test]
    fn garbage_headers_say_so() {
        let h = Header::decode(&[0xab; HEADER_LEN]);
        assert_eq!(h.to_string(), "garbage (magic 0xabababab)");
    }
}
