//! Writes that survive a crash: a file is whole under its name or absent.

use std::io::Write;
use std::path::Path;

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
