mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use common::f32_tensor;
use fastllm_checkpoint::{commit, latest_valid, verify, write_file, CheckpointError, FileReport};
use serde_json::json;

/// Writes one file per rank into `root/.{step}.partial` and commits it as `root/{step}`.
fn write_checkpoint(root: &Path, step: u64, ranks: usize) -> PathBuf {
    let partial = root.join(format!(".{step}.partial"));
    let reports = write_ranks(&partial, step, ranks);
    let final_dir = root.join(step.to_string());
    commit(&partial, &final_dir, json!({"step": step}), &reports).unwrap();
    final_dir
}

fn write_ranks(partial: &Path, step: u64, ranks: usize) -> Vec<FileReport> {
    fs::create_dir_all(partial).unwrap();
    (0..ranks)
        .map(|rank| {
            let values: Vec<f32> = (0..1000)
                .map(|i| (i * (rank + 1)) as f32 + step as f32)
                .collect();
            let path = partial.join(format!("rank_{rank}.safetensors"));
            write_file(&path, &[f32_tensor("w", &values)], &BTreeMap::new()).unwrap()
        })
        .collect()
}

fn flip_byte(path: &Path, position: u64) {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0];
    file.seek(SeekFrom::Start(position)).unwrap();
    std::io::Read::read_exact(&mut file, &mut byte).unwrap();
    file.seek(SeekFrom::Start(position)).unwrap();
    file.write_all(&[byte[0] ^ 0x10]).unwrap();
}

#[test]
fn a_committed_checkpoint_verifies_and_its_manifest_lists_every_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = write_checkpoint(root.path(), 100, 3);
    assert!(!root.path().join(".100.partial").exists());

    let manifest = verify(&dir).unwrap();
    assert_eq!(manifest.document["step"], 100);
    assert_eq!(manifest.files.len(), 3);
    let entry = &manifest.files["rank_1.safetensors"];
    assert_eq!(
        entry.bytes,
        fs::metadata(dir.join("rank_1.safetensors")).unwrap().len()
    );
    assert_eq!(
        manifest.document["files"]["rank_1.safetensors"]["checksum"],
        entry.checksum
    );
}

#[test]
fn a_corrupted_byte_fails_verification_naming_the_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = write_checkpoint(root.path(), 100, 2);
    flip_byte(&dir.join("rank_1.safetensors"), 2000);
    let error = verify(&dir).unwrap_err();
    assert!(
        matches!(error, CheckpointError::ChecksumMismatch { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("rank_1.safetensors"), "{error}");
}

#[test]
fn a_truncated_file_fails_verification_naming_the_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = write_checkpoint(root.path(), 100, 2);
    let path = dir.join("rank_0.safetensors");
    let len = fs::metadata(&path).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let error = verify(&dir).unwrap_err();
    assert!(
        matches!(error, CheckpointError::SizeMismatch { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("rank_0.safetensors"), "{error}");
}

#[test]
fn a_missing_file_or_manifest_fails_verification() {
    let root = tempfile::tempdir().unwrap();
    let dir = write_checkpoint(root.path(), 100, 2);
    fs::remove_file(dir.join("rank_0.safetensors")).unwrap();
    let error = verify(&dir).unwrap_err();
    assert!(error.to_string().contains("rank_0.safetensors"), "{error}");

    fs::remove_file(dir.join("manifest.json")).unwrap();
    assert!(matches!(
        verify(&dir),
        Err(CheckpointError::MissingManifest { .. })
    ));
}

#[test]
fn a_manifest_pointing_outside_the_checkpoint_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("5");
    fs::create_dir(&dir).unwrap();
    let manifest = json!({"files": {"../secret": {"bytes": 0, "checksum": "0"}}});
    fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
    assert!(matches!(
        verify(&dir),
        Err(CheckpointError::BadFileName { .. })
    ));
    fs::write(dir.join("manifest.json"), "{\"files\": 3}").unwrap();
    assert!(matches!(
        verify(&dir),
        Err(CheckpointError::BadManifest { .. })
    ));
}

#[test]
fn commit_refuses_an_existing_final_directory_and_leaves_the_partial_one() {
    let root = tempfile::tempdir().unwrap();
    let partial = root.path().join(".200.partial");
    let reports = write_ranks(&partial, 200, 1);
    let final_dir = root.path().join("200");
    fs::create_dir(&final_dir).unwrap();
    let error = commit(&partial, &final_dir, json!({}), &reports).unwrap_err();
    assert!(
        matches!(error, CheckpointError::AlreadyExists { .. }),
        "{error}"
    );
    assert!(partial.join("rank_0.safetensors").exists());
    assert_eq!(fs::read_dir(&final_dir).unwrap().count(), 0);
}

#[test]
fn commit_refuses_a_report_that_does_not_match_the_file() {
    let root = tempfile::tempdir().unwrap();
    let partial = root.path().join(".200.partial");
    let mut reports = write_ranks(&partial, 200, 2);
    reports[1].bytes += 1;
    let error = commit(&partial, &root.path().join("200"), json!({}), &reports).unwrap_err();
    assert!(
        matches!(error, CheckpointError::SizeMismatch { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("rank_1.safetensors"), "{error}");
    assert!(!root.path().join("200").exists());

    reports[1] = reports[0].clone();
    let error = commit(&partial, &root.path().join("200"), json!({}), &reports).unwrap_err();
    assert!(
        matches!(error, CheckpointError::DuplicateFile { .. }),
        "{error}"
    );
}

#[test]
fn commit_refuses_a_manifest_that_is_not_an_object_or_sets_files() {
    let root = tempfile::tempdir().unwrap();
    let partial = root.path().join(".1.partial");
    let reports = write_ranks(&partial, 1, 1);
    let final_dir = root.path().join("1");
    for manifest in [json!([1, 2]), json!({"files": {}})] {
        let error = commit(&partial, &final_dir, manifest, &reports).unwrap_err();
        assert!(
            matches!(error, CheckpointError::BadManifest { .. }),
            "{error}"
        );
    }
}

#[test]
fn latest_valid_never_picks_a_partial_directory() {
    let root = tempfile::tempdir().unwrap();
    write_checkpoint(root.path(), 100, 1);
    // Newer, complete-looking but uncommitted: written, never renamed.
    for partial in [".300.partial", "300.partial", ".300"] {
        let dir = root.path().join(partial);
        let reports = write_ranks(&dir, 300, 1);
        let manifest = json!({"files": {"rank_0.safetensors": {"bytes": reports[0].bytes, "checksum": reports[0].checksum}}});
        fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
    }
    fs::write(root.path().join("400"), b"a file, not a checkpoint").unwrap();

    let latest = latest_valid(root.path()).unwrap().unwrap();
    assert_eq!(latest.step, 100);
    assert_eq!(latest.directory, root.path().join("100"));
    assert_eq!(latest.manifest.document["step"], 100);
    assert!(latest.skipped.is_empty(), "{:?}", latest.skipped);
}

#[test]
fn latest_valid_skips_a_newer_corrupt_checkpoint_with_a_warning() {
    let root = tempfile::tempdir().unwrap();
    write_checkpoint(root.path(), 100, 2);
    let newer = write_checkpoint(root.path(), 1000, 2);
    write_checkpoint(root.path(), 50, 2);
    flip_byte(&newer.join("rank_1.safetensors"), 100);

    let latest = latest_valid(root.path()).unwrap().unwrap();
    assert_eq!(latest.step, 100);
    assert_eq!(latest.skipped.len(), 1);
    let warning = &latest.skipped[0];
    assert!(
        warning.contains("1000") && warning.contains("rank_1.safetensors"),
        "{warning}"
    );
}

#[test]
fn latest_valid_compares_steps_as_numbers() {
    let root = tempfile::tempdir().unwrap();
    write_checkpoint(root.path(), 9, 1);
    write_checkpoint(root.path(), 10, 1);
    assert_eq!(latest_valid(root.path()).unwrap().unwrap().step, 10);
}

#[test]
fn latest_valid_is_none_without_checkpoints_and_an_error_when_all_are_bad() {
    let root = tempfile::tempdir().unwrap();
    assert!(latest_valid(&root.path().join("missing"))
        .unwrap()
        .is_none());
    assert!(latest_valid(root.path()).unwrap().is_none());

    let dir = write_checkpoint(root.path(), 7, 1);
    fs::remove_file(dir.join("manifest.json")).unwrap();
    let error = latest_valid(root.path()).unwrap_err();
    assert!(
        matches!(error, CheckpointError::NoValidCheckpoint { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("manifest.json"), "{error}");
}
