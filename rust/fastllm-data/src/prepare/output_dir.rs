//! The output directory appears complete or not at all: everything is written into a hidden
//! sibling, which is renamed into place once complete and removed on any failure.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::metadata::METADATA_FILE;
use crate::PrepareError;

/// Numbers the partial directories of one process, so concurrent runs never share one.
static NEXT_PARTIAL: AtomicU64 = AtomicU64::new(0);

/// Fails unless `output` is absent, or `overwrite` and it is a dataset (or an empty directory):
/// `overwrite` must not delete a directory that someone pointed at by mistake.
pub(super) fn check_output(output: &Path, overwrite: bool) -> Result<(), PrepareError> {
    let metadata = match fs::symlink_metadata(output) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        result => result.map_err(PrepareError::io(output))?,
    };
    if !overwrite {
        return Err(PrepareError::OutputExists {
            path: output.to_owned(),
        });
    }
    let is_dataset = metadata.is_dir()
        && (output.join(METADATA_FILE).is_file()
            || fs::read_dir(output)
                .map_err(PrepareError::io(output))?
                .next()
                .is_none());
    if !is_dataset {
        return Err(PrepareError::NotADataset {
            path: output.to_owned(),
        });
    }
    Ok(())
}

/// The hidden directory the output is written into; removed when dropped uncommitted.
pub(super) struct PartialDir {
    path: PathBuf,
    output: PathBuf,
    committed: bool,
}

impl PartialDir {
    /// Creates `.NAME.partial-PID-N` next to `output`, first removing those of processes that
    /// are gone (killed runs: a partial dataset can be hundreds of MB).
    pub fn create(output: &Path) -> Result<Self, PrepareError> {
        let number = NEXT_PARTIAL.fetch_add(1, Ordering::Relaxed);
        let path = sibling(output, &format!("partial-{}-{number}", std::process::id()))?;
        let parent = path.parent().expect("a sibling has a parent");
        fs::create_dir_all(parent).map_err(PrepareError::io(parent))?;
        remove_dead_partials(output)?;
        if let Err(error) = fs::create_dir(&path) {
            if error.kind() != io::ErrorKind::AlreadyExists {
                return Err(PrepareError::io(&path)(error));
            }
            // Left by a dead process that had our process id.
            fs::remove_dir_all(&path).map_err(PrepareError::io(&path))?;
            fs::create_dir(&path).map_err(PrepareError::io(&path))?;
        }
        Ok(Self {
            path,
            output: output.to_owned(),
            committed: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the directory to the output, replacing an existing output (`overwrite`) only
    /// now that the new one is complete.
    pub fn commit(mut self, overwrite: bool) -> Result<(), PrepareError> {
        check_output(&self.output, overwrite)?;
        let output = &self.output;
        if fs::symlink_metadata(output).is_ok() {
            let old = sibling(output, &format!("old-{}", std::process::id()))?;
            fs::rename(output, &old).map_err(PrepareError::io(output))?;
            if let Err(error) = fs::rename(&self.path, output) {
                // Put the old output back: failing must leave things as they were.
                let _ = fs::rename(&old, output);
                return Err(PrepareError::io(output)(error));
            }
            self.committed = true;
            // The new output is in place; a leftover hidden `.old` directory is only garbage.
            let _ = fs::remove_dir_all(&old);
        } else {
            fs::rename(&self.path, output).map_err(PrepareError::io(output))?;
            self.committed = true;
        }
        sync_parent(output).map_err(PrepareError::io(output))
    }
}

impl Drop for PartialDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: an error already on its way matters more than leftover files.
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes the `.NAME.partial-PID-N` siblings of `output` whose process no longer runs. A
/// process id in use again by an unrelated process keeps its directory: better garbage than a
/// live run's files lost. Only on Linux, where `/proc` says which processes run.
fn remove_dead_partials(output: &Path) -> Result<(), PrepareError> {
    let (parent, Some(name)) = (parent_of(output), output.file_name()) else {
        return Ok(());
    };
    let mut prefix = OsStr::new(".").to_owned();
    prefix.push(name);
    prefix.push(".partial-");
    let prefix = prefix.as_encoded_bytes();
    for entry in fs::read_dir(parent).map_err(PrepareError::io(parent))? {
        let entry = entry.map_err(PrepareError::io(parent))?;
        let file_name = entry.file_name();
        let Some(rest) = file_name.as_encoded_bytes().strip_prefix(prefix) else {
            continue;
        };
        let pid = std::str::from_utf8(rest)
            .ok()
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        if pid.is_some_and(|pid| pid != std::process::id() && !process_runs(pid)) {
            let path = entry.path();
            match fs::remove_dir_all(&path) {
                // Another run of prepare removed it first.
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                result => result.map_err(PrepareError::io(&path))?,
            }
        }
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn process_runs(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

#[cfg(not(target_os = "linux"))]
fn process_runs(_pid: u32) -> bool {
    true
}

/// `.NAME.SUFFIX` in the directory of `output`.
fn sibling(output: &Path, suffix: &str) -> Result<PathBuf, PrepareError> {
    let name = output
        .file_name()
        .ok_or_else(|| PrepareError::BadOutputPath {
            path: output.to_owned(),
        })?;
    let mut hidden = OsStr::new(".").to_owned();
    hidden.push(name);
    hidden.push(format!(".{suffix}"));
    Ok(parent_of(output).join(hidden))
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// Makes the rename durable.
#[cfg(unix)]
fn sync_parent(path: &Path) -> io::Result<()> {
    fs::File::open(parent_of(path))?.sync_all()
}

#[cfg(not(unix))]
fn sync_parent(_path: &Path) -> io::Result<()> {
    Ok(())
}
