//! Turning a directory of written files into a committed checkpoint, all or nothing.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::durable::{parent_of, sync_directory};
use crate::file_name::check_file_name;
use crate::manifest::manifest_path;
use crate::{CheckpointError, FileReport};

/// Commits `partial_dir` as `final_dir`: writes `manifest.json` (the object `manifest` plus a
/// `files` entry built from `reports`), fsyncs every reported file, the manifest and the
/// directory, renames `partial_dir` to `final_dir` and fsyncs the parent, so that after a crash
/// `final_dir` either does not exist or is complete.
///
/// `final_dir` must not exist. Every reported file must be in `partial_dir` with the reported size.
pub fn commit(
    partial_dir: &Path,
    final_dir: &Path,
    manifest: Value,
    reports: &[FileReport],
) -> Result<(), CheckpointError> {
    let final_exists = fs::symlink_metadata(final_dir).is_ok();
    if final_exists {
        return Err(CheckpointError::AlreadyExists {
            path: final_dir.to_owned(),
        });
    }
    let manifest_path = manifest_path(partial_dir);
    let Value::Object(mut document) = manifest else {
        return Err(CheckpointError::BadManifest {
            path: manifest_path,
            reason: "the manifest must be a JSON object".into(),
        });
    };
    if document.contains_key("files") {
        return Err(CheckpointError::BadManifest {
            path: manifest_path,
            reason: "\"files\" is filled in from the reports; the caller must not set it".into(),
        });
    }
    document.insert("files".into(), sync_reported_files(partial_dir, reports)?);

    let text = serde_json::to_vec_pretty(&document).expect("a JSON value always serializes");
    File::create(&manifest_path)
        .and_then(|mut file| {
            file.write_all(&text)?;
            file.write_all(b"\n")?;
            file.sync_all()
        })
        .map_err(CheckpointError::io(&manifest_path))?;
    sync_directory(partial_dir)?;

    fs::rename(partial_dir, final_dir).map_err(CheckpointError::io(final_dir))?;
    let (partial_parent, final_parent) = (parent_of(partial_dir), parent_of(final_dir));
    if partial_parent != final_parent {
        sync_directory(partial_parent)?;
    }
    sync_directory(final_parent)
}

/// Checks and fsyncs every reported file (other ranks fsynced theirs, but on a network file
/// system only this makes them durable before the rename), and returns the manifest's `files`.
fn sync_reported_files(directory: &Path, reports: &[FileReport]) -> Result<Value, CheckpointError> {
    let mut seen = HashSet::with_capacity(reports.len());
    let mut files = Map::new();
    for report in reports {
        check_file_name(directory, &report.file_name)?;
        if !seen.insert(report.file_name.as_str()) {
            return Err(CheckpointError::DuplicateFile {
                directory: directory.to_owned(),
                name: report.file_name.clone(),
            });
        }
        let path = directory.join(&report.file_name);
        let file = File::open(&path).map_err(CheckpointError::io(&path))?;
        let actual = file.metadata().map_err(CheckpointError::io(&path))?.len();
        if actual != report.bytes {
            return Err(CheckpointError::SizeMismatch {
                path,
                expected: report.bytes,
                actual,
            });
        }
        file.sync_all().map_err(CheckpointError::io(&path))?;
        files.insert(
            report.file_name.clone(),
            json!({"bytes": report.bytes, "checksum": report.checksum}),
        );
    }
    Ok(Value::Object(files))
}
