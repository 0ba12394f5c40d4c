//! Files a user names (job specs, model configs, tokenizers, chat
//! templates, dataset files, checkpoint files): what a path is, checked
//! with `stat` before anything opens it, so a directory, a named pipe or a
//! device is called what it is instead of "file not found", opening a FIFO
//! never blocks, and `/dev/zero` is never read until memory runs out.
//!
//! Files a spec names must be regular files ([`check`], [`read`]): the
//! coordinator reads them again after a restart and workers read some of
//! them. The job spec given on the command line may also be a pipe
//! (`accrue validate <(sed ... job.toml)`): [`read_spec`] reads it as a
//! stream, up to its size limit, and refuses a FIFO that no process writes
//! to instead of waiting for one.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest job spec, model `config.json`, chat template or JSON
/// manifest read whole (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest `tokenizer.json` (real ones are 2–35 MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// What a path is when it is not a readable regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRegular {
    Directory,
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
    Other,
}

impl fmt::Display for NotRegular {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotRegular::Directory => "a directory",
            NotRegular::Fifo => "a named pipe (FIFO)",
            NotRegular::CharDevice => "a character device",
            NotRegular::BlockDevice => "a block device",
            NotRegular::Socket => "a socket",
            NotRegular::Other => "not a regular file",
        })
    }
}

/// Why a named file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("file not found: {}", path.display())]
    NotFound { path: PathBuf },
    #[error("not a file: {} is {kind}", path.display())]
    NotRegular { path: PathBuf, kind: NotRegular },
    #[error("nothing to read: {} is a named pipe (FIFO) that no process is writing to", path.display())]
    NoWriter { path: PathBuf },
    #[error("too large: {} gives more than the {limit} bytes a {what} may have", path.display())]
    StreamTooLarge {
        path: PathBuf,
        limit: u64,
        what: &'static str,
    },
    #[error("file too large: {} has {bytes} bytes, more than the {limit} a {what} may have", path.display())]
    TooLarge {
        path: PathBuf,
        bytes: u64,
        limit: u64,
        what: &'static str,
    },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl InputError {
    pub fn path(&self) -> &Path {
        match self {
            InputError::NotFound { path }
            | InputError::NotRegular { path, .. }
            | InputError::NoWriter { path }
            | InputError::StreamTooLarge { path, .. }
            | InputError::TooLarge { path, .. }
            | InputError::Io { path, .. } => path,
        }
    }

    pub fn io(path: &Path, source: std::io::Error) -> InputError {
        match source.kind() {
            std::io::ErrorKind::NotFound => InputError::NotFound {
                path: path.to_path_buf(),
            },
            _ => InputError::Io {
                path: path.to_path_buf(),
                source,
            },
        }
    }
}

/// Checks that `path` (symlinks followed) is a regular file, without
/// opening it; returns its size.
pub fn check(path: &Path) -> Result<u64, InputError> {
    let meta = std::fs::metadata(path).map_err(|e| InputError::io(path, e))?;
    let ty = meta.file_type();
    if ty.is_file() {
        return Ok(meta.len());
    }
    Err(InputError::NotRegular {
        path: path.to_path_buf(),
        kind: kind_of(&ty),
    })
}

fn kind_of(ty: &std::fs::FileType) -> NotRegular {
    if ty.is_dir() {
        return NotRegular::Directory;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ty.is_fifo() {
            return NotRegular::Fifo;
        }
        if ty.is_char_device() {
            return NotRegular::CharDevice;
        }
        if ty.is_block_device() {
            return NotRegular::BlockDevice;
        }
        if ty.is_socket() {
            return NotRegular::Socket;
        }
    }
    NotRegular::Other
}

/// Reads a regular file of at most `limit` bytes (`what` names the kind
/// of file in the error: "job spec", "model config", ...).
pub fn read(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, InputError> {
    let bytes = check(path)?;
    let too_large = |bytes| InputError::TooLarge {
        path: path.to_path_buf(),
        bytes,
        limit,
        what,
    };
    if bytes > limit {
        return Err(too_large(bytes));
    }
    let file = std::fs::File::open(path).map_err(|e| InputError::io(path, e))?;
    // The file may grow between stat and read: read one byte past the limit
    // to notice.
    let mut out = Vec::with_capacity(bytes as usize);
    file.take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| InputError::io(path, e))?;
    if out.len() as u64 > limit {
        return Err(too_large(out.len() as u64));
    }
    Ok(out)
}

/// [`read`] as UTF-8 text.
pub fn read_to_string(path: &Path, limit: u64, what: &'static str) -> Result<String, InputError> {
    utf8(path, read(path, limit, what)?)
}

fn utf8(path: &Path, bytes: Vec<u8>) -> Result<String, InputError> {
    String::from_utf8(bytes).map_err(|e| InputError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not utf-8 text: {e}"),
        ),
    })
}

/// Reads the job spec given on the command line: a regular file as
/// [`read_to_string`] does; a pipe, FIFO or device as a stream of at most
/// `limit` bytes (a FIFO no process writes to is an error at once).
pub fn read_spec(path: &Path, limit: u64) -> Result<String, InputError> {
    const WHAT: &str = "job spec";
    match check(path) {
        Ok(_) => read_to_string(path, limit, WHAT),
        Err(InputError::NotRegular { kind, .. }) if kind != NotRegular::Directory => {
            let file = open_without_blocking(path).map_err(|e| InputError::io(path, e))?;
            let mut out = Vec::new();
            file.take(limit + 1)
                .read_to_end(&mut out)
                .map_err(|e| InputError::io(path, e))?;
            if out.len() as u64 > limit {
                return Err(InputError::StreamTooLarge {
                    path: path.to_path_buf(),
                    limit,
                    what: WHAT,
                });
            }
            if out.is_empty() && kind == NotRegular::Fifo {
                return Err(InputError::NoWriter {
                    path: path.to_path_buf(),
                });
            }
            utf8(path, out)
        }
        Err(e) => Err(e),
    }
}

/// Opens `path` for reading without waiting for a FIFO's writer, then makes
/// reads blocking again: a pipe with a writer is read to its end, one
/// without reads as empty.
#[cfg(unix)]
fn open_without_blocking(path: &Path) -> std::io::Result<std::fs::File> {
    use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    fcntl_setfl(&file, fcntl_getfl(&file)? - OFlags::NONBLOCK)?;
    Ok(file)
}

#[cfg(not(unix))]
fn open_without_blocking(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::File::open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_path_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let missing = d.join("nope.toml");
        assert_eq!(
            check(&missing).unwrap_err().to_string(),
            format!("file not found: {}", missing.display())
        );
        assert_eq!(
            check(d).unwrap_err().to_string(),
            format!("not a file: {} is a directory", d.display())
        );
        #[cfg(unix)]
        {
            let zero = Path::new("/dev/zero");
            if zero.exists() {
                let e = read(zero, MAX_CONFIG_BYTES, "job spec").unwrap_err();
                assert_eq!(e.to_string(), "not a file: /dev/zero is a character device");
            }
        }
        let big = d.join("big.json");
        std::fs::write(&big, vec![b' '; 100]).unwrap();
        let e = read(&big, 10, "model config").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "file too large: {} has 100 bytes, more than the 10 a model config may have",
                big.display()
            )
        );
        assert_eq!(read(&big, 100, "model config").unwrap().len(), 100);
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_named_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.jsonl");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        // Opening a FIFO for reading blocks until a writer comes; the
        // check must not open it.
        let e = read_to_string(&fifo, MAX_CONFIG_BYTES, "model config").unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("not a file: {} is a named pipe (FIFO)", fifo.display())
        );
        // A spec on the command line may be a pipe, but one nobody writes
        // to is refused at once rather than waited on.
        let e = read_spec(&fifo, MAX_CONFIG_BYTES).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "nothing to read: {} is a named pipe (FIFO) that no process is writing to",
                fifo.display()
            )
        );
        // With a writer, it is read to its end.
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, "[job]\n").unwrap())
        };
        // Wait until the writer has opened its end (the read below must not
        // race ahead of it).
        let mut text = String::new();
        for _ in 0..200 {
            text = read_spec(&fifo, MAX_CONFIG_BYTES).unwrap_or_default();
            if !text.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        writer.join().unwrap();
        assert_eq!(text, "[job]\n");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_as_the_spec_is_read_up_to_its_limit() {
        let zero = Path::new("/dev/zero");
        if !zero.exists() {
            return;
        }
        let e = read_spec(zero, 1000).unwrap_err();
        assert_eq!(
            e.to_string(),
            "too large: /dev/zero gives more than the 1000 bytes a job spec may have"
        );
        assert_eq!(read_spec(Path::new("/dev/null"), 1000).unwrap(), "");
    }
}
