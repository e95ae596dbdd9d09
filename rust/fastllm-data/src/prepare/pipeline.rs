//! The threads of `prepare`: one reads numbered batches, `workers` parse, tokenize and encode
//! them, and the calling thread hands them to a sink in input order.
//!
//! Stopping: when the sink fails or the run is cancelled, the calling thread drops its channel
//! ends and raises `stop`; every other thread then finds a closed channel or the flag within a
//! document, and exits. The reader may first wait for a permit: those the sink still holds come
//! back once it has written or dropped their batches.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::encode::{DocumentEncoder, Refusal, Scratch};
use super::progress::Progress;
use crate::indexed::encode_tokens;
use crate::input::{BadRecord, DocumentReader, InputCounts, RawBatch};
use crate::{PairSpans, PrepareError, TokenDtype};

/// Text per batch at most: large enough to amortize channel traffic, small enough to keep memory
/// low.
const MAX_BATCH_BYTES: usize = 1 << 20;
/// Text per batch at least, however small the input.
const MIN_BATCH_BYTES: usize = 64 << 10;
/// Batches per worker that a small input is cut into, so that every worker gets some and they
/// finish together.
const BATCHES_PER_WORKER: u64 = 8;
/// How often the calling thread looks at the cancel flag while it waits.
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// The documents of one batch, tokenized, framed and encoded as `.bin` stores them, with what
/// the reader met besides them.
pub(super) struct TokenizedBatch {
    pub documents: EncodedDocuments,
    /// Why the document after the last of `documents` cannot be stored; the batch ends there.
    pub unstorable: Option<Unstorable>,
    pub bad_records: Vec<BadRecord>,
    pub skipped_files: u64,
    pub counts: Vec<InputCounts>,
}

/// Documents encoded by the workers, so that writing them is only copying bytes.
pub(super) struct EncodedDocuments {
    /// The documents' tokens back to back, little-endian in the dataset's dtype.
    pub tokens: Vec<u8>,
    /// Tokens per document.
    pub lengths: Vec<i32>,
    /// The largest token id of each document (0 for a document without tokens).
    pub max_ids: Vec<u32>,
    /// Masked token spans per document, and the spans back to back.
    pub span_counts: Vec<u32>,
    pub spans: Vec<[u32; 2]>,
    /// The spans of each document of a preference dataset (none in other datasets).
    pub pairs: Vec<PairSpans>,
    /// Tokens not masked (of pairs: the answers').
    pub trained_tokens: u64,
}

/// A document that does not fit the format; the writer reports it with the shard it would go in.
#[derive(Clone, Copy, Debug)]
pub(super) enum Unstorable {
    TooLong {
        length: usize,
    },
    TokenOutOfRange {
        value: i64,
    },
    /// An id the tokenizer's own vocabulary does not have (a broken tokenizer): no model made
    /// for that vocabulary could read it.
    BeyondVocabulary {
        token: u32,
        vocab_size: u64,
    },
}

impl EncodedDocuments {
    pub fn with_capacity(tokens: usize, documents: usize) -> Self {
        Self {
            tokens: Vec::with_capacity(tokens),
            lengths: Vec::with_capacity(documents),
            max_ids: Vec::with_capacity(documents),
            span_counts: Vec::with_capacity(documents),
            spans: Vec::new(),
            pairs: Vec::new(),
            trained_tokens: 0,
        }
    }

    /// Adds a document of `tokens`, of which the `masked` spans are not trained on, or the
    /// preference pair of `pair`'s spans; every id must lie below `vocab_size`.
    pub fn push(
        &mut self,
        tokens: &[u32],
        masked: &[[u32; 2]],
        pair: Option<PairSpans>,
        dtype: TokenDtype,
        vocab_size: u64,
    ) -> Result<(), Unstorable> {
        let length = tokens.len();
        let length = i32::try_from(length).map_err(|_| Unstorable::TooLong { length })?;
        let max_id = tokens.iter().copied().max().unwrap_or(0);
        if !tokens.is_empty() && u64::from(max_id) >= vocab_size {
            return Err(Unstorable::BeyondVocabulary {
                token: max_id,
                vocab_size,
            });
        }
        encode_tokens(dtype, tokens, &mut self.tokens)
            .map_err(|value| Unstorable::TokenOutOfRange { value })?;
        self.lengths.push(length);
        self.max_ids.push(max_id);
        self.span_counts.push(masked.len() as u32);
        self.spans.extend_from_slice(masked);
        let masked_tokens: u64 = masked.iter().map(|[b, e]| u64::from(e - b)).sum();
        self.trained_tokens += match pair {
            Some(pair) => u64::from(pair.chosen_length() + pair.rejected_length()),
            None => length as u64 - masked_tokens,
        };
        self.pairs.extend(pair);
        Ok(())
    }
}

/// A batch's place among those in flight: dropping it lets the reader read one more. The sink
/// keeps it until done with its batch.
pub(super) struct Permit(Sender<()>);

impl Permit {
    pub fn new(returns_to: Sender<()>) -> Self {
        Self(returns_to)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // The reader may have stopped taking permits: it is done.
        let _ = self.0.send(());
    }
}

type Numbered<T> = (u64, T);

/// Reads, tokenizes and sinks every batch; returns the reader, whose inputs the caller still has
/// to [`count`](DocumentReader::count) the sunk batches into.
pub(super) fn run(
    reader: DocumentReader,
    encoder: &DocumentEncoder<'_>,
    dtype: TokenDtype,
    workers: usize,
    progress: &Progress,
    sink: impl FnMut(TokenizedBatch, Permit) -> Result<(), PrepareError>,
) -> Result<DocumentReader, PrepareError> {
    // Batches between the reader taking a permit and the sink dropping it: this bounds the
    // memory held while a slow batch keeps later ones waiting to be sunk in order, or while
    // the sink is slower than the workers.
    let in_flight = 2 * workers + 2;
    let stop = &AtomicBool::new(false);
    thread::scope(|scope| {
        let (batch_sender, batches) = crossbeam_channel::unbounded::<Numbered<RawBatch>>();
        let (done_sender, done) = crossbeam_channel::unbounded();
        let (permit_sender, permits) = crossbeam_channel::bounded(in_flight);
        for _ in 0..in_flight {
            permit_sender
                .send(())
                .expect("the channel has room for every permit");
        }
        let reader_thread =
            scope.spawn(move || read(reader, workers, batch_sender, permits, progress, stop));
        for _ in 0..workers {
            let (batches, done_sender) = (batches.clone(), done_sender.clone());
            scope.spawn(move || {
                let should_stop = || stop.load(Ordering::Relaxed) || progress.is_cancelled();
                let mut scratch = Scratch::default();
                for (number, batch) in batches {
                    let tokenized = tokenize(batch, encoder, dtype, &mut scratch, should_stop);
                    let Some(tokenized) = tokenized else {
                        return;
                    };
                    if done_sender.send((number, tokenized)).is_err() {
                        return;
                    }
                }
            });
        }
        drop((batches, done_sender));
        let result = sink_in_order(done, permit_sender, progress, sink);
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let reader = reader_thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        result.map(|()| reader)
    })
}

/// The batch size for `total_bytes` of input over `workers`.
fn batch_bytes(total_bytes: u64, workers: usize) -> usize {
    let share = total_bytes / (workers.max(1) as u64 * BATCHES_PER_WORKER);
    share.clamp(MIN_BATCH_BYTES as u64, MAX_BATCH_BYTES as u64) as usize
}

fn read(
    mut reader: DocumentReader,
    workers: usize,
    batches: Sender<Numbered<RawBatch>>,
    permits: Receiver<()>,
    progress: &Progress,
    stop: &AtomicBool,
) -> DocumentReader {
    let batch_bytes = batch_bytes(reader.total_bytes(), workers);
    for number in 0.. {
        if permits.recv().is_err() || stop.load(Ordering::Relaxed) || progress.is_cancelled() {
            break;
        }
        let should_stop = || stop.load(Ordering::Relaxed) || progress.is_cancelled();
        let Some(batch) = reader.next_raw_batch(batch_bytes, should_stop) else {
            break;
        };
        progress.set_bytes_read(reader.bytes_read());
        if batches.send((number, batch)).is_err() {
            break;
        }
    }
    reader
}

/// Parses `batch`, tokenizes its documents (through `scratch`) and encodes them in `dtype`, or
/// gives up (`None`) once `should_stop`. Documents the encoder refuses become bad records.
fn tokenize(
    batch: RawBatch,
    encoder: &DocumentEncoder<'_>,
    dtype: TokenDtype,
    scratch: &mut Scratch,
    should_stop: impl Fn() -> bool,
) -> Option<Result<TokenizedBatch, PrepareError>> {
    let batch = batch.parse();
    let text_bytes: usize = batch.documents.iter().map(|d| d.text.len()).sum();
    // About 4 bytes of text per token for English and code.
    let tokens = text_bytes / 4 + 2 * batch.documents.len();
    let mut tokenized = TokenizedBatch {
        documents: EncodedDocuments::with_capacity(tokens * dtype.size(), batch.documents.len()),
        unstorable: None,
        bad_records: Vec::with_capacity(batch.bad_records.len()),
        skipped_files: batch.skipped_files,
        counts: batch.counts,
    };
    // Bad records in input order: those the reader met, and documents the encoder refuses.
    let mut unreadable = batch
        .bad_record_positions
        .into_iter()
        .zip(batch.bad_records)
        .peekable();
    let mut refused = 0;
    for (k, document) in batch.documents.into_iter().enumerate() {
        if should_stop() {
            return None;
        }
        while let Some((_, record)) = unreadable.next_if(|&(position, _)| position == k) {
            tokenized.bad_records.push(record);
        }
        match encoder.encode(&document, scratch) {
            Ok(()) => {}
            Err(Refusal::Encode(source)) => {
                return Some(Err(PrepareError::Encode {
                    location: document.location,
                    source,
                }))
            }
            Err(Refusal::Bad(reason)) => {
                InputCounts::demote(&mut tokenized.counts, k - refused);
                refused += 1;
                tokenized.bad_records.push(BadRecord {
                    location: document.location,
                    reason,
                });
                continue;
            }
        }
        // Past an unstorable document only encoding errors matter: they fail the batch first.
        if tokenized.unstorable.is_none() {
            if let Err(unstorable) = tokenized.documents.push(
                &scratch.tokens,
                &scratch.masked,
                scratch.pair,
                dtype,
                encoder.tokenizer.vocab_size() as u64,
            ) {
                tokenized.unstorable = Some(unstorable);
            }
        }
    }
    tokenized
        .bad_records
        .extend(unreadable.map(|(_, record)| record));
    Some(Ok(tokenized))
}

/// Passes batches to `sink` in batch order, each with the permit that the reader took for it.
fn sink_in_order(
    done: Receiver<Numbered<Result<TokenizedBatch, PrepareError>>>,
    permits: Sender<()>,
    progress: &Progress,
    mut sink: impl FnMut(TokenizedBatch, Permit) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    let mut waiting = BTreeMap::new();
    let mut next = 0;
    loop {
        let received = done.recv_timeout(CANCEL_POLL);
        // Also after the last batch: cancelled workers may have dropped theirs.
        if progress.is_cancelled() {
            return Err(PrepareError::Cancelled);
        }
        match received {
            Ok((number, batch)) => {
                waiting.insert(number, batch);
            }
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        }
        while let Some(batch) = waiting.remove(&next) {
            sink(batch?, Permit::new(permits.clone()))?;
            next += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_beyond_the_tokenizers_vocabulary_is_never_stored() {
        let mut documents = EncodedDocuments::with_capacity(0, 0);
        documents
            .push(&[1, 599], &[], None, TokenDtype::U16, 600)
            .unwrap();
        let refused = documents.push(&[1, 600, 2], &[], None, TokenDtype::U16, 600);
        assert!(matches!(
            refused,
            Err(Unstorable::BeyondVocabulary {
                token: 600,
                vocab_size: 600
            })
        ));
        assert_eq!(documents.lengths, [2]);
        assert_eq!(documents.tokens.len(), 4);
    }

    #[test]
    fn small_inputs_are_cut_into_several_batches_per_worker() {
        // 10.7 MB over 16 workers: 128 batches of about 84 kB, where 1 MB batches made 11.
        let bytes = batch_bytes(10_700_000, 16);
        assert_eq!(bytes, 10_700_000 / 128);
        assert!(10_700_000 / bytes as u64 >= 16 * BATCHES_PER_WORKER);
        assert_eq!(batch_bytes(10 << 30, 16), MAX_BATCH_BYTES);
        assert_eq!(batch_bytes(1000, 16), MIN_BATCH_BYTES);
        assert_eq!(batch_bytes(1000, 0), MIN_BATCH_BYTES);
    }
}
