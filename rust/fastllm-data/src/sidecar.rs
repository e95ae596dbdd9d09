//! The header that the sidecar files beside a Megatron `PREFIX.bin`/`PREFIX.idx` pair share
//! (loss-masking spans, preference spans): an 8-byte magic, then little-endian u64 fields:
//! version, the index's document count, its token count, and the file's own fields.

use std::fs;
use std::path::Path;

use crate::DataError;

/// A sidecar's bytes and its own header fields (after version, documents and tokens).
pub(crate) struct Sidecar {
    pub bytes: Vec<u8>,
    pub fields: Vec<u64>,
}

impl Sidecar {
    /// The bytes after the header.
    pub fn body(&self) -> &[u8] {
        &self.bytes[header_len(self.fields.len())..]
    }
}

/// Bytes of a header with `own` fields of the file's own.
pub(crate) const fn header_len(own: usize) -> usize {
    8 + (3 + own) * 8
}

/// Reads the sidecar at `path` (None when there is none) written as `magic` `version` with
/// `own` fields of its own, and checks that it describes the index's `document_lengths`;
/// `bad` makes the error naming the file.
pub(crate) fn read_sidecar(
    path: &Path,
    magic: &[u8; 8],
    version: u64,
    own: usize,
    what: &str,
    document_lengths: &[i32],
    bad: impl Fn(String) -> DataError,
) -> Result<Option<Sidecar>, DataError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(DataError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    if bytes.len() < header_len(own) || &bytes[..8] != magic {
        return Err(bad(format!(
            "not a {what} file (bad magic or truncated header)"
        )));
    }
    let field = |i: usize| u64::from_le_bytes(bytes[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    let (written, documents, tokens) = (field(0), field(1), field(2));
    if written != version {
        return Err(bad(format!("unsupported version {written}")));
    }
    let index_tokens: u64 = document_lengths.iter().map(|&l| l as u64).sum();
    if documents != document_lengths.len() as u64 || tokens != index_tokens {
        return Err(bad(format!(
            "written for {documents} documents of {tokens} tokens, but the index has {} \
             documents of {index_tokens} tokens",
            document_lengths.len()
        )));
    }
    let fields = (3..3 + own).map(field).collect();
    Ok(Some(Sidecar { bytes, fields }))
}

/// The error for a sidecar whose size is not the `expected` its header implies, if so.
pub(crate) fn check_size(
    sidecar: &Sidecar,
    expected: u128,
    bad: impl Fn(String) -> DataError,
) -> Result<(), DataError> {
    if expected != sidecar.bytes.len() as u128 {
        return Err(bad(format!(
            "file is {} bytes but its header implies {expected} (truncated?)",
            sidecar.bytes.len()
        )));
    }
    Ok(())
}
