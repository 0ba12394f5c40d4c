//! The framing of a relay connection: length-delimited protobuf (a 4-byte
//! big-endian length, then the message).

use tokio_util::codec::LengthDelimitedCodec;

/// The codec of a relay connection, frames up to `max_frame` bytes.
pub(crate) fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(max_frame)
        .new_codec()
}
