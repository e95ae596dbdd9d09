use std::fs;
use std::path::{Path, PathBuf};

use fastllm_data::{CacheStatus, Cancel, DataError, SamplingConfig, SamplingIndex, SamplingMode};

fn lengths() -> Vec<u32> {
    (0..40).map(|d| (d * 7919) % 23).collect()
}

fn config() -> SamplingConfig {
    SamplingConfig {
        sequence_length: 16,
        num_samples: 100,
        seed: 5,
        mode: SamplingMode::Packed,
    }
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn save_then_load_gives_the_same_index() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
        let index = SamplingIndex::build(&lengths(), SamplingConfig { mode, ..config() }).unwrap();
        let path = dir.path().join("index.bin");
        index.save(&path).unwrap();
        assert!(SamplingIndex::load(&path).unwrap() == index);
    }
    assert_eq!(files(dir.path()), [dir.path().join("index.bin")]);
}

#[test]
fn a_valid_cache_is_reused() {
    let dir = tempfile::tempdir().unwrap();
    let (built, status) =
        SamplingIndex::load_or_build(dir.path(), &lengths(), config(), &Cancel::default()).unwrap();
    assert_eq!(status, CacheStatus::Built);
    let (reused, status) =
        SamplingIndex::load_or_build(dir.path(), &lengths(), config(), &Cancel::default()).unwrap();
    assert_eq!(status, CacheStatus::Reused);
    assert!(built == reused);
    let name = format!("sampling_{:016x}.bin", built.inputs_hash());
    assert_eq!(files(dir.path()), [dir.path().join(name)]);
}

#[test]
fn changing_any_input_rebuilds() {
    let dir = tempfile::tempdir().unwrap();
    SamplingIndex::load_or_build(dir.path(), &lengths(), config(), &Cancel::default()).unwrap();

    let mut other_lengths = lengths();
    other_lengths[17] += 1;
    let variants = [
        (other_lengths, config()),
        (
            lengths(),
            SamplingConfig {
                sequence_length: 17,
                ..config()
            },
        ),
        (
            lengths(),
            SamplingConfig {
                num_samples: 101,
                ..config()
            },
        ),
        (
            lengths(),
            SamplingConfig {
                seed: 6,
                ..config()
            },
        ),
        (
            lengths(),
            SamplingConfig {
                mode: SamplingMode::Truncated,
                ..config()
            },
        ),
    ];
    let mut hashes = vec![SamplingIndex::build(&lengths(), config())
        .unwrap()
        .inputs_hash()];
    for (lengths, config) in variants {
        let (index, status) =
            SamplingIndex::load_or_build(dir.path(), &lengths, config, &Cancel::default()).unwrap();
        assert_eq!(status, CacheStatus::Built, "{config:?}");
        assert!(
            index == SamplingIndex::build(&lengths, config).unwrap(),
            "{config:?}"
        );
        assert!(!hashes.contains(&index.inputs_hash()), "{config:?}");
        hashes.push(index.inputs_hash());
    }
}

#[test]
fn signed_and_unsigned_lengths_share_a_cache() {
    let dir = tempfile::tempdir().unwrap();
    let signed: Vec<i32> = lengths().iter().map(|&l| l as i32).collect();
    SamplingIndex::load_or_build(dir.path(), &signed, config(), &Cancel::default()).unwrap();
    let (_, status) =
        SamplingIndex::load_or_build(dir.path(), &lengths(), config(), &Cancel::default()).unwrap();
    assert_eq!(status, CacheStatus::Reused);
}

fn cached_file(dir: &Path) -> PathBuf {
    let (index, _) =
        SamplingIndex::load_or_build(dir, &lengths(), config(), &Cancel::default()).unwrap();
    dir.join(format!("sampling_{:016x}.bin", index.inputs_hash()))
}

#[test]
fn a_corrupt_cache_is_detected_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let path = cached_file(dir.path());
    let good = fs::read(&path).unwrap();
    // One byte in the header's inputs hash, the lengths, the order and the sample starts.
    for at in [20, 100, 300, good.len() - 3] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        fs::write(&path, &bad).unwrap();
        let error = SamplingIndex::load(&path).err().unwrap();
        assert!(
            matches!(error, DataError::CorruptCache { .. }),
            "byte {at}: {error}"
        );
        assert!(
            error.to_string().contains(&path.display().to_string()),
            "{error}"
        );

        let (index, status) =
            SamplingIndex::load_or_build(dir.path(), &lengths(), config(), &Cancel::default())
                .unwrap();
        assert_eq!(status, CacheStatus::Built, "byte {at}");
        assert!(index == SamplingIndex::build(&lengths(), config()).unwrap());
        assert_eq!(fs::read(&path).unwrap(), good, "the cache is repaired");
    }
}

#[test]
fn a_truncated_or_foreign_cache_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = cached_file(dir.path());
    let good = fs::read(&path).unwrap();
    for bad in [
        &good[..good.len() - 1],
        &good[..50],
        b"MMIDIDX\x00\x00 and more bytes".as_slice(),
    ] {
        fs::write(&path, bad).unwrap();
        let error = SamplingIndex::load(&path).err().unwrap();
        assert!(matches!(error, DataError::CorruptCache { .. }), "{error}");
    }
    fs::remove_file(&path).unwrap();
    assert!(matches!(
        SamplingIndex::load(&path),
        Err(DataError::Io { .. })
    ));
}
