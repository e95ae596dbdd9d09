//! fsync of directories, which makes creations and renames inside them survive a crash.

use std::fs::File;
use std::path::Path;

use crate::CheckpointError;

#[cfg(unix)]
pub(crate) fn sync_directory(directory: &Path) -> Result<(), CheckpointError> {
    File::open(directory)
        .and_then(|handle| handle.sync_all())
        .map_err(CheckpointError::io(directory))
}

/// Windows cannot open directories as files; renames there are as durable as they get.
#[cfg(not(unix))]
pub(crate) fn sync_directory(_directory: &Path) -> Result<(), CheckpointError> {
    Ok(())
}

/// The directory holding `path`; `.` for a bare relative name.
pub(crate) fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}
