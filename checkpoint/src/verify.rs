//! Whether a checkpoint directory is complete and intact (see the crate
//! docs), for a worker about to restore from it and for the coordinator
//! admitting a job that starts from it.

use std::path::{Path, PathBuf};

use crate::manifest::MANIFEST;
use crate::marker::{marker_name, measure, RankMarker};
use crate::read::{read_json, VerifyError};

/// What [`verify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    /// The ranks that wrote the checkpoint.
    pub world_size: u32,
    /// False for a checkpoint written before markers existed: complete as
    /// far as anyone can tell, its files unchecked.
    pub marked: bool,
}

/// Checks that `dir` is a complete, intact checkpoint; names the first
/// file missing or wrong.
pub fn verify(dir: &Path) -> Result<Verified, VerifyError> {
    let manifest = dir.join(MANIFEST);
    let world = read_json(&manifest)?
        .get("world_size")
        .and_then(serde_json::Value::as_u64)
        .filter(|&w| w > 0)
        .and_then(|w| u32::try_from(w).ok())
        .ok_or_else(|| VerifyError::bad(&manifest, "no positive world_size"))?;
    let markers: Vec<PathBuf> = (0..world).map(|r| dir.join(marker_name(r))).collect();
    if !markers.iter().any(|m| m.exists()) {
        return Ok(Verified {
            world_size: world,
            marked: false,
        });
    }
    // Completeness first: every rank's marker is there.
    if let Some(missing) = markers.iter().find(|p| !p.exists()) {
        return Err(VerifyError::Missing(missing.clone()));
    }
    for (rank, path) in (0..world).zip(&markers) {
        let m: RankMarker = serde_json::from_value(read_json(path)?)
            .map_err(|e| VerifyError::bad(path, e.to_string()))?;
        if (m.rank, m.world_size) != (rank, world) {
            return Err(VerifyError::bad(
                path,
                format!(
                    "marks rank {} of {}, the manifest expects rank {rank} of {world}",
                    m.rank, m.world_size
                ),
            ));
        }
        for f in &m.files {
            let file = dir.join(&f.name);
            let (bytes, crc) = measure(&file).map_err(|e| VerifyError::io(&file, e))?;
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
    Ok(Verified {
        world_size: world,
        marked: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marker::write_marker;

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
        assert!(
            matches!(&e, VerifyError::Missing(p) if p.ends_with("rank-1.json")),
            "{e}"
        );
        write_marker(d, 1, 2, &["b.bin".into()]).unwrap();
        let whole = Verified {
            world_size: 2,
            marked: true,
        };
        assert_eq!(verify(d).unwrap(), whole);
        std::fs::write(d.join("b.bin"), b"World!").unwrap();
        let e = verify(d).unwrap_err().to_string();
        assert!(e.contains("b.bin") && e.contains("corrupt"), "{e}");
        std::fs::write(d.join("b.bin"), b"w").unwrap();
        let e = verify(d).unwrap_err().to_string();
        assert!(e.contains("1 bytes"), "{e}");
        std::fs::remove_file(d.join("b.bin")).unwrap();
        let e = verify(d).unwrap_err();
        assert!(
            matches!(&e, VerifyError::Missing(p) if p.ends_with("b.bin")),
            "{e}"
        );
    }

    #[test]
    fn unmarked_checkpoints_pass_unverified_and_bad_json_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("manifest.json"), br#"{"world_size": 1}"#).unwrap();
        let old = Verified {
            world_size: 1,
            marked: false,
        };
        assert_eq!(verify(d).unwrap(), old);
        std::fs::write(d.join("rank-0.json"), b"{").unwrap();
        let e = verify(d).unwrap_err();
        assert!(
            matches!(&e, VerifyError::Json { path, .. } if path.ends_with("rank-0.json")),
            "{e}"
        );
        std::fs::write(d.join("manifest.json"), br#"{"world_size": 0}"#).unwrap();
        let e = verify(d).unwrap_err().to_string();
        assert!(e.contains("no positive world_size"), "{e}");
        // A directory where the manifest should be is refused, not read.
        std::fs::remove_file(d.join("manifest.json")).unwrap();
        std::fs::create_dir(d.join("manifest.json")).unwrap();
        let e = verify(d).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
