//! What a prepared dataset holds, returned by `prepare` and written as its `metadata.json`.

use std::fmt::Display;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Serialize, Serializer};

use crate::atomic_file::write_atomically;
use crate::chat::TrainOn;
use crate::input::Input;
use crate::tokenizer::{SpecialToken, TokenizerImplementation};
use crate::{DataError, TokenDtype};

pub(super) const METADATA_FILE: &str = "metadata.json";

/// Bad records quoted in full; the rest are only counted.
pub(super) const QUOTED_BAD_RECORDS: usize = 20;

#[derive(Clone, Debug, Serialize)]
pub struct PrepareReport {
    /// `text`; `chat` when some input holds conversations; `preference` when the inputs hold
    /// preference pairs, each a document with a `.preference` sidecar of its spans.
    pub format: DatasetFormat,
    /// Each shard has a `.spans` sidecar of the tokens not trained on.
    pub loss_masking_spans: bool,
    /// Which tokens of conversations are trained on (chat datasets only).
    pub train_on: Option<TrainOn>,
    /// The limit on the tokens of a preference pair (preference datasets only).
    pub max_pair_tokens: Option<u64>,
    /// The chat template conversations were rendered with.
    pub chat_template: Option<PathBuf>,
    pub documents: u64,
    /// EOS and BOS included.
    pub tokens: u64,
    /// The tokens not masked, which training targets (of preference pairs: the answers').
    pub trained_tokens: u64,
    /// One more than the largest token id.
    pub vocab_size: u64,
    #[serde(serialize_with = "as_string")]
    pub dtype: TokenDtype,
    pub eos_token: Option<SpecialToken>,
    pub bos_token: Option<SpecialToken>,
    pub add_eos: bool,
    pub add_bos: bool,
    pub tokenizer: TokenizerReport,
    pub inputs: Vec<Input>,
    pub bad_records: u64,
    /// The first bad records, as `file:line: reason`.
    pub first_bad_records: Vec<String>,
    /// Binary files of source trees.
    pub skipped_files: u64,
    /// In order; each is `NAME.bin` and `NAME.idx` in the output directory.
    pub shards: Vec<ShardReport>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    Text,
    Chat,
    /// One preference pair per document.
    Preference,
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenizerReport {
    /// The `tokenizer.json` read.
    pub path: PathBuf,
    pub sha256: String,
    pub implementation: TokenizerImplementation,
    /// Why the fast encoder was not used, when it was not.
    pub fallback_reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShardReport {
    pub name: String,
    pub documents: u64,
    pub tokens: u64,
    /// The largest token id in the shard (`None` when it holds no token), so that readers
    /// check it against a model's vocabulary without scanning the shard.
    pub max_token_id: Option<u32>,
    /// Tokens not masked by the shard's loss-masking spans (all of them without spans).
    pub trained_tokens: u64,
}

impl ShardReport {
    pub(super) fn numbered(number: usize) -> Self {
        Self {
            name: format!("shard_{number:05}"),
            documents: 0,
            tokens: 0,
            max_token_id: None,
            trained_tokens: 0,
        }
    }
}

pub(super) fn write_metadata(dir: &Path, report: &PrepareReport) -> Result<(), DataError> {
    write_atomically(&dir.join(METADATA_FILE), |w| {
        serde_json::to_writer_pretty(&mut *w, report)?;
        w.write_all(b"\n")
    })
}

fn as_string<S: Serializer>(value: &impl Display, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}
