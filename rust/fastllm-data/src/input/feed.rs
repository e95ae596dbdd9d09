//! Records handed over by the caller instead of read from files: in `fastllm prepare`, Python
//! reads a Hugging Face dataset or applies a record transform, and the records it sends are
//! read here as a file's records are (the same checks, bad records and locations).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crossbeam_channel::Receiver;

use super::batch::{RawBatch, RawRecord};
use super::record::{Content, Document, Location, Record};
use super::spec::InputFormat;

/// The records of a [`DocumentReader::fed`](super::DocumentReader::fed) reader: what they are
/// read from, and the channel they come through, in order, until its sender is dropped.
#[derive(Clone, Debug)]
pub struct Feed {
    /// The sources, as the report names them, with their size on disk (for progress).
    pub inputs: Vec<(PathBuf, u64)>,
    /// How JSON records are read: `Jsonl` (text), `Chat` or `Preference`.
    pub format: InputFormat,
    pub batches: Receiver<FedBatch>,
}

/// Consecutive records of one input.
#[derive(Debug)]
pub struct FedBatch {
    /// Index of the input in [`Feed::inputs`].
    pub input: usize,
    /// The file (or dataset split) the records' locations name.
    pub file: Arc<Path>,
    /// Bytes of the input the batch stands for (progress).
    pub bytes: u64,
    pub kind: FedKind,
    /// Each record's line or row, counted from 1.
    pub rows: Vec<u64>,
    /// Each record: a text (`FedKind::Text`) or a JSON object (`FedKind::Json`); `None` for a
    /// record the caller could not read, whose reason is the next of `reasons`.
    pub values: Vec<Option<String>>,
    pub reasons: Vec<String>,
    /// Binary files of a source tree the caller skipped.
    pub skipped: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FedKind {
    /// Each value is the text of a document.
    Text,
    /// Each value is a JSON object, read as a line of JSON lines in the feed's format.
    Json,
}

impl FedBatch {
    /// The batch as the reader's batches are; JSON is left for the workers to parse.
    pub(super) fn into_raw(self, raw: &mut RawBatch, format: InputFormat) {
        let mut reasons = self.reasons.into_iter();
        for (row, value) in self.rows.into_iter().zip(self.values) {
            let record = match (value, self.kind) {
                (None, _) => {
                    let reason = reasons.next().unwrap_or_else(|| "unreadable".to_owned());
                    RawRecord::Read(Record::bad(&self.file, row, reason))
                }
                (Some(text), FedKind::Text) => RawRecord::Read(Record::Document(Document {
                    text,
                    content: Content::Text,
                    location: Location {
                        file: self.file.clone(),
                        line_or_row: row,
                    },
                })),
                (Some(json), FedKind::Json) => {
                    let lines = raw.lines();
                    let start = lines.len();
                    lines.extend_from_slice(json.as_bytes());
                    RawRecord::JsonLine {
                        file: self.file.clone(),
                        line_number: row,
                        range: start..lines.len(),
                        format,
                    }
                }
            };
            raw.push(self.input, record);
        }
        for _ in 0..self.skipped {
            raw.push(self.input, RawRecord::Read(Record::Skipped));
        }
    }
}
