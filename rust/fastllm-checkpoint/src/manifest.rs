//! `manifest.json`: the caller's description of a checkpoint plus the size and checksum of every
//! file, which [`verify`] checks before anything is loaded.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::checksum::checksum_of;
use crate::file_name::check_file_name;
use crate::CheckpointError;

pub const MANIFEST_FILE_NAME: &str = "manifest.json";

/// A verified manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// The whole JSON object: the caller's fields and `files`.
    pub document: serde_json::Value,
    pub files: BTreeMap<String, FileEntry>,
}

/// One file of a checkpoint, as listed under the manifest's `files`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    /// xxh3-64 of the whole file, 16 lowercase hex digits.
    pub checksum: String,
}

/// Reads `directory/manifest.json` and checks that every file it lists exists with the listed
/// size and checksum; files are hashed in parallel. The error names the first bad file.
pub fn verify(directory: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = read_manifest(directory)?;
    let checks: Vec<Result<(), CheckpointError>> = manifest
        .files
        .par_iter()
        .map(|(name, entry)| check_file(&directory.join(name), entry))
        .collect();
    checks.into_iter().collect::<Result<(), _>>()?;
    Ok(manifest)
}

fn read_manifest(directory: &Path) -> Result<Manifest, CheckpointError> {
    let path = manifest_path(directory);
    let text = fs::read(&path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => CheckpointError::MissingManifest {
            directory: directory.to_owned(),
        },
        _ => CheckpointError::Io {
            path: path.clone(),
            source,
        },
    })?;
    let bad = |reason: String| CheckpointError::BadManifest {
        path: path.clone(),
        reason,
    };
    let document: serde_json::Value =
        serde_json::from_slice(&text).map_err(|error| bad(error.to_string()))?;
    let files = document
        .get("files")
        .ok_or_else(|| bad("no \"files\" entry".into()))?;
    let files = BTreeMap::<String, FileEntry>::deserialize(files)
        .map_err(|error| bad(format!("\"files\": {error}")))?;
    for name in files.keys() {
        check_file_name(directory, name)?;
    }
    Ok(Manifest { document, files })
}

fn check_file(path: &Path, entry: &FileEntry) -> Result<(), CheckpointError> {
    let file = File::open(path).map_err(CheckpointError::io(path))?;
    let actual = file.metadata().map_err(CheckpointError::io(path))?.len();
    if actual != entry.bytes {
        return Err(CheckpointError::SizeMismatch {
            path: path.to_owned(),
            expected: entry.bytes,
            actual,
        });
    }
    let actual = checksum_of(file).map_err(CheckpointError::io(path))?;
    if actual != entry.checksum {
        return Err(CheckpointError::ChecksumMismatch {
            path: path.to_owned(),
            expected: entry.checksum.clone(),
            actual,
        });
    }
    Ok(())
}

/// Where the manifest of `directory` lives.
pub(crate) fn manifest_path(directory: &Path) -> PathBuf {
    directory.join(MANIFEST_FILE_NAME)
}
