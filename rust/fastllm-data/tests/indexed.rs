use std::fs;
use std::path::{Path, PathBuf};

use fastllm_data::{DataError, IndexedDataset, IndexedDatasetWriter, TokenDtype, TokenSlice};
use proptest::prelude::*;

/// An `.idx` file laid out byte by byte as Megatron's `_IndexWriter` writes it.
fn megatron_idx(code: u8, lengths: &[i32], pointers: &[i64], document_indices: &[i64]) -> Vec<u8> {
    let mut bytes = b"MMIDIDX\x00\x00".to_vec();
    bytes.extend(1u64.to_le_bytes());
    bytes.push(code);
    bytes.extend((lengths.len() as u64).to_le_bytes());
    bytes.extend((document_indices.len() as u64).to_le_bytes());
    lengths.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
    pointers.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
    document_indices
        .iter()
        .for_each(|v| bytes.extend(v.to_le_bytes()));
    bytes
}

fn write_files(dir: &Path, idx: &[u8], bin: &[u8]) -> PathBuf {
    let prefix = dir.join("data");
    fs::write(dir.join("data.idx"), idx).unwrap();
    fs::write(dir.join("data.bin"), bin).unwrap();
    prefix
}

/// A valid two-document int32 dataset: [7, -8], [9].
fn valid_files() -> (Vec<u8>, Vec<u8>) {
    let idx = megatron_idx(4, &[2, 1], &[0, 8], &[0, 1, 2]);
    let bin = [7i32, -8, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
    (idx, bin)
}

fn open_error(idx: &[u8], bin: &[u8]) -> (DataError, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = write_files(dir.path(), idx, bin);
    let error = IndexedDataset::open(&prefix).err().expect("open must fail");
    (error, prefix)
}

fn assert_names(error: &DataError, path: &Path) {
    let message = error.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
}

fn write_dataset(prefix: &Path, dtype: TokenDtype, documents: &[Vec<i64>]) {
    let mut writer = IndexedDatasetWriter::create(prefix, dtype).unwrap();
    for document in documents {
        writer.add_document(document).unwrap();
    }
    writer.finish().unwrap();
}

#[test]
fn writer_output_is_byte_for_byte_the_megatron_layout() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    let mut writer = IndexedDatasetWriter::create(&prefix, TokenDtype::U16).unwrap();
    writer.add_document(&[1u32, 2, 3]).unwrap();
    writer.add_document::<u32>(&[]).unwrap();
    writer.add_document(&[65_535u32]).unwrap();
    writer.finish().unwrap();

    let expected_idx = [
        b"MMIDIDX\x00\x00".as_slice(),
        &[1, 0, 0, 0, 0, 0, 0, 0], // version
        &[8],                      // uint16
        &[3, 0, 0, 0, 0, 0, 0, 0], // sequences
        &[4, 0, 0, 0, 0, 0, 0, 0], // document indices
        &[3, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        &[
            0, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0,
        ],
        &[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        &[2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0],
    ]
    .concat();
    assert_eq!(fs::read(dir.path().join("data.idx")).unwrap(), expected_idx);
    assert_eq!(
        fs::read(dir.path().join("data.bin")).unwrap(),
        [1, 0, 2, 0, 3, 0, 255, 255]
    );
}

#[test]
fn reads_a_hand_built_megatron_dataset_whose_documents_span_several_sequences() {
    // Megatron's sentence-split layout: document 0 holds sequences 0 and 1, document 1 sequence 2.
    let idx = megatron_idx(4, &[2, 3, 1], &[0, 8, 20], &[0, 2, 3]);
    let bin: Vec<u8> = [10i32, 11, 20, 21, -22, 100_000]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let dataset = IndexedDataset::open(write_files(dir.path(), &idx, &bin)).unwrap();

    assert_eq!(dataset.len(), 3);
    assert_eq!(dataset.dtype(), TokenDtype::I32);
    assert_eq!(dataset.num_tokens(), 6);
    assert_eq!(dataset.document_lengths(), [2, 3, 1]);
    assert_eq!(dataset.document(0).unwrap(), TokenSlice::I32(&[10, 11]));
    assert_eq!(
        dataset.document(1).unwrap(),
        TokenSlice::I32(&[20, 21, -22])
    );
    assert_eq!(dataset.document(2).unwrap().to_vec(), [100_000]);
    assert_eq!(
        dataset.tokens(1, 1, 2).unwrap(),
        TokenSlice::I32(&[21, -22])
    );
    assert_eq!(dataset.tokens(1, 3, 0).unwrap(), TokenSlice::I32(&[]));
}

#[test]
fn reads_a_hand_built_uint8_dataset() {
    let idx = megatron_idx(1, &[1, 0, 2], &[0, 1, 1], &[0, 1, 2, 3]);
    let dir = tempfile::tempdir().unwrap();
    let dataset = IndexedDataset::open(write_files(dir.path(), &idx, &[200, 1, 2])).unwrap();
    assert_eq!(dataset.document(0).unwrap(), TokenSlice::U8(&[200]));
    assert!(dataset.document(1).unwrap().is_empty());
    assert_eq!(dataset.document(2).unwrap(), TokenSlice::U8(&[1, 2]));
}

#[test]
fn every_dtype_round_trips_its_extreme_values() {
    let cases = [
        (TokenDtype::U8, vec![0, 255]),
        (TokenDtype::I8, vec![-128, 127]),
        (TokenDtype::I16, vec![-32_768, 32_767]),
        (TokenDtype::U16, vec![0, 65_535]),
        (TokenDtype::I32, vec![i32::MIN.into(), i32::MAX.into()]),
        (TokenDtype::I64, vec![i64::MIN, i64::MAX]),
    ];
    for (dtype, extremes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("data");
        let documents = vec![extremes.clone(), vec![], vec![1, 2, 3]];
        write_dataset(&prefix, dtype, &documents);
        let dataset = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(dataset.dtype(), dtype);
        assert_eq!(dataset.len(), 3);
        assert_eq!(dataset.num_tokens(), 5);
        for (i, document) in documents.iter().enumerate() {
            let tokens = dataset.document(i).unwrap();
            assert_eq!(tokens.dtype(), dtype);
            assert_eq!(&tokens.to_vec(), document, "{dtype} document {i}");
        }
    }
}

#[test]
fn an_empty_dataset_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    write_dataset(&prefix, TokenDtype::U16, &[]);
    let dataset = IndexedDataset::open(&prefix).unwrap();
    assert!(dataset.is_empty());
    assert_eq!(dataset.num_tokens(), 0);
    assert!(matches!(
        dataset.document(0),
        Err(DataError::DocumentOutOfRange { .. })
    ));
}

#[test]
fn dots_in_the_prefix_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("shard.v2");
    write_dataset(&prefix, TokenDtype::U16, &[vec![5]]);
    assert!(dir.path().join("shard.v2.idx").exists());
    assert!(dir.path().join("shard.v2.bin").exists());
    assert_eq!(
        IndexedDataset::open(&prefix)
            .unwrap()
            .document(0)
            .unwrap()
            .to_vec(),
        [5]
    );
}

proptest! {
    #[test]
    fn writer_then_reader_returns_every_document(
        documents in prop::collection::vec(prop::collection::vec(0i64..=65_535, 0..40), 0..30),
        wide in any::<bool>(),
    ) {
        let dtype = if wide { TokenDtype::I32 } else { TokenDtype::U16 };
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("data");
        write_dataset(&prefix, dtype, &documents);
        let dataset = IndexedDataset::open(&prefix).unwrap();
        prop_assert_eq!(dataset.len(), documents.len());
        let total: usize = documents.iter().map(Vec::len).sum();
        prop_assert_eq!(dataset.num_tokens(), total as u64);
        for (i, document) in documents.iter().enumerate() {
            prop_assert_eq!(dataset.document_lengths()[i] as usize, document.len());
            prop_assert_eq!(&dataset.document(i).unwrap().to_vec(), document);
            if !document.is_empty() {
                let (offset, length) = (document.len() / 3, document.len() / 2);
                let mut out = vec![0; length];
                dataset.tokens(i, offset, length).unwrap().copy_to(&mut out);
                prop_assert_eq!(&out[..], &document[offset..offset + length]);
            }
        }
    }
}

#[test]
fn a_truncated_bin_is_rejected_naming_the_bin() {
    let (idx, bin) = valid_files();
    let (error, prefix) = open_error(&idx, &bin[..bin.len() - 1]);
    assert!(
        matches!(
            error,
            DataError::SizeMismatch {
                expected: 12,
                actual: 11,
                ..
            }
        ),
        "{error}"
    );
    assert_names(&error, &prefix.with_extension("bin"));
}

#[test]
fn a_bin_with_extra_bytes_is_rejected() {
    let (idx, mut bin) = valid_files();
    bin.extend([0; 4]);
    let (error, _) = open_error(&idx, &bin);
    assert!(
        matches!(
            error,
            DataError::SizeMismatch {
                expected: 12,
                actual: 16,
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn a_truncated_idx_is_rejected_naming_the_idx() {
    let (idx, bin) = valid_files();
    for cut in [1, 8, idx.len() - 20] {
        let (error, prefix) = open_error(&idx[..idx.len() - cut], &bin);
        assert!(matches!(error, DataError::SizeMismatch { .. }), "{error}");
        assert_names(&error, &prefix.with_extension("idx"));
    }
}

#[test]
fn an_idx_with_trailing_bytes_is_rejected() {
    let (mut idx, bin) = valid_files();
    idx.push(0);
    let (error, _) = open_error(&idx, &bin);
    assert!(matches!(error, DataError::SizeMismatch { .. }), "{error}");
}

#[test]
fn a_bad_magic_is_rejected() {
    let (mut idx, bin) = valid_files();
    idx[0] = b'X';
    let (error, prefix) = open_error(&idx, &bin);
    assert!(matches!(error, DataError::BadMagic { .. }), "{error}");
    assert_names(&error, &prefix.with_extension("idx"));
    let (error, _) = open_error(b"", &bin);
    assert!(matches!(error, DataError::BadMagic { .. }), "{error}");
}

#[test]
fn another_version_is_rejected() {
    let (mut idx, bin) = valid_files();
    idx[9] = 2;
    let (error, prefix) = open_error(&idx, &bin);
    assert!(
        matches!(error, DataError::UnsupportedVersion { version: 2, .. }),
        "{error}"
    );
    assert_names(&error, &prefix.with_extension("idx"));
}

#[test]
fn float_and_unknown_dtype_codes_are_rejected() {
    for code in [0, 6, 7, 9] {
        let (mut idx, bin) = valid_files();
        idx[17] = code;
        let (error, prefix) = open_error(&idx, &bin);
        assert!(
            matches!(error, DataError::UnsupportedDtype { code: c, .. } if c == code),
            "{error}"
        );
        assert_names(&error, &prefix.with_extension("idx"));
    }
}

#[test]
fn a_negative_length_is_rejected() {
    let idx = megatron_idx(4, &[2, -1], &[0, 8], &[0, 1, 2]);
    let (error, prefix) = open_error(&idx, &[0; 4]);
    assert!(
        matches!(
            error,
            DataError::NegativeLength {
                sequence: 1,
                length: -1,
                ..
            }
        ),
        "{error}"
    );
    assert_names(&error, &prefix.with_extension("idx"));
}

#[test]
fn pointers_that_are_not_back_to_back_are_rejected() {
    let (_, bin) = valid_files();
    for pointers in [[0, 4], [0, 12], [4, 8], [0, -8]] {
        let idx = megatron_idx(4, &[2, 1], &pointers, &[0, 1, 2]);
        let (error, prefix) = open_error(&idx, &bin);
        assert!(
            matches!(error, DataError::BadPointer { .. }),
            "{pointers:?}: {error}"
        );
        assert_names(&error, &prefix.with_extension("idx"));
    }
}

#[test]
fn inconsistent_document_indices_are_rejected() {
    let (_, bin) = valid_files();
    for indices in [&[][..], &[1, 2], &[0, 2, 1, 2], &[0, 1], &[0, 1, 3]] {
        let idx = megatron_idx(4, &[2, 1], &[0, 8], indices);
        let (error, prefix) = open_error(&idx, &bin);
        assert!(
            matches!(error, DataError::BadDocumentIndices { sequences: 2, .. }),
            "{indices:?}: {error}"
        );
        assert_names(&error, &prefix.with_extension("idx"));
    }
}

#[test]
fn missing_files_are_io_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("absent");
    let error = IndexedDataset::open(&prefix).err().unwrap();
    assert!(matches!(error, DataError::Io { .. }), "{error}");
    assert_names(&error, &dir.path().join("absent.idx"));

    let (idx, _) = valid_files();
    fs::write(dir.path().join("absent.idx"), idx).unwrap();
    let error = IndexedDataset::open(&prefix).err().unwrap();
    assert_names(&error, &dir.path().join("absent.bin"));
}

#[test]
fn a_token_outside_the_dtype_is_an_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    let mut writer = IndexedDatasetWriter::create(&prefix, TokenDtype::U16).unwrap();
    writer.add_document(&[1u32, 2]).unwrap();
    for bad in [65_536i64, -1] {
        let error = writer.add_document(&[3, bad, 4]).unwrap_err();
        assert!(
            matches!(error, DataError::TokenOutOfRange { value, dtype: TokenDtype::U16, .. } if value == bad),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains(&bad.to_string()) && message.contains("uint16"),
            "{message}"
        );
        assert_names(&error, &dir.path().join("data.bin"));
    }
    writer.add_document(&[5u32]).unwrap();
    writer.finish().unwrap();

    let dataset = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(dataset.document_lengths(), [2, 1]);
    assert_eq!(dataset.document(1).unwrap().to_vec(), [5]);
}

#[test]
fn out_of_range_reads_are_errors() {
    let (idx, bin) = valid_files();
    let dir = tempfile::tempdir().unwrap();
    let dataset = IndexedDataset::open(write_files(dir.path(), &idx, &bin)).unwrap();
    assert!(matches!(
        dataset.document(2),
        Err(DataError::DocumentOutOfRange {
            document: 2,
            documents: 2,
            ..
        })
    ));
    for (offset, length) in [(0, 3), (2, 1), (3, 0), (usize::MAX, 2)] {
        let error = dataset.tokens(0, offset, length).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::TokensOutOfRange {
                    document_length: 2,
                    ..
                }
            ),
            "{error}"
        );
    }
}

#[test]
fn an_unfinished_write_leaves_no_index_behind() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    write_dataset(&prefix, TokenDtype::U16, &[vec![1, 2]]);
    let mut writer = IndexedDatasetWriter::create(&prefix, TokenDtype::U16).unwrap();
    writer.add_document(&[3u16]).unwrap();
    drop(writer);
    let error = IndexedDataset::open(&prefix).err().unwrap();
    assert!(matches!(error, DataError::Io { .. }), "{error}");
}

#[test]
fn the_token_range_is_scanned_once_then_read_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    let cases = [
        (
            TokenDtype::U16,
            vec![vec![3, 65_535, 0], vec![], vec![9]],
            Some((0, 65_535)),
        ),
        (
            TokenDtype::I32,
            vec![vec![-5, 70_000], vec![12]],
            Some((-5, 70_000)),
        ),
        (TokenDtype::U8, vec![vec![], vec![]], None),
    ];
    for (i, (dtype, documents, expected)) in cases.into_iter().enumerate() {
        let cache = dir.path().join(format!("cache-{i}"));
        write_dataset(&prefix, dtype, &documents);
        let dataset = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(dataset.all_tokens().min_max(), expected);
        assert_eq!(dataset.cached_token_range(&cache).unwrap(), expected);
        let entries: Vec<PathBuf> = fs::read_dir(&cache)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        let [entry] = &entries[..] else {
            panic!("one cache entry: {entries:?}")
        };
        let text = expected.map_or("none".to_owned(), |(min, max)| format!("{min} {max}"));
        assert_eq!(fs::read_to_string(entry).unwrap(), format!("{text}\n"));
        // A second call reads the cache, not `.bin`; a garbled one is scanned again.
        fs::write(entry, "1 41\n").unwrap();
        assert_eq!(dataset.cached_token_range(&cache).unwrap(), Some((1, 41)));
        fs::write(entry, "41 1\n").unwrap();
        assert_eq!(dataset.cached_token_range(&cache).unwrap(), expected);
    }
    // The same path rewritten (another size) is scanned again.
    let cache = dir.path().join("cache-0");
    write_dataset(&prefix, TokenDtype::U16, &[vec![1, 2]]);
    let dataset = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(dataset.cached_token_range(&cache).unwrap(), Some((1, 2)));
}

#[test]
fn an_id_outside_the_vocabulary_is_found_naming_its_document() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("data");
    let cache = dir.path().join("cache");
    for (documents, vocab_size, expected) in [
        (vec![vec![1, 2], vec![], vec![4095]], 4096, None),
        (
            vec![vec![1, 2], vec![], vec![3, 60_000]],
            4096,
            Some((2, 60_000)),
        ),
        (vec![vec![1, -7], vec![9]], 4096, Some((0, -7))),
    ] {
        write_dataset(&prefix, TokenDtype::I32, &documents);
        let dataset = IndexedDataset::open(&prefix).unwrap();
        let found = match dataset.check_token_range(vocab_size, &cache) {
            Ok(()) => None,
            Err(DataError::BeyondVocabulary {
                path,
                document,
                token,
                vocab_size: size,
            }) => {
                assert_eq!((path, size), (dataset.bin_path().to_owned(), vocab_size));
                Some((document, token))
            }
            Err(error) => panic!("{error}"),
        };
        assert_eq!(found, expected);
    }
}
