//! The parts of a `tokenizer.json` that decide the ids of an encoding, as `tokenizers` writes them.
//! (`truncation` and `padding` are not read: documents are encoded whole.)
//!
//! Unknown pre-tokenizer and model types still parse (as `Other`), so that the caller gets
//! [`crate::BpeError::Unsupported`] and falls back, rather than a parse error.

use serde::Deserialize;
use std::collections::HashMap;

#[derive(Deserialize)]
pub(crate) struct TokenizerJson {
    #[serde(default)]
    pub added_tokens: Vec<AddedTokenJson>,
    #[serde(default)]
    pub normalizer: Option<serde_json::Value>,
    #[serde(default)]
    pub pre_tokenizer: Option<PreTokenizerJson>,
    pub model: ModelJson,
}

/// An entry of `added_tokens`. Its `id` is not read because `tokenizers` ignores it too (it
/// looks the content up in the vocabulary or appends it after), nor is `special`, which only
/// matters to decoding.
#[derive(Deserialize)]
pub(crate) struct AddedTokenJson {
    pub content: String,
    pub single_word: bool,
    pub lstrip: bool,
    pub rstrip: bool,
    pub normalized: bool,
}

#[derive(Deserialize)]
#[serde(tag = "type")]
pub(crate) enum PreTokenizerJson {
    ByteLevel {
        add_prefix_space: bool,
        #[serde(default = "yes")]
        use_regex: bool,
    },
    Split {
        pattern: SplitPatternJson,
        behavior: String,
        invert: bool,
    },
    Digits {
        individual_digits: bool,
    },
    Sequence {
        pretokenizers: Vec<PreTokenizerJson>,
    },
    #[serde(other)]
    Other,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
pub(crate) enum SplitPatternJson {
    String(String),
    Regex(String),
}

#[derive(Deserialize)]
#[serde(tag = "type")]
pub(crate) enum ModelJson {
    #[serde(rename = "BPE")]
    Bpe(BpeModelJson),
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
pub(crate) struct BpeModelJson {
    #[serde(default)]
    pub dropout: Option<f32>,
    #[serde(default)]
    pub unk_token: Option<String>,
    #[serde(default)]
    pub continuing_subword_prefix: Option<String>,
    #[serde(default)]
    pub end_of_word_suffix: Option<String>,
    #[serde(default)]
    pub byte_fallback: Option<bool>,
    #[serde(default)]
    pub ignore_merges: Option<bool>,
    pub vocab: HashMap<String, u32>,
    pub merges: MergesJson,
}

/// Merges as pairs (current format) or as "left right" lines (legacy format).
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum MergesJson {
    Pairs(Vec<(String, String)>),
    Lines(Vec<String>),
}
