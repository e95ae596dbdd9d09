//! Raw text in: the files an [`InputSpec`] names, read in order as [`Document`]s.
//!
//! A record that cannot be a document (invalid JSON, a missing or non-string field, invalid
//! UTF-8, an unreadable file) comes out as a [`BadRecord`] at its place in the stream, so callers
//! count or refuse it but never lose it silently.

mod batch;
mod expand;
mod feed;
mod jsonl;
mod parquet_column;
mod reader;
mod record;
mod spec;
mod whole_file;

pub use batch::Batch;
pub(crate) use batch::{InputCounts, RawBatch};
pub use expand::Input;
pub use feed::{FedBatch, FedKind, Feed};
pub use reader::DocumentReader;
pub use record::{BadRecord, Content, Document, Location, PreferencePair};
pub use spec::{InputFormat, InputSpec, PreferenceFields};
