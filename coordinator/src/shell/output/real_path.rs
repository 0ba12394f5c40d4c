//! Where a directory really is, for comparing output directories by
//! identity rather than by spelling (issue 33, finding 8): `runs/x/../a`,
//! a link to `runs/a` and `runs/a` itself are one directory.

use std::path::{Component, Path, PathBuf};

/// `dir` with every link and `..` resolved, whether or not it exists yet:
/// its deepest existing ancestor canonicalized (the filesystem resolves
/// links and `..` there), the missing components after it appended as
/// written. Below a missing directory nothing can be a link, so a `..`
/// there only drops the component before it.
pub fn real_path(dir: &Path) -> PathBuf {
    let parts: Vec<Component> = dir.components().collect();
    for kept in (0..=parts.len()).rev() {
        let head: PathBuf = parts[..kept].iter().collect();
        let probe = if head.as_os_str().is_empty() {
            Path::new(".")
        } else {
            &head
        };
        let Ok(mut real) = std::fs::canonicalize(probe) else {
            continue;
        };
        for c in &parts[kept..] {
            match c {
                Component::ParentDir => {
                    real.pop();
                }
                Component::Normal(name) => real.push(name),
                Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
            }
        }
        return real;
    }
    // Not even the working directory resolves: the path as written.
    dir.to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_of_one_directory_resolve_alike_existing_or_not() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(d.path()).unwrap();
        let a = root.join("runs/a");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(root.join("runs/x")).unwrap();
        std::os::unix::fs::symlink(&a, root.join("link")).unwrap();
        for spelling in [
            "runs/a",
            "runs/x/../a",
            "runs/missing/../a",
            "link",
            "./runs/a/",
        ] {
            assert_eq!(real_path(&d.path().join(spelling)), a, "{spelling}");
        }
        assert_eq!(real_path(&d.path().join("link/new/dir")), a.join("new/dir"));
        assert_eq!(
            real_path(&d.path().join("runs/new/../../b")),
            root.join("b")
        );
    }
}
