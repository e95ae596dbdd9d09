//! Finding the checkpoint to resume from.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::{verify, CheckpointError, Manifest};

/// The newest committed checkpoint that verifies.
#[derive(Debug)]
pub struct LatestCheckpoint {
    pub step: u64,
    pub directory: PathBuf,
    pub manifest: Manifest,
    /// One line for each newer checkpoint that failed verification, saying why.
    pub skipped: Vec<String>,
}

/// Scans the subdirectories of `root` named by a step number (`1000`, `001000`), newest first,
/// and returns the first that verifies. Anything else, such as an uncommitted `.1000.partial`,
/// is ignored.
///
/// `Ok(None)` when there is no committed checkpoint (or no `root`) to resume from; an error when
/// there are some but none verifies, as starting over would silently throw the run away.
pub fn latest_valid(root: &Path) -> Result<Option<LatestCheckpoint>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(CheckpointError::io(root)(error)),
    };
    let mut candidates = Vec::new();
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(root))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(step_of) else {
            continue;
        };
        let path = entry.path();
        if path.is_dir() {
            candidates.push((step, path));
        }
    }
    candidates.sort_unstable_by(|a, b| b.cmp(a));

    let mut skipped = Vec::new();
    for (step, directory) in candidates {
        match verify(&directory) {
            Ok(manifest) => {
                return Ok(Some(LatestCheckpoint {
                    step,
                    directory,
                    manifest,
                    skipped,
                }))
            }
            Err(error) => skipped.push(format!("skipped checkpoint {step}: {error}")),
        }
    }
    if skipped.is_empty() {
        Ok(None)
    } else {
        Err(CheckpointError::NoValidCheckpoint {
            root: root.to_owned(),
            reasons: skipped.join("; "),
        })
    }
}

fn step_of(name: &str) -> Option<u64> {
    if name.is_empty() || !name.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    name.parse().ok()
}
