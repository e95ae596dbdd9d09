//! The calling thread's end of the pipeline: tokenized batches, in input order, into
//! `shard_NNNNN.bin/.idx` datasets of about `shard_size_tokens` tokens each.

use std::mem;
use std::path::PathBuf;

use super::metadata::{ShardReport, QUOTED_BAD_RECORDS};
use super::pipeline::TokenizedBatch;
use super::progress::Progress;
use crate::input::InputCounts;
use crate::{DataError, IndexedDatasetWriter, PrepareError, TokenDtype};

pub(super) struct DatasetWriter {
    dir: PathBuf,
    dtype: TokenDtype,
    shard_size_tokens: u64,
    strict: bool,
    writer: IndexedDatasetWriter,
    /// Every shard so far; the last is the one open.
    shards: Vec<ShardReport>,
    tally: Tally,
}

/// What was read besides the documents written.
#[derive(Default)]
pub(super) struct Tally {
    pub bad_records: u64,
    /// The first bad records, as `file:line: reason`.
    pub first_bad_records: Vec<String>,
    pub skipped_files: u64,
    /// Of every batch, in order.
    pub input_counts: Vec<InputCounts>,
}

impl DatasetWriter {
    /// Opens the first shard, so even an empty input gives a readable dataset.
    pub fn create(
        dir: PathBuf,
        dtype: TokenDtype,
        shard_size_tokens: u64,
        strict: bool,
    ) -> Result<Self, DataError> {
        let shard = ShardReport::numbered(0);
        Ok(Self {
            writer: IndexedDatasetWriter::create(dir.join(&shard.name), dtype)?,
            dir,
            dtype,
            shard_size_tokens,
            strict,
            shards: vec![shard],
            tally: Tally::default(),
        })
    }

    /// Writes the documents of `batch` and tallies its bad records (the first is an error when
    /// `strict`).
    pub fn write(
        &mut self,
        batch: TokenizedBatch,
        progress: &Progress,
    ) -> Result<(), PrepareError> {
        if let (true, Some(record)) = (self.strict, batch.bad_records.first()) {
            return Err(PrepareError::BadRecord(record.clone()));
        }
        for document in batch.documents() {
            self.add_document(document)?;
        }
        let tally = &mut self.tally;
        tally.bad_records += batch.bad_records.len() as u64;
        tally.skipped_files += batch.skipped_files;
        tally.input_counts.extend(&batch.counts);
        let room = QUOTED_BAD_RECORDS.saturating_sub(tally.first_bad_records.len());
        let quoted = batch.bad_records.iter().take(room).map(ToString::to_string);
        tally.first_bad_records.extend(quoted);
        progress.add_written(
            batch.lengths.len() as u64,
            batch.tokens.len() as u64,
            batch.bad_records.len() as u64,
        );
        Ok(())
    }

    pub fn finish(self) -> Result<(Vec<ShardReport>, Tally), DataError> {
        self.writer.finish()?;
        Ok((self.shards, self.tally))
    }

    /// Appends a document to the open shard, first moving to a new shard if the open one is
    /// full. Documents are never split, so a shard may exceed its size by one document.
    fn add_document(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        if self.open_shard().tokens >= self.shard_size_tokens {
            let shard = ShardReport::numbered(self.shards.len());
            let next = IndexedDatasetWriter::create(self.dir.join(&shard.name), self.dtype)?;
            mem::replace(&mut self.writer, next).finish()?;
            self.shards.push(shard);
        }
        self.writer.add_document(tokens)?;
        let shard = self.open_shard();
        shard.documents += 1;
        shard.tokens += tokens.len() as u64;
        Ok(())
    }

    fn open_shard(&mut self) -> &mut ShardReport {
        self.shards.last_mut().expect("a shard is always open")
    }
}
