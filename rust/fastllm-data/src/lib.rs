//! Token datasets on disk and the indices that turn them into training samples.
//!
//! - [`IndexedDataset`] / [`IndexedDatasetWriter`]: Megatron's MMIDIDX format, memory-mapped and
//!   read in place, interchangeable with Megatron-LM and Fast-LLM.
//! - [`SamplingIndex`]: which document pieces form each sample, over shuffled epochs, packed or
//!   truncated, deterministic and cached on disk.
//! - [`BlendingIndex`]: several datasets mixed into one sample stream by weight.
//! - [`Fim`]: fill-in-the-middle, StarCoder's way, deterministic per sample.
//! - [`LossSpans`]: the tokens of each document not trained on, in a sidecar of the dataset.
//! - [`PreferenceSpans`]: the chosen and rejected answers of preference pairs, one pair a
//!   document, in a sidecar; [`PairIndex`]: samples of whole pairs.
//! - [`SampleSource`]: all of the above as training batches (tokens, document ids, loss mask).
//!
//! - [`prepare`]: raw text (JSON lines, Parquet, text, source trees) tokenized on every core
//!   into sharded datasets, through [`DocumentReader`] and [`Tokenizer`]; conversations through
//!   the tokenizer's [`ChatTemplate`].
//!
//! Plain Rust with typed errors ([`DataError`]); the Python bindings live in `fastllm-python`.

mod atomic_file;
mod blending;
mod cancel;
mod chat;
mod error;
mod fim;
mod indexed;
mod input;
mod loss_spans;
mod pair_sampling;
mod preference_spans;
mod prepare;
mod random;
mod sample_source;
mod sampling;
mod sampling_cache;
mod sidecar;
mod stable_hash;
mod token;
mod token_range;
mod tokenizer;

pub use blending::BlendingIndex;
pub use cancel::Cancel;
pub use chat::{ChatTemplate, RenderedChat, TrainOn};
pub use error::{ChatError, DataError, InputError, PrepareError, TokenizerError};
pub use fim::{Fim, FimConfig, FimSplit, TextCodec};
pub use indexed::{IndexedDataset, IndexedDatasetWriter};
pub use input::{
    BadRecord, Batch, Content, Document, DocumentReader, FedBatch, FedKind, Feed, Input,
    InputFormat, InputSpec, Location, PreferenceFields, PreferencePair,
};
pub use loss_spans::LossSpans;
pub use pair_sampling::PairIndex;
pub use preference_spans::{PairSpans, PreferenceSpans};
pub use prepare::{prepare, PrepareOptions, PrepareReport, Progress, ShardReport, TokenizerReport};
pub use sample_source::{SampleSource, SampleSourceConfig};
pub use sampling::{Piece, Pieces, SamplingConfig, SamplingIndex, SamplingMode};
pub use sampling_cache::CacheStatus;
pub use token::{TokenDtype, TokenSlice};
pub use tokenizer::{SpecialToken, Tokenizer, TokenizerImplementation};
