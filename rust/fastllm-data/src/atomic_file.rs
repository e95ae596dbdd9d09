//! Whole-file writes that readers see either not at all or complete.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};

use crate::DataError;

/// Writes `path` through a temporary sibling that is fsynced and then renamed over `path`, so a
/// crash or a concurrent reader never sees a partial file. The temporary name carries the process
/// id, so processes racing to write the same file each rename a complete one.
pub(crate) fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> Result<(), DataError> {
    let temporary = temporary_path(path);
    let result = write_and_sync(&temporary, write).and_then(|()| fs::rename(&temporary, path));
    if let Err(source) = result {
        // The temporary file is garbage whether or not it exists; the write error is what matters.
        let _ = fs::remove_file(&temporary);
        return Err(DataError::Io {
            path: path.to_owned(),
            source,
        });
    }
    sync_parent(path).map_err(DataError::io(path))
}

fn temporary_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(format!(".tmp{}", std::process::id()));
    name.into()
}

fn write_and_sync(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    let mut writer = BufWriter::new(File::create(path)?);
    write(&mut writer)?;
    writer
        .into_inner()
        .map_err(io::IntoInnerError::into_error)?
        .sync_all()
}

/// Makes the rename itself durable.
#[cfg(unix)]
fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => File::open(parent)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}

#[cfg(not(unix))]
fn sync_parent(_path: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn writes_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        write_atomically(&path, |w| w.write_all(b"hello")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"hello");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        fs::write(&path, b"old").unwrap();
        let error = write_atomically(&path, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("disk on fire"))
        })
        .unwrap_err();
        assert!(error.to_string().contains("out.bin"), "{error}");
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
