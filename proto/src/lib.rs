//! The `accrue.v1` wire protocol: the only contract between the coordinator,
//! its workers and the `accrue` CLI. Generated from `proto/accrue/v1/*.proto`.
//!
//! Token ids travel as packed little-endian bytes (`u32` ids, `i32` labels):
//! see [`pack_u32`] and friends.

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("accrue.v1");
}

/// Packs token ids as little-endian `u32` bytes (4 bytes per token).
pub fn pack_u32(values: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    extend_u32(&mut out, values);
    out
}

/// Packs labels as little-endian `i32` bytes (4 bytes per token).
pub fn pack_i32(values: &[i32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    extend_i32(&mut out, values);
    out
}

/// Appends token ids to `out` as [`pack_u32`] packs them (a payload built
/// from many rows is written in place, not packed row by row).
pub fn extend_u32(out: &mut Vec<u8>, values: &[u32]) {
    let at = out.len();
    out.resize(at + values.len() * 4, 0);
    for (b, v) in out[at..].chunks_exact_mut(4).zip(values) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Appends labels to `out` as [`pack_i32`] packs them.
pub fn extend_i32(out: &mut Vec<u8>, values: &[i32]) {
    let at = out.len();
    out.resize(at + values.len() * 4, 0);
    for (b, v) in out[at..].chunks_exact_mut(4).zip(values) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Packs per-token floats as little-endian `f32` bytes.
pub fn pack_f32(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Error for a packed field whose length is not a multiple of 4.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLenError {
    pub len: usize,
}

impl std::fmt::Display for PackedLenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "packed field has {} bytes, not a multiple of 4",
            self.len
        )
    }
}

impl std::error::Error for PackedLenError {}

fn chunks4(bytes: &[u8]) -> Result<impl Iterator<Item = [u8; 4]> + '_, PackedLenError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PackedLenError { len: bytes.len() });
    }
    Ok(bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]))
}

/// Inverse of [`pack_u32`].
pub fn unpack_u32(bytes: &[u8]) -> Result<Vec<u32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(u32::from_le_bytes).collect())
}

/// Inverse of [`pack_i32`].
pub fn unpack_i32(bytes: &[u8]) -> Result<Vec<i32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(i32::from_le_bytes).collect())
}

/// Inverse of [`pack_f32`].
pub fn unpack_f32(bytes: &[u8]) -> Result<Vec<f32>, PackedLenError> {
    Ok(chunks4(bytes)?.map(f32::from_le_bytes).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_round_trip() {
        let ids = [0u32, 1, 65_535, u32::MAX];
        assert_eq!(unpack_u32(&pack_u32(&ids)).unwrap(), ids);
        let labels = [-100i32, 0, 7, i32::MAX];
        assert_eq!(unpack_i32(&pack_i32(&labels)).unwrap(), labels);
        let f = [0.5f32, -1.25];
        assert_eq!(unpack_f32(&pack_f32(&f)).unwrap(), f);
    }

    #[test]
    fn packed_rejects_ragged_bytes() {
        assert_eq!(
            unpack_u32(&[1, 2, 3]).unwrap_err(),
            PackedLenError { len: 3 }
        );
    }
}
