use std::path::PathBuf;

use crate::token::TokenDtype;

/// Everything that can go wrong reading, writing, sampling or blending token datasets.
///
/// Errors about a file name that file, so a message is enough to find the culprit.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not an indexed dataset (bad magic)")]
    BadMagic { path: PathBuf },

    #[error("{path}: unsupported index version {version} (only version 1 is supported)")]
    UnsupportedVersion { path: PathBuf, version: u64 },

    #[error("{path}: dtype code {code} is not an integer token type")]
    UnsupportedDtype { path: PathBuf, code: u8 },

    #[error("{path}: file is {actual} bytes but its header implies {expected}")]
    SizeMismatch {
        path: PathBuf,
        expected: u128,
        actual: u64,
    },

    #[error("{path}: sequence {sequence} has negative length {length}")]
    NegativeLength {
        path: PathBuf,
        sequence: usize,
        length: i32,
    },

    #[error(
        "{path}: sequence {sequence} starts at byte {actual}, expected {expected} \
         (sequences must be back to back)"
    )]
    BadPointer {
        path: PathBuf,
        sequence: usize,
        expected: u64,
        actual: i64,
    },

    #[error(
        "{path}: document indices must start at 0, never decrease and end at the \
         sequence count {sequences}"
    )]
    BadDocumentIndices { path: PathBuf, sequences: u64 },

    #[error("{path}: token {value} does not fit {dtype}")]
    TokenOutOfRange {
        path: PathBuf,
        value: i64,
        dtype: TokenDtype,
    },

    #[error("{path}: document {document} holds token id {token}, outside 0..{vocab_size}")]
    BeyondVocabulary {
        path: PathBuf,
        document: usize,
        token: i64,
        vocab_size: u64,
    },

    #[error("{path}: a document of {length} tokens exceeds the format's limit of 2^31 - 1")]
    DocumentTooLong { path: PathBuf, length: usize },

    #[error("{path}: document {document} is out of range ({documents} documents)")]
    DocumentOutOfRange {
        path: PathBuf,
        document: usize,
        documents: usize,
    },

    #[error(
        "{path}: tokens {offset}..{offset}+{length} are out of range for document {document} \
         of {document_length} tokens"
    )]
    TokensOutOfRange {
        path: PathBuf,
        document: usize,
        offset: usize,
        length: usize,
        document_length: usize,
    },

    #[error("{path}: corrupt sampling index cache: {reason}")]
    CorruptCache { path: PathBuf, reason: &'static str },

    #[error("{documents} documents are more than the sampling index can number (2^32 - 1)")]
    TooManyDocuments { documents: usize },

    #[error("document {document} has length {length}, outside 0..2^32")]
    BadDocumentLength { document: usize, length: i64 },

    #[error("sequence_length {sequence_length} must be at least 1 and below 2^32 - 1")]
    BadSequenceLength { sequence_length: u32 },

    #[error("cannot draw {num_samples} samples: every document is empty")]
    NoTokens { num_samples: usize },

    #[error("sample {sample} is out of range ({samples} samples)")]
    SampleOutOfRange { sample: usize, samples: usize },

    #[error("blending needs at least one dataset")]
    NoDatasets,

    #[error("weight {weight} of dataset {dataset} must be finite and positive")]
    BadWeight { dataset: usize, weight: f64 },

    #[error("{weights} blending weights for {datasets} datasets")]
    WeightCountMismatch { weights: usize, datasets: usize },

    #[error("FIM {name} {value} must lie between 0 and 1")]
    BadFimRate { name: &'static str, value: f64 },

    #[error("FIM split at characters needs a text codec (the tokenizer) to decode and re-encode")]
    FimNeedsCodec,

    #[error("token {token} is not a token id (0 to 2^32 - 1)")]
    BadTokenId { token: i64 },

    #[error("character-level FIM: {0}")]
    Codec(String),

    #[error("{path}: {reason}")]
    BadLossSpans { path: PathBuf, reason: String },

    #[error("{path}: {reason}")]
    BadPreferenceSpans { path: PathBuf, reason: String },

    #[error(
        "none of the {pairs} preference pairs fits a sequence of {sequence_length} tokens (the \
         shortest has {shortest} tokens, and one more in a sample); pairs are never cut"
    )]
    NoPairFits {
        pairs: usize,
        sequence_length: u32,
        shortest: u32,
    },

    #[error(
        "{pairs} holds preference pairs but {other} does not; a blend is of pairs only or of \
         none"
    )]
    MixedPreference { pairs: PathBuf, other: PathBuf },

    #[error("FIM would move the answers of the preference pairs in {path}")]
    FimWithPreference { path: PathBuf },

    #[error("the samples hold no preference pairs")]
    NotPreference,

    #[error(
        "a preference batch needs a buffer of parts as long as its tokens ({tokens}), got \
         {parts}; other batches none"
    )]
    BadPartsBuffer { tokens: usize, parts: usize },

    #[error(
        "{path}: fewer than one sample in {ratio} has a token to train on; it has too few \
         trained tokens for samples of this length"
    )]
    TooFewTrainedTokens { path: PathBuf, ratio: usize },

    #[error("FIM cannot keep loss-masking spans in place: {path} has them")]
    FimWithLossSpans { path: PathBuf },

    #[error(
        "batch buffers must have equal lengths, a multiple of the sample length {sample_length} \
         (tokens {tokens}, document ids {document_ids}, loss mask {loss_mask})"
    )]
    BadBatchBuffers {
        sample_length: usize,
        tokens: usize,
        document_ids: usize,
        loss_mask: usize,
    },

    #[error(
        "FIM buffers must hold {samples} samples of one length, each at least its real tokens \
         (tokens {tokens}, document ids {document_ids}, loss mask {loss_mask}, most real \
         tokens {real})"
    )]
    BadFimBuffers {
        samples: usize,
        tokens: usize,
        document_ids: usize,
        loss_mask: usize,
        real: usize,
    },

    #[error("stopped before the index was built")]
    Cancelled,
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}

/// Why the inputs of a `prepare` run (or a [`crate::DocumentReader`]) cannot be listed. Problems
/// inside files are not errors but [`crate::BadRecord`]s.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("no input paths given")]
    NoInputs,

    #[error("{pattern}: invalid glob pattern: {reason}")]
    BadPattern { pattern: String, reason: String },

    #[error("{path}: matches no input file")]
    NothingMatches { path: String },

    #[error(
        "{path}: cannot tell the format from the name (known: .jsonl, .json, .ndjson, also \
         with .gz or .zst; .parquet; .txt); name the format"
    )]
    UnknownFormat { path: PathBuf },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{path}: loss-masking spans are read from JSON lines of text, not from {format:?} input"
    )]
    SpansNeedJsonl {
        path: PathBuf,
        format: crate::InputFormat,
    },

    #[error(
        "{path}: preference pairs are read from JSON lines (.jsonl, .json, .ndjson, also with \
         .gz or .zst), not from Parquet"
    )]
    PreferenceNeedsJsonl { path: PathBuf },

    #[error(
        "{pairs} holds preference pairs but {other} holds {format:?} records; a dataset is \
         made of pairs only"
    )]
    MixedPreference {
        pairs: PathBuf,
        other: PathBuf,
        format: crate::InputFormat,
    },

    #[error("walking {path}: {source}")]
    Walk {
        path: PathBuf,
        #[source]
        source: walkdir::Error,
    },
}

/// Why a tokenizer cannot be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not a valid tokenizer: {reason}")]
    Invalid { path: PathBuf, reason: String },

    #[error("{path}: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: token {token:?} is not in the vocabulary")]
    UnknownToken { path: PathBuf, token: String },

    #[error("cannot encode: {0}")]
    Encode(String),

    #[error("cannot decode: {0}")]
    Decode(String),
}

/// Why a chat template cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: {source}")]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: no chat_template (and no chat_template.jinja beside it); name one (input.chat_template)")]
    NoTemplate { path: PathBuf },

    #[error("{path}: not a valid chat template: {reason}")]
    Syntax { path: PathBuf, reason: String },
}

/// Why `prepare` stopped; it leaves no output behind.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Input(#[from] InputError),

    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),

    #[error(transparent)]
    Data(#[from] DataError),

    #[error(transparent)]
    Chat(#[from] ChatError),

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{location}: {source}")]
    Encode {
        location: crate::Location,
        #[source]
        source: TokenizerError,
    },

    #[error("{0} (strict mode stops at the first bad record)")]
    BadRecord(crate::BadRecord),

    #[error("{path}: no end-of-document token found; name one (eos_token)")]
    NoEosToken { path: PathBuf },

    #[error("{path}: no beginning-of-document token found; name one (bos_token)")]
    NoBosToken { path: PathBuf },

    #[error("{path} already exists (overwrite replaces it)")]
    OutputExists { path: PathBuf },

    #[error("{path} exists and is not a prepared dataset (no metadata.json); not replacing it")]
    NotADataset { path: PathBuf },

    #[error("{path}: the output must name a directory")]
    BadOutputPath { path: PathBuf },

    #[error("shard_size_tokens must be at least 1")]
    ZeroShardSize,

    #[error(
        "{}: no valid record, nothing to write ({bad_records} bad record(s){})",
        inputs.join(", "),
        first_bad_record.as_ref().map_or(String::new(), |first| format!("; the first: {first}"))
    )]
    NoDocuments {
        inputs: Vec<String>,
        bad_records: u64,
        first_bad_record: Option<String>,
    },

    #[error("cancelled")]
    Cancelled,
}

impl PrepareError {
    /// Whether the machine could not write the output (disk full, permissions, any OS error
    /// there), rather than the inputs or options being wrong: every I/O error of `prepare` that
    /// is not an input's is the output's.
    pub fn is_write_failure(&self) -> bool {
        matches!(self, Self::Io { .. } | Self::Data(DataError::Io { .. }))
    }

    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
