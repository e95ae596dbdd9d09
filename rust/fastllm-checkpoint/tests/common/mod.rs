//! A minimal safetensors reader and tensor builders, written from the format's description so
//! that tests do not check the writer against itself.

#![allow(dead_code)] // each test file uses its own part

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use fastllm_checkpoint::{Dtype, TensorRef};
use serde_json::Value;

pub struct ReadTensor {
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute position of the first byte in the file.
    pub file_offset: usize,
    pub data: Vec<u8>,
}

pub struct ReadFile {
    pub metadata: Option<BTreeMap<String, String>>,
    pub tensors: BTreeMap<String, ReadTensor>,
}

/// Parses a safetensors file, asserting the structural rules readers enforce: header padded to 8,
/// tensors back to back covering the whole data section.
pub fn read_safetensors(path: &Path) -> ReadFile {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(header_len % 8, 0, "header not padded to 8 bytes");
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let data = &bytes[8 + header_len..];
    let mut metadata = None;
    let mut tensors = BTreeMap::new();
    let mut spans = Vec::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            metadata = Some(serde_json::from_value(entry).unwrap());
            continue;
        }
        let [begin, end]: [usize; 2] =
            serde_json::from_value(entry["data_offsets"].clone()).unwrap();
        spans.push((begin, end));
        tensors.insert(
            name,
            ReadTensor {
                dtype: entry["dtype"].as_str().unwrap().to_owned(),
                shape: serde_json::from_value(entry["shape"].clone()).unwrap(),
                file_offset: 8 + header_len + begin,
                data: data[begin..end].to_vec(),
            },
        );
    }
    spans.sort_unstable();
    let mut position = 0;
    for (begin, end) in spans {
        assert_eq!(begin, position, "tensors not back to back");
        position = end;
    }
    assert_eq!(position, data.len(), "data section has trailing bytes");
    ReadFile { metadata, tensors }
}

pub fn tensor(name: &str, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> TensorRef {
    TensorRef::new(name, dtype, shape.to_vec(), Arc::new(data))
}

pub fn f32_tensor(name: &str, values: &[f32]) -> TensorRef {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensor(name, Dtype::F32, &[values.len() as u64], bytes)
}
