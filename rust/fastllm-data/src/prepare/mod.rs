//! `fastllm prepare`: raw text in, a tokenized dataset out.
//!
//! A reader thread turns the inputs into numbered batches of records, `workers` threads parse,
//! tokenize and encode them, and the calling thread puts them back in input order and splits
//! them into `shard_NNNNN.bin/.idx` files, each written by a thread of its own, plus a
//! `metadata.json`. The output directory appears complete, or not at all.

mod metadata;
mod output_dir;
mod pipeline;
mod progress;
mod writer;

use std::path::{Path, PathBuf};

pub use metadata::{PrepareReport, ShardReport, TokenizerReport};
pub use progress::Progress;

use self::metadata::write_metadata;
use self::output_dir::{check_output, PartialDir};
use self::pipeline::Framing;
use self::writer::DatasetWriter;
use crate::input::{DocumentReader, InputSpec};
use crate::tokenizer::{SpecialToken, Tokenizer};
use crate::{PrepareError, TokenDtype};

#[derive(Clone, Debug)]
pub struct PrepareOptions {
    pub input: InputSpec,
    /// A `tokenizer.json`, or a Hugging Face tokenizer directory holding one.
    pub tokenizer: PathBuf,
    /// End-of-document token; by default the tokenizer's (see [`Tokenizer::eos_token`]).
    pub eos_token: Option<String>,
    /// Beginning-of-document token; by default the tokenizer's.
    pub bos_token: Option<String>,
    pub add_eos: bool,
    pub add_bos: bool,
    /// The dataset directory to create.
    pub output: PathBuf,
    /// A new shard starts once the current one holds this many tokens.
    pub shard_size_tokens: u64,
    /// Tokenizer threads; 0 for one per core.
    pub workers: usize,
    /// Fail on the first bad record instead of counting and skipping it.
    pub strict: bool,
    /// Replace an existing dataset at `output` (only once the new one is complete).
    pub overwrite: bool,
}

/// Tokenizes the inputs of `options` into a dataset directory at `options.output`.
///
/// Runs on the calling thread plus `workers + 1` threads and a thread per shard being written;
/// `progress` can be read and cancelled from another thread meanwhile. On any error,
/// cancellation included, nothing is left at `output` (an existing dataset there is kept) and no
/// temporary files remain. Inputs without a valid record are an error, not an empty dataset.
pub fn prepare(
    options: &PrepareOptions,
    progress: &Progress,
) -> Result<PrepareReport, PrepareError> {
    if options.shard_size_tokens == 0 {
        return Err(PrepareError::ZeroShardSize);
    }
    check_output(&options.output, options.overwrite)?;
    let tokenizer = Tokenizer::load(&options.tokenizer)?;
    let eos_token = tokenizer.eos_token(options.eos_token.as_deref())?;
    let bos_token = tokenizer.bos_token(options.bos_token.as_deref())?;
    let framing = Framing {
        eos: framing_id(options.add_eos, &eos_token, || PrepareError::NoEosToken {
            path: tokenizer.json_path().to_owned(),
        })?,
        bos: framing_id(options.add_bos, &bos_token, || PrepareError::NoBosToken {
            path: tokenizer.json_path().to_owned(),
        })?,
    };
    let reader = DocumentReader::open(&options.input)?;
    progress.set_total_bytes(reader.total_bytes());

    let partial = PartialDir::create(&options.output)?;
    let vocab_size = tokenizer.vocab_size() as u64;
    let dtype = TokenDtype::for_vocab_size(vocab_size);
    let workers = match options.workers {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        workers => workers,
    };
    let (mut reader, shards, tally) = std::thread::scope(|scope| {
        let mut writer = DatasetWriter::create(
            scope,
            partial.path().to_owned(),
            dtype,
            options.shard_size_tokens,
            options.strict,
        )?;
        let reader = pipeline::run(
            reader,
            &tokenizer,
            framing,
            dtype,
            workers,
            progress,
            |batch, permit| writer.write(batch, permit, progress),
        )?;
        let (shards, tally) = writer.finish()?;
        Ok::<_, PrepareError>((reader, shards, tally))
    })?;
    if shards.iter().all(|shard| shard.documents == 0) {
        // An empty dataset only fails later, in training, far from its cause.
        return Err(PrepareError::NoDocuments {
            inputs: options.input.paths.clone(),
            bad_records: tally.bad_records,
            first_bad_record: tally.first_bad_records.first().cloned(),
        });
    }
    reader.count(&tally.input_counts);
    let report = PrepareReport {
        documents: shards.iter().map(|shard| shard.documents).sum(),
        tokens: shards.iter().map(|shard| shard.tokens).sum(),
        vocab_size,
        dtype,
        eos_token,
        bos_token,
        add_eos: options.add_eos,
        add_bos: options.add_bos,
        tokenizer: TokenizerReport {
            path: std::path::absolute(tokenizer.json_path())
                .unwrap_or_else(|_| tokenizer.json_path().to_owned()),
            sha256: tokenizer.sha256().to_owned(),
            implementation: tokenizer.implementation(),
            fallback_reason: tokenizer.fallback_reason().map(str::to_owned),
        },
        inputs: reader.into_inputs(),
        bad_records: tally.bad_records,
        first_bad_records: tally.first_bad_records,
        skipped_files: tally.skipped_files,
        shards,
    };
    write_metadata(partial.path(), &report)?;
    copy_tokenizer_files(&tokenizer, partial.path())?;
    if progress.is_cancelled() {
        return Err(PrepareError::Cancelled);
    }
    partial.commit(options.overwrite)?;
    Ok(report)
}

/// The dataset keeps its tokenizer (`tokenizer.json` and, when present, the
/// `tokenizer_config.json` beside it), so that training, FIM and exported models find it.
fn copy_tokenizer_files(tokenizer: &Tokenizer, dataset: &Path) -> Result<(), PrepareError> {
    let json = tokenizer.json_path();
    let settings = json.with_file_name("tokenizer_config.json");
    for (source, name) in [
        (json, "tokenizer.json"),
        (settings.as_path(), "tokenizer_config.json"),
    ] {
        if source.is_file() {
            std::fs::copy(source, dataset.join(name)).map_err(PrepareError::io(source))?;
        }
    }
    Ok(())
}

/// The id to add around each document, if `add`.
fn framing_id(
    add: bool,
    token: &Option<SpecialToken>,
    missing: impl FnOnce() -> PrepareError,
) -> Result<Option<u32>, PrepareError> {
    match (add, token) {
        (false, _) => Ok(None),
        (true, Some(token)) => Ok(Some(token.id)),
        (true, None) => Err(missing()),
    }
}
