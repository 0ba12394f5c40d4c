//! Completeness and integrity of a checkpoint directory (issue 6: "a crash
//! mid-write never corrupts the latest good checkpoint").
//!
//! Each rank writes its files, fsyncs them, then, last, a marker
//! `rank-R.json` listing every file it wrote with its size and CRC-32
//! (written to a temporary name, fsynced, renamed, directory fsynced).
//! Rank 0 writes `manifest.json` after its own marker. A checkpoint is
//! *complete* when `manifest.json` and the markers of ranks
//! `0..manifest.world_size` exist, and *intact* when every listed file has
//! its size and checksum. [`verify`] checks both before a restore and names
//! the first file that is missing or wrong.
//!
//! Directories with a manifest but no marker at all predate markers; they
//! are accepted (with a warning) so older checkpoints still resume.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

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

/// Why a checkpoint directory cannot be restored from.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("{0}: missing, the checkpoint is incomplete")]
    Missing(PathBuf),
    #[error("{path}: {what}")]
    Bad { path: PathBuf, what: String },
}

impl VerifyError {
    fn bad(path: &Path, what: impl Into<String>) -> VerifyError {
        VerifyError::Bad {
            path: path.to_path_buf(),
            what: what.into(),
        }
    }
}

/// Size and CRC-32 of a file (streamed), and fsyncs it.
pub fn measure(path: &Path) -> std::io::Result<(u64, u32)> {
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

/// Writes `bytes` to `path` durably: a temporary file, fsync, rename,
/// fsync of the directory.
pub fn write_durable(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// fsyncs a directory (its entries: renames and new files).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Measures (and fsyncs) `files` in `dir`, then writes `rank-R.json`.
pub fn write_marker(
    dir: &Path,
    rank: u32,
    world_size: u32,
    files: &[String],
) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut marked = Vec::with_capacity(files.len());
    for name in files {
        let path = dir.join(name);
        let (bytes, crc32) =
            measure(&path).with_context(|| format!("checksumming {}", path.display()))?;
        marked.push(MarkedFile {
            name: name.clone(),
            bytes,
            crc32,
        });
    }
    sync_dir(dir).with_context(|| format!("syncing {}", dir.display()))?;
    let marker = RankMarker {
        rank,
        world_size,
        files: marked,
    };
    let path = dir.join(marker_name(rank));
    write_durable(&path, &serde_json::to_vec_pretty(&marker)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Checks that `dir` is a complete, intact checkpoint (see the module
/// docs); returns the manifest's world size.
pub fn verify(dir: &Path) -> Result<u32, VerifyError> {
    let manifest = dir.join("manifest.json");
    let text = match std::fs::read(&manifest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(VerifyError::Missing(manifest));
        }
        Err(e) => return Err(VerifyError::bad(&manifest, e.to_string())),
    };
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| VerifyError::bad(&manifest, e.to_string()))?;
    let world = value
        .get("world_size")
        .and_then(serde_json::Value::as_u64)
        .filter(|&w| w > 0)
        .ok_or_else(|| VerifyError::bad(&manifest, "no positive world_size"))?
        as u32;
    let any_marker = (0..world).any(|r| dir.join(marker_name(r)).exists());
    if !any_marker {
        tracing::warn!(dir = %dir.display(), "checkpoint without rank markers (written before markers existed): not verified");
        return Ok(world);
    }
    // Completeness first: every rank's marker is there.
    if let Some(missing) = (0..world)
        .map(|r| dir.join(marker_name(r)))
        .find(|p| !p.exists())
    {
        return Err(VerifyError::Missing(missing));
    }
    for rank in 0..world {
        let path = dir.join(marker_name(rank));
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(VerifyError::Missing(path));
            }
            Err(e) => return Err(VerifyError::bad(&path, e.to_string())),
        };
        let m: RankMarker =
            serde_json::from_slice(&text).map_err(|e| VerifyError::bad(&path, e.to_string()))?;
        if (m.rank, m.world_size) != (rank, world) {
            return Err(VerifyError::bad(
                &path,
                format!(
                    "marks rank {} of {}, the manifest expects rank {rank} of {world}",
                    m.rank, m.world_size
                ),
            ));
        }
        for f in &m.files {
            let file = dir.join(&f.name);
            let (bytes, crc) = match measure(&file) {
                Ok(v) => v,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(VerifyError::Missing(file));
                }
                Err(e) => return Err(VerifyError::bad(&file, e.to_string())),
            };
            if bytes != f.bytes {
                return Err(VerifyError::bad(
                    &file,
                    format!("{bytes} bytes, rank {rank}'s marker says {}", f.bytes),
                ));
            }
            if crc != f.crc32 {
                return Err(VerifyError::bad(
                    &file,
                    format!(
                        "checksum {crc:08x}, rank {rank}'s marker says {:08x}: the file is corrupt",
                        f.crc32
                    ),
                ));
            }
        }
    }
    Ok(world)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_make_a_directory_complete_and_catch_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("a.bin"), b"hello").unwrap();
        std::fs::write(d.join("b.bin"), b"world!").unwrap();
        assert!(matches!(verify(d), Err(VerifyError::Missing(p)) if p.ends_with("manifest.json")));
        write_marker(d, 0, 2, &["a.bin".into()]).unwrap();
        std::fs::write(d.join("manifest.json"), br#"{"world_size": 2}"#).unwrap();
        let e = verify(d).unwrap_err();
        assert!(e.to_string().contains("rank-1.json"), "{e}");
        write_marker(d, 1, 2, &["b.bin".into()]).unwrap();
        assert_eq!(verify(d).unwrap(), 2);
        std::fs::write(d.join("b.bin"), b"World!").unwrap();
        let e = verify(d).unwrap_err();
        assert!(
            e.to_string().contains("b.bin") && e.to_string().contains("corrupt"),
            "{e}"
        );
        std::fs::write(d.join("b.bin"), b"w").unwrap();
        let e = verify(d).unwrap_err();
        assert!(e.to_string().contains("1 bytes"), "{e}");
    }
}
