//! `fastllm prepare`: raw text in, a tokenized dataset out.
//!
//! A reader thread turns the inputs into numbered batches of records, `workers` threads parse,
//! tokenize and encode them, and the calling thread puts them back in input order and splits
//! them into `shard_NNNNN.bin/.idx` files, each written by a thread of its own, plus a
//! `metadata.json`. The output directory appears complete, or not at all.

mod encode;
mod metadata;
mod output_dir;
mod pipeline;
mod preference;
mod progress;
mod writer;

use std::path::{Path, PathBuf};

pub use metadata::{DatasetFormat, PrepareReport, ShardReport, TokenizerReport};
pub use progress::Progress;

use self::encode::{DocumentEncoder, Framing};
use self::metadata::write_metadata;
use self::output_dir::{check_output, PartialDir};
use self::writer::DatasetWriter;
use crate::chat::{ChatTemplate, TrainOn};
use crate::input::{DocumentReader, Feed, InputFormat, InputSpec};
use crate::tokenizer::{SpecialToken, Tokenizer};
use crate::{ChatError, PrepareError, TokenDtype};

#[derive(Clone, Debug)]
pub struct PrepareOptions {
    pub input: InputSpec,
    /// Records sent by the caller, read instead of the files of `input` (whose fields still
    /// say where JSON records hold their parts).
    pub feed: Option<Feed>,
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
    /// A chat template file to render conversations with instead of the tokenizer's.
    pub chat_template: Option<PathBuf>,
    /// Which tokens of conversations are trained on.
    pub train_on: TrainOn,
    /// Preference pairs of more tokens (prompt and both answers) are bad records.
    pub max_pair_tokens: Option<u64>,
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
    let reader = match &options.feed {
        Some(feed) => DocumentReader::fed(feed.clone(), &options.input),
        None => DocumentReader::open(&options.input)?,
    };
    progress.set_total_bytes(reader.total_bytes());
    let has = |format| reader.inputs().iter().any(|input| input.format == format);
    let (chat, preference) = (has(InputFormat::Chat), has(InputFormat::Preference));
    let load_template = || ChatTemplate::load(&options.tokenizer, options.chat_template.as_deref());
    let template = match (chat, preference) {
        (true, _) => Some(load_template()?),
        // Pairs of strings need no template; pairs of messages without one are bad records.
        (false, true) => match load_template() {
            Err(ChatError::NoTemplate { .. }) => None,
            loaded => Some(loaded?),
        },
        (false, false) => None,
    };
    let with_spans = chat || options.input.loss_masking_spans.is_some();
    let encoder = DocumentEncoder {
        tokenizer: &tokenizer,
        framing,
        chat: template.as_ref(),
        train_on: options.train_on,
        max_pair_tokens: options.max_pair_tokens,
    };

    let partial = PartialDir::create(&options.output, progress)?;
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
            with_spans,
            preference,
        )?;
        let reader = pipeline::run(
            reader,
            &encoder,
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
            inputs: match &options.feed {
                Some(feed) => feed
                    .inputs
                    .iter()
                    .map(|(path, _)| path.display().to_string())
                    .collect(),
                None => options.input.paths.clone(),
            },
            bad_records: tally.bad_records,
            first_bad_record: tally.first_bad_records.first().cloned(),
        });
    }
    reader.count(&tally.input_counts);
    let report = PrepareReport {
        format: match (chat, preference) {
            (true, _) => DatasetFormat::Chat,
            (false, true) => DatasetFormat::Preference,
            (false, false) => DatasetFormat::Text,
        },
        loss_masking_spans: with_spans,
        train_on: chat.then_some(options.train_on),
        max_pair_tokens: options.max_pair_tokens.filter(|_| preference),
        chat_template: template
            .as_ref()
            .map(|t| std::path::absolute(t.path()).unwrap_or_else(|_| t.path().to_owned())),
        documents: shards.iter().map(|shard| shard.documents).sum(),
        tokens: shards.iter().map(|shard| shard.tokens).sum(),
        trained_tokens: shards.iter().map(|shard| shard.trained_tokens).sum(),
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
    copy_tokenizer_files(&tokenizer, template.as_ref(), partial.path())?;
    if progress.is_cancelled() {
        return Err(PrepareError::Cancelled);
    }
    partial.commit(options.overwrite)?;
    Ok(report)
}

/// The dataset keeps its tokenizer (`tokenizer.json` and, when present, the
/// `tokenizer_config.json` beside it), so that training, FIM and exported models find it; a
/// chat dataset's `tokenizer_config.json` holds the chat template its conversations were
/// rendered with, so that the fine-tuned model is prompted the same way.
fn copy_tokenizer_files(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    dataset: &Path,
) -> Result<(), PrepareError> {
    let json = tokenizer.json_path();
    let copy = dataset.join("tokenizer.json");
    std::fs::copy(json, &copy).map_err(PrepareError::io(&copy))?;
    let settings = json.with_file_name("tokenizer_config.json");
    let target = dataset.join("tokenizer_config.json");
    match template {
        None if settings.is_file() => {
            std::fs::copy(&settings, &target).map_err(PrepareError::io(&target))?;
        }
        None => {}
        Some(template) => {
            let mut config = match std::fs::read(&settings) {
                Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
                Err(_) => serde_json::Map::new(),
            };
            config.insert("chat_template".to_owned(), template.source().into());
            let text = serde_json::to_string_pretty(&config).expect("JSON values serialize");
            std::fs::write(&target, text + "\n").map_err(PrepareError::io(&target))?;
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
