//! Token datasets on disk and the indices that turn them into training samples.
//!
//! - [`IndexedDataset`] / [`IndexedDatasetWriter`]: Megatron's MMIDIDX format, memory-mapped and
//!   read in place, interchangeable with Megatron-LM and Fast-LLM.
//! - [`SamplingIndex`]: which document pieces form each sample, over shuffled epochs, packed or
//!   truncated, deterministic and cached on disk.
//! - [`BlendingIndex`]: several datasets mixed into one sample stream by weight.
//!
//! Plain Rust with typed errors ([`DataError`]); the Python bindings live in `fastllm-python`.

mod atomic_file;
mod blending;
mod error;
mod indexed;
mod random;
mod sampling;
mod sampling_cache;
mod stable_hash;
mod token;

pub use blending::BlendingIndex;
pub use error::DataError;
pub use indexed::{IndexedDataset, IndexedDatasetWriter};
pub use sampling::{Piece, Pieces, SamplingConfig, SamplingIndex, SamplingMode};
pub use sampling_cache::CacheStatus;
pub use token::{TokenDtype, TokenSlice};
