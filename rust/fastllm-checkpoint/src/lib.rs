//! Training checkpoints whose only stall of the training loop is the caller's copy of its state
//! into host buffers; serialization, checksums, writes, fsync and the commit happen here, on
//! background threads, and a partial or corrupt checkpoint is never loaded.
//!
//! A checkpoint is a directory of safetensors files plus `manifest.json`, which lists every file
//! with its size and xxh3-64 checksum. It is written under a partial name and renamed into place:
//!
//! 1. every rank writes its files into the shared partial directory ([`AsyncWriter`] or
//!    [`write_file`]) and gets a [`FileReport`] for each;
//! 2. one rank gathers all reports and calls [`commit`], which writes the manifest, fsyncs and
//!    renames the partial directory to its final name;
//! 3. on resume, [`latest_valid`] picks the newest committed checkpoint that passes [`verify`].
//!
//! Plain Rust with typed errors ([`CheckpointError`]); the Python bindings live in `fastllm-python`.

mod checksum;
mod commit;
mod dtype;
mod durable;
mod error;
mod file_name;
mod latest;
mod manifest;
mod safetensors;
mod tensor;
mod writer;

pub use commit::commit;
pub use dtype::Dtype;
pub use error::CheckpointError;
pub use latest::{latest_valid, LatestCheckpoint};
pub use manifest::{verify, FileEntry, Manifest, MANIFEST_FILE_NAME};
pub use safetensors::{write_file, FileReport};
pub use tensor::{SharedBytes, TensorRef};
pub use writer::{AsyncWriter, FileToWrite, JobHandle, WriteJob};
