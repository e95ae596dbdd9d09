mod common;

use std::collections::BTreeMap;

use common::{f32_tensor, read_safetensors, tensor};
use fastllm_checkpoint::{write_file, CheckpointError, Dtype};
use proptest::prelude::*;

#[test]
fn a_small_file_matches_the_bytes_worked_out_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.safetensors");
    let metadata = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
    let report = write_file(&path, &[f32_tensor("a", &[1.0, 2.0])], &metadata).unwrap();

    let header =
        r#"{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    assert_eq!(header.len(), 79); // padded with one space to 80
    let mut expected = 80u64.to_le_bytes().to_vec();
    expected.extend_from_slice(header.as_bytes());
    expected.push(b' ');
    expected.extend_from_slice(&[0, 0, 0x80, 0x3f, 0, 0, 0, 0x40]); // 1.0f32, 2.0f32
    assert_eq!(std::fs::read(&path).unwrap(), expected);

    assert_eq!(report.file_name, "a.safetensors");
    assert_eq!(report.bytes, 96);
    assert_eq!(report.checksum, format!("{:016x}", xxh3_64(&expected)));
}

#[test]
fn tensors_are_laid_out_widest_dtype_first_then_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("order.safetensors");
    let tensors = [
        tensor("a", Dtype::I32, &[1], vec![0; 4]),
        tensor("b", Dtype::F64, &[1], vec![0; 8]),
        tensor("d", Dtype::U8, &[1], vec![0; 1]),
        tensor("c", Dtype::F32, &[1], vec![0; 4]),
    ];
    write_file(&path, &tensors, &BTreeMap::new()).unwrap();
    // What `safetensors.numpy.save` writes for the same tensors.
    let header = r#"{"b":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"a":{"dtype":"I32","shape":[1],"data_offsets":[12,16]},"d":{"dtype":"U8","shape":[1],"data_offsets":[16,17]}}"#;
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[8..8 + header.len()], header.as_bytes());
}

#[test]
fn an_empty_metadata_map_leaves_out_the_metadata_entry() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    write_file(&path, &[f32_tensor("x", &[])], &BTreeMap::new()).unwrap();
    let file = read_safetensors(&path);
    assert!(file.metadata.is_none());
    assert_eq!(file.tensors["x"].shape, [0]);
    assert!(file.tensors["x"].data.is_empty());
}

#[test]
fn a_tensor_whose_bytes_disagree_with_its_shape_is_refused_naming_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let error = write_file(
        &path,
        &[tensor("w", Dtype::BF16, &[2, 3], vec![0; 10])],
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(matches!(
        error,
        CheckpointError::TensorSize {
            expected: 12,
            actual: 10,
            ..
        }
    ));
    let message = error.to_string();
    assert!(
        message.contains("bad.safetensors") && message.contains("\"w\""),
        "{message}"
    );
    assert!(!path.exists());
}

#[test]
fn duplicate_and_reserved_tensor_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let duplicate = [f32_tensor("w", &[1.0]), f32_tensor("w", &[2.0])];
    assert!(matches!(
        write_file(&path, &duplicate, &BTreeMap::new()),
        Err(CheckpointError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        write_file(
            &path,
            &[f32_tensor("__metadata__", &[1.0])],
            &BTreeMap::new()
        ),
        Err(CheckpointError::ReservedTensorName { .. })
    ));
}

#[test]
fn a_missing_directory_is_an_io_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("x.safetensors");
    let error = write_file(&path, &[f32_tensor("x", &[1.0])], &BTreeMap::new()).unwrap_err();
    assert!(matches!(error, CheckpointError::Io { .. }));
    assert!(error.to_string().contains("x.safetensors"), "{error}");
}

const DTYPES: [Dtype; 8] = [
    Dtype::Bool,
    Dtype::U8,
    Dtype::F8E4M3,
    Dtype::BF16,
    Dtype::F16,
    Dtype::I32,
    Dtype::F32,
    Dtype::I64,
];

fn arbitrary_tensor() -> impl Strategy<Value = (usize, Vec<u64>, u8)> {
    (
        0..DTYPES.len(),
        prop::collection::vec(0u64..5, 0..4),
        any::<u8>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_tensor_reads_back_aligned_and_unchanged(
        specs in prop::collection::vec(arbitrary_tensor(), 0..8),
        metadata in prop::collection::btree_map("[a-z\"\\\\é ]{0,6}", "[ -~]{0,10}", 0..3),
    ) {
        let tensors: Vec<_> = specs
            .iter()
            .enumerate()
            .map(|(i, (dtype, shape, seed))| {
                let dtype = DTYPES[*dtype];
                let len = shape.iter().product::<u64>() as usize * dtype.size();
                let data = (0..len).map(|j| seed.wrapping_add(j as u8)).collect();
                tensor(&format!("t{i}"), dtype, shape, data)
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        let report = write_file(&path, &tensors, &metadata).unwrap();
        prop_assert_eq!(report.bytes, std::fs::metadata(&path).unwrap().len());

        let file = read_safetensors(&path);
        prop_assert_eq!(file.metadata.unwrap_or_default(), metadata);
        prop_assert_eq!(file.tensors.len(), tensors.len());
        for original in &tensors {
            let read = &file.tensors[&original.name];
            prop_assert_eq!(&read.dtype, original.dtype.name());
            prop_assert_eq!(&read.shape, &original.shape);
            prop_assert_eq!(&read.data[..], original.bytes());
            prop_assert_eq!(read.file_offset % original.dtype.size(), 0);
        }
    }
}

fn xxh3_64(bytes: &[u8]) -> u64 {
    // The reference value comes from the crate's one-shot function, not from our streaming path.
    xxhash_rust::xxh3::xxh3_64(bytes)
}
