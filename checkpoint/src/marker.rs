//! `rank-R.json`: what one rank wrote, so that a reader can tell a whole
//! checkpoint from one a crash cut short.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::durable::{sync_dir, write_durable};

/// One file a rank wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkedFile {
    /// Name inside the checkpoint directory.
    pub name: String,
    pub bytes: u64,
    /// CRC-32 (IEEE) of the file's contents.
    pub crc32: u32,
}

/// `rank-R.json`: what rank R wrote, written after all of it is durable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMarker {
    pub rank: u32,
    pub world_size: u32,
    pub files: Vec<MarkedFile>,
}

/// The marker file name of `rank`.
pub fn marker_name(rank: u32) -> String {
    format!("rank-{rank}.json")
}

/// Size and CRC-32 of a regular file (streamed), and fsyncs it. Anything
/// but a regular file is refused before it is opened (a FIFO would block
/// the reader).
pub fn measure(path: &Path) -> std::io::Result<(u64, u32)> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut f = std::fs::File::open(path)?;
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        crc.update(&buf[..n]);
        bytes += n as u64;
    }
    f.sync_all()?;
    Ok((bytes, crc.finalize()))
}

/// Measures (and fsyncs) `files` in `dir`, then writes `rank-R.json`
/// durably. The error names the file that failed.
pub fn write_marker(
    dir: &Path,
    rank: u32,
    world_size: u32,
    files: &[String],
) -> Result<(), std::io::Error> {
    let named = |path: &Path, e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
    };
    let mut marked = Vec::with_capacity(files.len());
    for name in files {
        let path = dir.join(name);
        let (bytes, crc32) = measure(&path).map_err(|e| named(&path, e))?;
        marked.push(MarkedFile {
            name: name.clone(),
            bytes,
            crc32,
        });
    }
    sync_dir(dir).map_err(|e| named(dir, e))?;
    let marker = RankMarker {
        rank,
        world_size,
        files: marked,
    };
    let path = dir.join(marker_name(rank));
    let json = serde_json::to_vec_pretty(&marker).map_err(std::io::Error::other)?;
    write_durable(&path, &json).map_err(|e| named(&path, e))
}
