//! The safetensors format, written exactly as the reference library writes it: an 8-byte
//! little-endian header length, a JSON header padded with spaces to a multiple of 8, then the
//! tensors back to back, widest dtype first so that every tensor lies aligned.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

use crate::checksum::Checksum;
use crate::durable::parent_of;
use crate::{CheckpointError, TensorRef};

/// Large enough that small tensors cost one write system call per 16 MiB, not one each; larger
/// tensors bypass it.
const WRITE_BUFFER_BYTES: usize = 16 << 20;

/// What a written file holds, as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReport {
    pub file_name: String,
    pub bytes: u64,
    /// xxh3-64 of the whole file, 16 lowercase hex digits.
    pub checksum: String,
}

/// Writes `tensors` and `metadata` (the header's `__metadata__`, left out when empty) to `path`
/// in the safetensors format, fsyncs the file, and reports its size and checksum.
///
/// The file is created in place, not renamed into it: atomicity comes from [`crate::commit`],
/// which renames the whole directory.
pub fn write_file(
    path: &Path,
    tensors: &[TensorRef],
    metadata: &BTreeMap<String, String>,
) -> Result<FileReport, CheckpointError> {
    let file_name = path
        .file_name()
        .and_then(|name| name.to_str())
        .ok_or_else(|| CheckpointError::BadFileName {
            directory: parent_of(path).to_owned(),
            name: path.to_string_lossy().into_owned(),
        })?
        .to_owned();
    let (header, order) = layout(path, tensors, metadata)?;
    let mut checksum = Checksum::new();
    let bytes =
        write_and_sync(path, &header, &order, &mut checksum).map_err(CheckpointError::io(path))?;
    Ok(FileReport {
        file_name,
        bytes,
        checksum: checksum.hex(),
    })
}

/// The length prefix and padded JSON header, and the tensors in file order.
fn layout<'a>(
    path: &Path,
    tensors: &'a [TensorRef],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<&'a TensorRef>), CheckpointError> {
    let mut names = HashSet::with_capacity(tensors.len());
    for tensor in tensors {
        if tensor.name == "__metadata__" {
            return Err(CheckpointError::ReservedTensorName {
                path: path.to_owned(),
            });
        }
        if !names.insert(tensor.name.as_str()) {
            return Err(CheckpointError::DuplicateTensor {
                path: path.to_owned(),
                name: tensor.name.clone(),
            });
        }
        let expected = tensor.expected_len();
        if expected != tensor.bytes().len() as u128 {
            return Err(CheckpointError::TensorSize {
                path: path.to_owned(),
                name: tensor.name.clone(),
                expected,
                actual: tensor.bytes().len(),
            });
        }
    }
    let mut order: Vec<&TensorRef> = tensors.iter().collect();
    order.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));

    let json = serde_json::to_vec(&Header {
        metadata,
        tensors: &order,
    })
    .expect("a header of strings and integers always serializes");
    let padded_len = json.len().next_multiple_of(8);
    let mut header = Vec::with_capacity(8 + padded_len);
    header.extend_from_slice(&(padded_len as u64).to_le_bytes());
    header.extend_from_slice(&json);
    header.resize(8 + padded_len, b' ');
    Ok((header, order))
}

fn write_and_sync(
    path: &Path,
    header: &[u8],
    order: &[&TensorRef],
    checksum: &mut Checksum,
) -> io::Result<u64> {
    let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, File::create(path)?);
    let mut bytes = 0;
    for piece in std::iter::once(header).chain(order.iter().map(|tensor| tensor.bytes())) {
        writer.write_all(piece)?;
        checksum.update(piece);
        bytes += piece.len() as u64;
    }
    writer
        .into_inner()
        .map_err(io::IntoInnerError::into_error)?
        .sync_all()?;
    Ok(bytes)
}

/// `{"__metadata__": {...}, "name": {"dtype", "shape", "data_offsets"}, ...}` in file order.
struct Header<'a> {
    metadata: &'a BTreeMap<String, String>,
    tensors: &'a [&'a TensorRef],
}

impl Serialize for Header<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let has_metadata = !self.metadata.is_empty();
        let mut map = serializer.serialize_map(Some(self.tensors.len() + has_metadata as usize))?;
        if has_metadata {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        let mut offset = 0;
        for tensor in self.tensors {
            let end = offset + tensor.bytes().len();
            map.serialize_entry(
                &tensor.name,
                &Entry {
                    tensor,
                    offsets: [offset, end],
                },
            )?;
            offset = end;
        }
        map.end()
    }
}

struct Entry<'a> {
    tensor: &'a TensorRef,
    offsets: [usize; 2],
}

impl Serialize for Entry<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut entry = serializer.serialize_struct("Entry", 3)?;
        entry.serialize_field("dtype", self.tensor.dtype.name())?;
        entry.serialize_field("shape", &self.tensor.shape)?;
        entry.serialize_field("data_offsets", &self.offsets)?;
        entry.end()
    }
}
