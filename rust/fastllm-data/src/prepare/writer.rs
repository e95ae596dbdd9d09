//! The calling thread's end of the pipeline: tokenized batches, in input order, into
//! `shard_NNNNN.bin/.idx` datasets of about `shard_size_tokens` tokens each.
//!
//! The workers have encoded the tokens already, so the calling thread only counts them to split
//! each batch at shard boundaries. Each shard has a thread of its own that copies its part of
//! the batches into `.bin`, then syncs it and writes `.idx`, while later shards are written by
//! theirs. A batch keeps its pipeline permit until written, which bounds the memory queued.

use std::collections::VecDeque;
use std::mem;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};

use crossbeam_channel::Sender;

use super::metadata::{ShardReport, QUOTED_BAD_RECORDS};
use super::pipeline::{EncodedDocuments, Permit, TokenizedBatch, Unstorable};
use super::progress::Progress;
use crate::indexed::bin_path;
use crate::input::InputCounts;
use crate::loss_spans::LossSpansWriter;
use crate::preference_spans::PreferenceSpansWriter;
use crate::{DataError, IndexedDatasetWriter, PrepareError, TokenDtype};

/// Closed shards still being written or synced while a later one is open: enough to hide a slow
/// fsync and to write small shards side by side, few enough to bound threads and open files.
const CLOSING_SHARDS: usize = 4;

type ShardThread<'scope> = ScopedJoinHandle<'scope, Result<(), DataError>>;

pub(super) struct DatasetWriter<'scope, 'env> {
    scope: &'scope Scope<'scope, 'env>,
    dir: PathBuf,
    dtype: TokenDtype,
    shard_size_tokens: u64,
    strict: bool,
    /// Each shard gets a `.spans` sidecar.
    with_spans: bool,
    /// Each shard gets a `.preference` sidecar.
    with_pairs: bool,
    /// Every shard so far; the last is the one open.
    shards: Vec<ShardReport>,
    /// To the thread of the open shard.
    jobs: Sender<ShardJob>,
    /// The shard threads not yet joined, oldest first; the last writes the open shard.
    threads: VecDeque<ShardThread<'scope>>,
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

enum ShardJob {
    /// Appends some documents of `batch`.
    Write { batch: Arc<Batch>, part: Part },
    /// The shard is complete: sync `.bin` and write `.idx`.
    Finish,
}

/// A batch shared by the shard threads that write its parts; the last one done drops the permit.
struct Batch {
    documents: EncodedDocuments,
    _permit: Permit,
}

/// Consecutive documents of a batch, and where their tokens and masked spans are in it (their
/// pair spans, in a preference dataset, are at `documents`).
#[derive(Default)]
struct Part {
    documents: Range<usize>,
    bytes: Range<usize>,
    spans: Range<usize>,
}

impl<'scope, 'env> DatasetWriter<'scope, 'env> {
    /// Opens the first shard, so even an empty input gives a readable dataset. Shard threads
    /// run in `scope`; a writer dropped unfinished abandons its open shard unsynced.
    pub fn create(
        scope: &'scope Scope<'scope, 'env>,
        dir: PathBuf,
        dtype: TokenDtype,
        shard_size_tokens: u64,
        strict: bool,
        with_spans: bool,
        with_pairs: bool,
    ) -> Result<Self, DataError> {
        let shard = ShardReport::numbered(0);
        let (jobs, thread) =
            spawn_shard(scope, dir.join(&shard.name), dtype, with_spans, with_pairs)?;
        Ok(Self {
            scope,
            dir,
            dtype,
            shard_size_tokens,
            strict,
            with_spans,
            with_pairs,
            shards: vec![shard],
            jobs,
            threads: VecDeque::from([thread]),
            tally: Tally::default(),
        })
    }

    /// Hands the documents of `batch` to the shard threads and tallies its bad records (the
    /// first is an error when `strict`). `permit` is dropped once the documents are written.
    pub fn write(
        &mut self,
        batch: TokenizedBatch,
        permit: Permit,
        progress: &Progress,
    ) -> Result<(), PrepareError> {
        if let (true, Some(record)) = (self.strict, batch.bad_records.first()) {
            return Err(PrepareError::BadRecord(record.clone()));
        }
        let documents = batch.documents.lengths.len() as u64;
        let tokens = self.add_documents(Arc::new(Batch {
            documents: batch.documents,
            _permit: permit,
        }))?;
        if let Some(unstorable) = batch.unstorable {
            return Err(self.unstorable(unstorable)?.into());
        }
        let tally = &mut self.tally;
        tally.bad_records += batch.bad_records.len() as u64;
        tally.skipped_files += batch.skipped_files;
        tally.input_counts.extend(&batch.counts);
        let room = QUOTED_BAD_RECORDS.saturating_sub(tally.first_bad_records.len());
        let quoted = batch.bad_records.iter().take(room).map(ToString::to_string);
        tally.first_bad_records.extend(quoted);
        progress.add_written(documents, tokens, batch.bad_records.len() as u64);
        Ok(())
    }

    /// Waits until every shard is synced and indexed.
    pub fn finish(mut self) -> Result<(Vec<ShardReport>, Tally), DataError> {
        self.send(ShardJob::Finish)?;
        for thread in self.threads.drain(..) {
            join(thread)?;
        }
        Ok((self.shards, self.tally))
    }

    /// Hands the documents to the shard threads, first moving to a new shard whenever the open
    /// one is full. Documents are never split, so a shard may exceed its size by one document.
    /// Returns the number of tokens.
    fn add_documents(&mut self, batch: Arc<Batch>) -> Result<u64, DataError> {
        let token_size = self.dtype.size();
        let mut part = Part::default();
        let mut tokens = 0;
        let documents = &batch.documents;
        for (k, &length) in documents.lengths.iter().enumerate() {
            if self.open_shard().tokens >= self.shard_size_tokens {
                self.send_part(&batch, &mut part)?;
                self.next_shard()?;
            }
            let spans = documents.span_counts[k] as usize;
            let untrained = match documents.pairs.get(k) {
                Some(pair) => u64::from(pair.prompt_length()),
                None => documents.spans[part.spans.end..part.spans.end + spans]
                    .iter()
                    .map(|[b, e]| u64::from(e - b))
                    .sum(),
            };
            let shard = self.open_shard();
            shard.documents += 1;
            shard.tokens += length as u64;
            if length > 0 {
                shard.max_token_id = shard.max_token_id.max(Some(documents.max_ids[k]));
            }
            shard.trained_tokens += length as u64 - untrained;
            tokens += length as u64;
            part.documents.end += 1;
            part.bytes.end += length as usize * token_size;
            part.spans.end += spans;
        }
        self.send_part(&batch, &mut part)?;
        Ok(tokens)
    }

    /// The error for a document the workers could not encode, naming the shard it would go in.
    fn unstorable(&mut self, unstorable: Unstorable) -> Result<DataError, DataError> {
        if self.open_shard().tokens >= self.shard_size_tokens {
            self.next_shard()?;
        }
        let shard = self.shards.last().expect("a shard is always open");
        let path = bin_path(&self.dir.join(&shard.name));
        Ok(match unstorable {
            Unstorable::TooLong { length } => DataError::DocumentTooLong { path, length },
            Unstorable::TokenOutOfRange { value } => DataError::TokenOutOfRange {
                path,
                value,
                dtype: self.dtype,
            },
            Unstorable::BeyondVocabulary { token, vocab_size } => DataError::BeyondVocabulary {
                path,
                document: shard.documents as usize,
                token: token.into(),
                vocab_size,
            },
        })
    }

    /// Sends the documents of `part` to the open shard, unless there are none, and empties
    /// `part` to where it ended.
    fn send_part(&mut self, batch: &Arc<Batch>, part: &mut Part) -> Result<(), DataError> {
        if part.documents.is_empty() {
            return Ok(());
        }
        let rest = Part {
            documents: part.documents.end..part.documents.end,
            bytes: part.bytes.end..part.bytes.end,
            spans: part.spans.end..part.spans.end,
        };
        let part = mem::replace(part, rest);
        self.send(ShardJob::Write {
            batch: Arc::clone(batch),
            part,
        })
    }

    /// Leaves the open shard for its thread to finish, and opens the next.
    fn next_shard(&mut self) -> Result<(), DataError> {
        self.send(ShardJob::Finish)?;
        let shard = ShardReport::numbered(self.shards.len());
        let (jobs, thread) = spawn_shard(
            self.scope,
            self.dir.join(&shard.name),
            self.dtype,
            self.with_spans,
            self.with_pairs,
        )?;
        self.jobs = jobs;
        self.threads.push_back(thread);
        self.shards.push(shard);
        // Collects the shards done, and waits for the oldest while too many are closing.
        while self.threads.len() > 1
            && (self.threads.len() > CLOSING_SHARDS + 1 || self.threads[0].is_finished())
        {
            join(self.threads.pop_front().expect("more than one thread"))?;
        }
        Ok(())
    }

    /// Sends `job` to the open shard's thread, or returns the error that stopped a thread.
    fn send(&mut self, job: ShardJob) -> Result<(), DataError> {
        if self.jobs.send(job).is_ok() {
            return Ok(());
        }
        let mut errors = self
            .threads
            .drain(..)
            .filter_map(|thread| join(thread).err());
        Err(errors
            .next()
            .expect("a shard thread stops early only on an error"))
    }

    fn open_shard(&mut self) -> &mut ShardReport {
        self.shards.last_mut().expect("a shard is always open")
    }
}

/// Creates the shard at `prefix` and the thread that writes it, fed by the returned sender.
fn spawn_shard<'scope>(
    scope: &'scope Scope<'scope, '_>,
    prefix: PathBuf,
    dtype: TokenDtype,
    with_spans: bool,
    with_pairs: bool,
) -> Result<(Sender<ShardJob>, ShardThread<'scope>), DataError> {
    let mut spans = with_spans.then(|| LossSpansWriter::new(&prefix));
    let mut pairs = with_pairs.then(|| PreferenceSpansWriter::new(&prefix));
    let mut writer = IndexedDatasetWriter::create(prefix, dtype)?;
    let (sender, jobs) = crossbeam_channel::unbounded();
    let thread = scope.spawn(move || {
        for job in jobs {
            match job {
                ShardJob::Write { batch, part } => {
                    let documents = &batch.documents;
                    let tokens = &documents.tokens[part.bytes];
                    let lengths = &documents.lengths[part.documents.clone()];
                    writer.add_encoded(tokens, lengths)?;
                    if let Some(pairs) = &mut pairs {
                        pairs.add(lengths, &documents.pairs[part.documents.clone()]);
                    }
                    if let Some(spans) = &mut spans {
                        let counts = &documents.span_counts[part.documents];
                        spans.add(lengths, counts, &documents.spans[part.spans]);
                    }
                }
                ShardJob::Finish => {
                    if let Some(spans) = spans {
                        spans.finish()?;
                    }
                    if let Some(pairs) = pairs {
                        pairs.finish()?;
                    }
                    return writer.finish();
                }
            }
        }
        // Abandoned: the run failed, and its directory is about to be removed.
        Ok(())
    });
    Ok((sender, thread))
}

fn join(thread: ShardThread<'_>) -> Result<(), DataError> {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::*;
    use crate::random::SplitMix64;

    /// Documents of 0 to 99 tokens (a few of 500) with ids below `vocab`.
    fn documents(count: usize, vocab: u64, seed: u64) -> Vec<Vec<u32>> {
        let mut random = SplitMix64::new(seed);
        (0..count)
            .map(|_| {
                let length = match random.below(10) {
                    0 => 0,
                    1 => 500,
                    _ => random.below(100),
                };
                (0..length).map(|_| random.below(vocab) as u32).collect()
            })
            .collect()
    }

    /// The documents in `sizes`-document batches, as the workers encode them.
    fn batches(documents: &[Vec<u32>], size: usize, dtype: TokenDtype) -> Vec<TokenizedBatch> {
        let batch = |documents: &[Vec<u32>]| {
            let mut encoded = EncodedDocuments::with_capacity(0, 0);
            for document in documents {
                encoded.push(document, &[], None, dtype, u64::MAX).unwrap();
            }
            TokenizedBatch {
                documents: encoded,
                unstorable: None,
                bad_records: Vec::new(),
                skipped_files: 0,
                counts: Vec::new(),
            }
        };
        documents.chunks(size).map(batch).collect()
    }

    fn write_in_parallel(
        dir: &Path,
        dtype: TokenDtype,
        shard_size_tokens: u64,
        batches: Vec<TokenizedBatch>,
    ) -> Result<Vec<ShardReport>, PrepareError> {
        let (permits, returned) = crossbeam_channel::unbounded();
        let count = batches.len();
        let shards = std::thread::scope(|scope| {
            let mut writer = DatasetWriter::create(
                scope,
                dir.to_owned(),
                dtype,
                shard_size_tokens,
                false,
                false,
                false,
            )?;
            for batch in batches {
                writer.write(batch, Permit::new(permits.clone()), &Progress::new())?;
            }
            Ok::<_, PrepareError>(writer.finish()?.0)
        })?;
        assert_eq!(returned.try_iter().count(), count, "every permit returns");
        Ok(shards)
    }

    /// The plain way: one document at a time through one writer, a new shard once one is full.
    fn write_sequentially(
        dir: &Path,
        dtype: TokenDtype,
        shard_size_tokens: u64,
        documents: &[Vec<u32>],
    ) -> Result<Vec<ShardReport>, DataError> {
        let mut shards = vec![ShardReport::numbered(0)];
        let mut writer = IndexedDatasetWriter::create(dir.join("shard_00000"), dtype)?;
        for document in documents {
            if shards.last().unwrap().tokens >= shard_size_tokens {
                let shard = ShardReport::numbered(shards.len());
                let next = IndexedDatasetWriter::create(dir.join(&shard.name), dtype)?;
                mem::replace(&mut writer, next).finish()?;
                shards.push(shard);
            }
            writer.add_document(document)?;
            let shard = shards.last_mut().unwrap();
            shard.documents += 1;
            shard.tokens += document.len() as u64;
            shard.max_token_id = shard.max_token_id.max(document.iter().copied().max());
            shard.trained_tokens += document.len() as u64;
        }
        writer.finish()?;
        Ok(shards)
    }

    fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, fs::read(&path).unwrap())
            })
            .collect();
        files.sort();
        files
    }

    #[test]
    fn shards_are_byte_identical_to_a_sequential_write() {
        for (dtype, vocab) in [(TokenDtype::U16, 1 << 16), (TokenDtype::I32, 1 << 31)] {
            let documents = documents(30, vocab, vocab);
            let total: u64 = documents.iter().map(|d| d.len() as u64).sum();
            let mut reversed = documents.clone();
            reversed.reverse();
            let mut by_length = documents.clone();
            by_length.sort_by_key(Vec::len);
            for documents in [documents, reversed, by_length] {
                // 1: a shard per document; total: exactly full at the last document.
                for shard_size in [1, 37, 400, total, u64::MAX] {
                    let dir = tempfile::tempdir().unwrap();
                    let sequential = dir.path().join("sequential");
                    fs::create_dir(&sequential).unwrap();
                    let expected =
                        write_sequentially(&sequential, dtype, shard_size, &documents).unwrap();
                    for batch_size in [1, 7, documents.len()] {
                        let parallel = dir.path().join(format!("parallel-{batch_size}"));
                        fs::create_dir(&parallel).unwrap();
                        let batches = batches(&documents, batch_size, dtype);
                        let shards =
                            write_in_parallel(&parallel, dtype, shard_size, batches).unwrap();
                        let case =
                            format!("{dtype} shards of {shard_size}, batches of {batch_size}");
                        assert_eq!(shards, expected, "{case}");
                        assert!(files(&parallel) == files(&sequential), "{case}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_unstorable_document_is_reported_with_the_shard_it_would_go_in() {
        let documents = vec![vec![1, 2, 3], vec![4], vec![5, 70_000], vec![6]];
        for shard_size in [1, 4, 100] {
            let dir = tempfile::tempdir().unwrap();
            let sequential = dir.path().join("sequential");
            fs::create_dir(&sequential).unwrap();
            let expected = write_sequentially(&sequential, TokenDtype::U16, shard_size, &documents)
                .unwrap_err();

            let parallel = dir.path().join("parallel");
            fs::create_dir(&parallel).unwrap();
            let mut batch = batches(&documents[..2], 2, TokenDtype::U16).remove(0);
            batch.unstorable = Some(Unstorable::TokenOutOfRange { value: 70_000 });
            let error =
                write_in_parallel(&parallel, TokenDtype::U16, shard_size, vec![batch]).unwrap_err();
            let expected = expected.to_string().replace("sequential", "parallel");
            assert_eq!(error.to_string(), expected);
        }
    }
}
