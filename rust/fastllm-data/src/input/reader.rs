use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::batch::{Batch, InputCounts, RawBatch, RawRecord};
use super::expand::{expand, fields, Input};
use super::feed::{FedBatch, Feed};
use super::jsonl::{Fields, JsonlReader};
use super::parquet_column::ParquetReader;
use super::record::Record;
use super::spec::{InputFormat, InputSpec};
use super::whole_file::read_whole_file;
use crate::InputError;

/// How often a reader waiting for fed records looks whether it should stop.
const FEED_POLL: Duration = Duration::from_millis(20);

/// Reads the documents of an [`InputSpec`] (or of a [`Feed`]) in input order, a batch at a time.
///
/// Reading never fails: what cannot be read becomes a [`BadRecord`](super::BadRecord) in the
/// batch.
pub struct DocumentReader {
    inputs: Vec<Input>,
    fields: Arc<Fields>,
    /// The next file to open: (input, file of that input).
    next_file: (usize, usize),
    current: Option<OpenFile>,
    /// Bytes of the files read to the end (of a feed: of the batches received).
    bytes_done: u64,
    total_bytes: u64,
    /// Records come from the caller instead of from files.
    feed: Option<(Receiver<FedBatch>, InputFormat)>,
}

struct OpenFile {
    input: usize,
    size: u64,
    reader: FileReader,
}

enum FileReader {
    Jsonl(JsonlReader),
    Parquet(Box<ParquetReader>),
    /// A file read whole at open; its one record, until taken.
    Whole(Option<Record>),
}

impl DocumentReader {
    /// Expands the spec's paths into the files to read; nothing is read yet.
    pub fn open(spec: &InputSpec) -> Result<Self, InputError> {
        let inputs = expand(spec)?;
        Ok(Self {
            total_bytes: inputs.iter().map(|input| input.bytes).sum(),
            inputs,
            fields: Arc::new(fields(spec)),
            next_file: (0, 0),
            current: None,
            bytes_done: 0,
            feed: None,
        })
    }

    /// Reads the records of `feed`, whose JSON records hold their parts in the fields of `spec`
    /// (its paths and format are not used).
    pub fn fed(feed: Feed, spec: &InputSpec) -> Self {
        let inputs: Vec<Input> = feed
            .inputs
            .into_iter()
            .map(|(path, bytes)| Input {
                path,
                format: feed.format,
                bytes,
                documents: 0,
                bad_records: 0,
                skipped_files: 0,
                files: Vec::new(),
            })
            .collect();
        Self {
            total_bytes: inputs.iter().map(|input| input.bytes).sum(),
            inputs,
            fields: Arc::new(fields(spec)),
            next_file: (0, 0),
            current: None,
            bytes_done: 0,
            feed: Some((feed.batches, feed.format)),
        }
    }

    /// The next documents, about `max_bytes` of them (a JSON line counts whole); `None` once
    /// everything has been read.
    pub fn next_batch(&mut self, max_bytes: usize) -> Option<Batch> {
        let batch = self.next_raw_batch(max_bytes, || false)?.parse();
        self.count(&batch.counts);
        Some(batch)
    }

    /// Bytes of the input files consumed so far, as stored on disk (compressed).
    pub fn bytes_read(&self) -> u64 {
        let current = match &self.current {
            Some(OpenFile { reader, .. }) => match reader {
                FileReader::Jsonl(reader) => reader.bytes_read(),
                FileReader::Parquet(reader) => reader.bytes_read(),
                FileReader::Whole(_) => 0,
            },
            None => 0,
        };
        self.bytes_done + current
    }

    /// Bytes of all input files, as stored on disk.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The inputs with the documents, bad records and skipped files read from each so far.
    pub fn inputs(&self) -> &[Input] {
        &self.inputs
    }

    pub fn into_inputs(self) -> Vec<Input> {
        self.inputs
    }

    /// Like [`next_batch`](Self::next_batch), leaving the parsing to the caller, who hands the
    /// counts of the parsed batch back to [`count`](Self::count). A fed reader returns the
    /// next batch as the caller sent it, and gives up waiting for it once `should_stop`.
    pub(crate) fn next_raw_batch(
        &mut self,
        max_bytes: usize,
        should_stop: impl Fn() -> bool,
    ) -> Option<RawBatch> {
        let mut batch = RawBatch::new(self.fields.clone());
        if let Some((batches, format)) = &self.feed {
            let fed = loop {
                match batches.recv_timeout(FEED_POLL) {
                    Ok(fed) => break fed,
                    Err(RecvTimeoutError::Timeout) if !should_stop() => continue,
                    Err(_) => return None,
                }
            };
            self.bytes_done += fed.bytes;
            fed.into_raw(&mut batch, *format);
            return Some(batch);
        }
        let mut bytes = 0;
        while bytes < max_bytes {
            if self.current.is_none() {
                match self.open_next_file() {
                    Some(file) => self.current = Some(file),
                    None => break,
                }
            }
            let current = self.current.as_mut().expect("opened above");
            let format = self.inputs[current.input].format;
            let record = match &mut current.reader {
                FileReader::Jsonl(reader) => {
                    reader.next_line(batch.lines()).map(|line| match line {
                        Ok((line_number, range)) => {
                            bytes += range.len();
                            RawRecord::JsonLine {
                                file: reader.file().clone(),
                                line_number,
                                range,
                                format,
                            }
                        }
                        Err(record) => RawRecord::Read(record),
                    })
                }
                FileReader::Parquet(reader) => reader.next().map(RawRecord::Read),
                FileReader::Whole(record) => record.take().map(RawRecord::Read),
            };
            match record {
                Some(record) => {
                    if let RawRecord::Read(Record::Document(document)) = &record {
                        bytes += document.text.len();
                    }
                    batch.push(current.input, record);
                }
                None => {
                    self.bytes_done += current.size;
                    self.current = None;
                }
            }
        }
        (!batch.is_empty()).then_some(batch)
    }

    /// Adds what parsed batches held to [`inputs`](Self::inputs).
    pub(crate) fn count(&mut self, counts: &[InputCounts]) {
        for counts in counts {
            counts.add_to(&mut self.inputs);
        }
    }

    fn open_next_file(&mut self) -> Option<OpenFile> {
        let (input_index, file_index) = &mut self.next_file;
        while *input_index < self.inputs.len() {
            let input = &self.inputs[*input_index];
            if let Some((file, size)) = input.files.get(*file_index) {
                *file_index += 1;
                return Some(OpenFile {
                    input: *input_index,
                    size: *size,
                    reader: open_file(file.clone(), input.format, &self.fields.text),
                });
            }
            *input_index += 1;
            *file_index = 0;
        }
        None
    }
}

fn open_file(file: Arc<Path>, format: InputFormat, field: &str) -> FileReader {
    let cannot_open =
        |file: &Arc<Path>, reason: String| FileReader::Whole(Some(Record::bad(file, 0, reason)));
    match format {
        InputFormat::Jsonl | InputFormat::Chat | InputFormat::Preference => {
            match JsonlReader::open(file.clone()) {
                Ok(reader) => FileReader::Jsonl(reader),
                Err(error) => cannot_open(&file, format!("cannot read: {error}")),
            }
        }
        InputFormat::Parquet => match ParquetReader::open(file.clone(), field) {
            Ok(reader) => FileReader::Parquet(Box::new(reader)),
            Err(reason) => cannot_open(&file, reason),
        },
        InputFormat::Text | InputFormat::Files | InputFormat::Auto => {
            FileReader::Whole(Some(read_whole_file(file, format)))
        }
    }
}
