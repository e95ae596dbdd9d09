//! The threads of `prepare`: one reads numbered batches, `workers` parse and tokenize them, and
//! the calling thread hands them to a sink in input order.
//!
//! Stopping: when the sink fails or the run is cancelled, the calling thread drops its channel
//! ends and raises `stop`; every other thread then finds a closed channel or the flag within a
//! document, and exits.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::progress::Progress;
use crate::input::{BadRecord, DocumentReader, InputCounts, RawBatch};
use crate::tokenizer::Tokenizer;
use crate::PrepareError;

/// Text per batch: large enough to amortize channel traffic, small enough to keep every worker
/// busy and memory low.
const BATCH_BYTES: usize = 1 << 20;
/// How often the calling thread looks at the cancel flag while it waits.
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// Tokens added around every document.
#[derive(Clone, Copy)]
pub(super) struct Framing {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

/// The documents of one batch, tokenized and framed, with what the reader met besides them.
pub(super) struct TokenizedBatch {
    /// The documents' tokens back to back.
    pub tokens: Vec<u32>,
    pub lengths: Vec<usize>,
    pub bad_records: Vec<BadRecord>,
    pub skipped_files: u64,
    pub counts: Vec<InputCounts>,
}

impl TokenizedBatch {
    pub fn documents(&self) -> impl Iterator<Item = &[u32]> {
        self.lengths.iter().scan(0, |start, &length| {
            let document = &self.tokens[*start..*start + length];
            *start += length;
            Some(document)
        })
    }
}

type Numbered<T> = (u64, T);

/// Reads, tokenizes and sinks every batch; returns the reader, whose inputs the caller still has
/// to [`count`](DocumentReader::count) the sunk batches into.
pub(super) fn run(
    reader: DocumentReader,
    tokenizer: &Tokenizer,
    framing: Framing,
    workers: usize,
    progress: &Progress,
    sink: impl FnMut(TokenizedBatch) -> Result<(), PrepareError>,
) -> Result<DocumentReader, PrepareError> {
    // Batches between the reader taking a permit and the sink releasing it: this bounds the
    // memory held while a slow batch keeps later ones waiting to be sunk in order.
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
            scope.spawn(move || read(reader, batch_sender, permits, progress, stop));
        for _ in 0..workers {
            let (batches, done_sender) = (batches.clone(), done_sender.clone());
            scope.spawn(move || {
                let should_stop = || stop.load(Ordering::Relaxed) || progress.is_cancelled();
                for (number, batch) in batches {
                    let Some(tokenized) = tokenize(batch, tokenizer, framing, should_stop) else {
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

fn read(
    mut reader: DocumentReader,
    batches: Sender<Numbered<RawBatch>>,
    permits: Receiver<()>,
    progress: &Progress,
    stop: &AtomicBool,
) -> DocumentReader {
    for number in 0.. {
        if permits.recv().is_err() || stop.load(Ordering::Relaxed) || progress.is_cancelled() {
            break;
        }
        let Some(batch) = reader.next_raw_batch(BATCH_BYTES) else {
            break;
        };
        progress.set_bytes_read(reader.bytes_read());
        if batches.send((number, batch)).is_err() {
            break;
        }
    }
    reader
}

/// Parses `batch` and tokenizes its documents, or gives up (`None`) once `should_stop`.
fn tokenize(
    batch: RawBatch,
    tokenizer: &Tokenizer,
    framing: Framing,
    should_stop: impl Fn() -> bool,
) -> Option<Result<TokenizedBatch, PrepareError>> {
    let batch = batch.parse();
    let text_bytes: usize = batch.documents.iter().map(|d| d.text.len()).sum();
    let mut tokenized = TokenizedBatch {
        // About 4 bytes of text per token for English and code.
        tokens: Vec::with_capacity(text_bytes / 4 + 2 * batch.documents.len()),
        lengths: Vec::with_capacity(batch.documents.len()),
        bad_records: batch.bad_records,
        skipped_files: batch.skipped_files,
        counts: batch.counts,
    };
    let tokens = &mut tokenized.tokens;
    for document in batch.documents {
        if should_stop() {
            return None;
        }
        let start = tokens.len();
        tokens.extend(framing.bos);
        if let Err(source) = tokenizer.encode(&document.text, tokens) {
            return Some(Err(PrepareError::Encode {
                location: document.location,
                source,
            }));
        }
        tokens.extend(framing.eos);
        tokenized.lengths.push(tokens.len() - start);
    }
    Some(Ok(tokenized))
}

/// Passes batches to `sink` in batch order, returning a permit to the reader for each.
fn sink_in_order(
    done: Receiver<Numbered<Result<TokenizedBatch, PrepareError>>>,
    permits: Sender<()>,
    progress: &Progress,
    mut sink: impl FnMut(TokenizedBatch) -> Result<(), PrepareError>,
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
            sink(batch?)?;
            next += 1;
            // The reader may have stopped taking permits: it is done.
            let _ = permits.send(());
        }
    }
}
