//! Batches of records in input order. The reader makes [`RawBatch`]es, whose JSON lines are
//! still unparsed, so that in `prepare` the tokenizer threads share the parsing and the reader
//! thread only reads.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use super::expand::Input;
use super::jsonl::{parse_line, Fields};
use super::record::{BadRecord, Document, Record};
use super::spec::InputFormat;

/// Documents in input order, and the records met among them that are not documents.
#[derive(Debug, Default)]
pub struct Batch {
    pub documents: Vec<Document>,
    pub bad_records: Vec<BadRecord>,
    /// For each bad record, how many documents came before it in the batch.
    pub(crate) bad_record_positions: Vec<usize>,
    /// Binary files of source trees, skipped.
    pub skipped_files: u64,
    /// The same, per input.
    pub(crate) counts: Vec<InputCounts>,
}

/// What one input contributed to a batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InputCounts {
    input: usize,
    documents: u64,
    bad_records: u64,
    skipped_files: u64,
}

impl InputCounts {
    /// Counts document `document` of the batch these counts describe as a bad record instead.
    pub(crate) fn demote(counts: &mut [InputCounts], document: usize) {
        let mut before = 0;
        for counts in counts {
            if document < before + counts.documents as usize {
                counts.documents -= 1;
                counts.bad_records += 1;
                return;
            }
            before += counts.documents as usize;
        }
        unreachable!("document {document} is not in the batch");
    }

    pub(crate) fn add_to(&self, inputs: &mut [Input]) {
        let input = &mut inputs[self.input];
        input.documents += self.documents;
        input.bad_records += self.bad_records;
        input.skipped_files += self.skipped_files;
    }
}

impl Batch {
    fn push(&mut self, input: usize, record: Record) {
        let counts = match self.counts.last_mut() {
            Some(counts) if counts.input == input => counts,
            _ => {
                self.counts.push(InputCounts {
                    input,
                    documents: 0,
                    bad_records: 0,
                    skipped_files: 0,
                });
                self.counts.last_mut().expect("just pushed")
            }
        };
        match record {
            Record::Document(document) => {
                counts.documents += 1;
                self.documents.push(document);
            }
            Record::Bad(record) => {
                counts.bad_records += 1;
                self.bad_records.push(record);
                self.bad_record_positions.push(self.documents.len());
            }
            Record::Skipped => {
                counts.skipped_files += 1;
                self.skipped_files += 1;
            }
        }
    }
}

pub(crate) struct RawBatch {
    fields: Arc<Fields>,
    /// The JSON lines of the batch, back to back.
    lines: Vec<u8>,
    records: Vec<(usize, RawRecord)>,
}

/// A record of some input.
pub(super) enum RawRecord {
    JsonLine {
        file: Arc<Path>,
        line_number: u64,
        /// Where the line is in [`RawBatch::lines`].
        range: Range<usize>,
        /// How the line is read: JSON lines, chat or preference.
        format: InputFormat,
    },
    Read(Record),
}

impl RawBatch {
    pub(super) fn new(fields: Arc<Fields>) -> Self {
        Self {
            fields,
            lines: Vec::new(),
            records: Vec::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The buffer JSON lines are read into.
    pub(super) fn lines(&mut self) -> &mut Vec<u8> {
        &mut self.lines
    }

    pub(super) fn push(&mut self, input: usize, record: RawRecord) {
        self.records.push((input, record));
    }

    pub(crate) fn parse(self) -> Batch {
        let mut batch = Batch::default();
        for (input, record) in self.records {
            let record = match record {
                RawRecord::JsonLine {
                    file,
                    line_number,
                    range,
                    format,
                } => parse_line(&file, line_number, &self.lines[range], &self.fields, format),
                RawRecord::Read(record) => record,
            };
            batch.push(input, record);
        }
        batch
    }
}
