//! The output directory appears complete or not at all: everything is written into a hidden
//! sibling (the staging directory), which is renamed into place once complete and removed on
//! any failure. Staging directories of killed runs are removed by a later run that can tell
//! their writer is gone; the output may be on storage shared by several machines.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::metadata::METADATA_FILE;
use super::progress::Progress;
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

/// Inside a staging directory: who writes it (host, boot, pid namespace, pid), so that only a
/// run that can tell its writer is gone removes it. Taken out before the rename into place.
const OWNER_FILE: &str = ".staging-owner.json";

/// The hidden directory the output is written into; removed when dropped uncommitted.
pub(super) struct PartialDir {
    path: PathBuf,
    output: PathBuf,
    committed: bool,
}

impl PartialDir {
    /// Creates `.NAME.partial-PID-N` next to `output`, recording who writes it, after removing
    /// those of this machine's runs that are gone (killed runs: a partial dataset can be
    /// hundreds of MB) and reporting to `progress` those it cannot tell are gone.
    pub fn create(output: &Path, progress: &Progress) -> Result<Self, PrepareError> {
        let parent = parent_of(output);
        fs::create_dir_all(parent).map_err(PrepareError::io(parent))?;
        let owner = Owner::current();
        clean_staging(output, owner.as_ref(), progress)?;
        // A name in use belongs to another process with our pid (another pid namespace, or
        // another machine on shared storage): take the next number, never its directory.
        let path = loop {
            let number = NEXT_PARTIAL.fetch_add(1, Ordering::Relaxed);
            let path = sibling(output, &format!("partial-{}-{number}", std::process::id()))?;
            match fs::create_dir(&path) {
                Ok(()) => break path,
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(error) => return Err(PrepareError::io(&path)(error)),
            }
        };
        let partial = Self {
            path,
            output: output.to_owned(),
            committed: false,
        };
        if let Some(owner) = owner {
            let record = partial.path.join(OWNER_FILE);
            let text = serde_json::to_string(&owner).expect("an owner serializes");
            fs::write(&record, text).map_err(PrepareError::io(&record))?;
        }
        Ok(partial)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the directory to the output, replacing an existing output (`overwrite`) only
    /// now that the new one is complete.
    pub fn commit(mut self, overwrite: bool) -> Result<(), PrepareError> {
        check_output(&self.output, overwrite)?;
        let record = self.path.join(OWNER_FILE);
        match fs::remove_file(&record) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                return Err(PrepareError::io(&record)(error))
            }
            _ => {}
        }
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

/// The process writing a staging directory. A pid means something only on its own machine
/// (boot) and in its own pid namespace: a run elsewhere on shared storage, or in another
/// container, cannot see that process in its `/proc`.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Owner {
    host: String,
    boot_id: String,
    pid_namespace: String,
    pid: u32,
}

impl Owner {
    /// This process; `None` where the system does not say (not Linux), and then no staging
    /// directory is ever removed.
    fn current() -> Option<Self> {
        let read = |path: &str| Some(fs::read_to_string(path).ok()?.trim().to_owned());
        Some(Self {
            host: read("/proc/sys/kernel/hostname")?,
            boot_id: read("/proc/sys/kernel/random/boot_id")?,
            pid_namespace: fs::read_link("/proc/self/ns/pid")
                .ok()?
                .to_string_lossy()
                .into_owned(),
            pid: std::process::id(),
        })
    }

    fn read(staging: &Path) -> Option<Self> {
        serde_json::from_slice(&fs::read(staging.join(OWNER_FILE)).ok()?).ok()
    }

    /// Whether `self` ran where `me` runs, so that `/proc` tells whether it still does.
    fn is_local_to(&self, me: &Self) -> bool {
        (&self.host, &self.boot_id, &self.pid_namespace)
            == (&me.host, &me.boot_id, &me.pid_namespace)
    }
}

/// Removes the `.NAME.partial-*` siblings of `output` whose run is gone: recorded on this
/// machine, in this pid namespace, by a process that no longer runs. A process id in use again
/// by an unrelated process keeps its directory: better garbage than a live run's files lost.
/// Those written elsewhere (another host or container), or without a record (a prepare older
/// than the record, or one just starting), are kept and reported: no process table here says
/// whether their run is over.
fn clean_staging(
    output: &Path,
    me: Option<&Owner>,
    progress: &Progress,
) -> Result<(), PrepareError> {
    let (parent, Some(name)) = (parent_of(output), output.file_name()) else {
        return Ok(());
    };
    let mut prefix = OsStr::new(".").to_owned();
    prefix.push(name);
    prefix.push(".partial-");
    let prefix = prefix.as_encoded_bytes();
    for entry in fs::read_dir(parent).map_err(PrepareError::io(parent))? {
        let entry = entry.map_err(PrepareError::io(parent))?;
        if !entry.file_name().as_encoded_bytes().starts_with(prefix) {
            continue;
        }
        let path = entry.path();
        let owner = Owner::read(&path);
        let kept = match (&owner, me) {
            (Some(owner), Some(me)) if owner.is_local_to(me) => {
                if owner.pid != me.pid && !process_runs(owner.pid) {
                    match fs::remove_dir_all(&path) {
                        // Another run of prepare removed it first.
                        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                        result => result.map_err(PrepareError::io(&path))?,
                    }
                }
                continue;
            }
            (Some(owner), _) => format!(
                "written by process {} on {} (boot {}, pid namespace {}), which this run \
                 cannot see",
                owner.pid, owner.host, owner.boot_id, owner.pid_namespace
            ),
            (None, _) => "it records no writer (a prepare older than this one's, or one just \
                          starting)"
                .to_owned(),
        };
        progress.warn(format!(
            "{}: staging directory kept: {kept}; remove it once no prepare writes it",
            path.display()
        ));
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
