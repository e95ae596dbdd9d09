//! Tokenizers read from Hugging Face `tokenizer.json` files, encoding on every core.
//!
//! Encoding goes through `fastllm_bpe::ByteLevelBpe` when it supports the tokenizer (byte-level
//! BPE: GPT-2, Llama 3, Qwen2, StarCoder …) and through the `tokenizers` crate otherwise; both
//! give the ids of `tokenizers`' `encode(text, add_special_tokens=false)`.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use fastllm_bpe::ByteLevelBpe;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::TokenizerError;

/// Usual end-of-document token names, tried in order when tokenizer_config.json names none.
const EOS_NAMES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];
/// Usual beginning-of-document token names, likewise.
const BOS_NAMES: [&str; 3] = ["<s>", "<|begin_of_text|>", "<bos>"];

pub struct Tokenizer {
    json_path: PathBuf,
    sha256: String,
    hf: tokenizers::Tokenizer,
    /// The fast encoder, or why it does not support this tokenizer.
    fast: Result<ByteLevelBpe, String>,
    vocab_size: usize,
    configured_eos: Option<String>,
    configured_bos: Option<String>,
    /// Bytes of text each id stands for, when the fast encoder's tokens cover the text back to
    /// back and their offsets are exactly that (no post-processor trims them); built on first
    /// use.
    token_bytes: OnceLock<Option<Vec<u32>>>,
}

/// Which code encodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TokenizerImplementation {
    #[serde(rename = "fastllm-bpe")]
    FastllmBpe,
    #[serde(rename = "tokenizers")]
    Tokenizers,
}

impl fmt::Display for TokenizerImplementation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FastllmBpe => "fastllm-bpe",
            Self::Tokenizers => "tokenizers",
        })
    }
}

/// A token of the vocabulary and its id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

impl Tokenizer {
    /// Loads `path`: a `tokenizer.json`, or a directory holding one. A `tokenizer_config.json`
    /// next to it supplies the default EOS and BOS tokens.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let json_path = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_owned()
        };
        let json = fs::read(&json_path).map_err(|source| TokenizerError::Io {
            path: json_path.clone(),
            source,
        })?;
        let invalid = |reason: String| TokenizerError::Invalid {
            path: json_path.clone(),
            reason,
        };
        let mut hf =
            tokenizers::Tokenizer::from_bytes(&json).map_err(|e| invalid(e.to_string()))?;
        // Documents are stored whole: a truncation or padding setting must not apply.
        hf.with_truncation(None)
            .map_err(|e| invalid(e.to_string()))?;
        hf.with_padding(None);
        let fast = std::str::from_utf8(&json)
            .map_err(|e| e.to_string())
            .and_then(|json| ByteLevelBpe::from_json_str(json).map_err(|e| e.to_string()));
        let vocab_size = hf
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |id| id as usize + 1);
        let config_path = json_path.with_file_name("tokenizer_config.json");
        let config = read_config(&config_path)?;
        Ok(Self {
            sha256: format!("{:x}", Sha256::digest(&json)),
            json_path,
            hf,
            fast,
            vocab_size,
            configured_eos: configured_token(&config, "eos_token"),
            configured_bos: configured_token(&config, "bos_token"),
            token_bytes: OnceLock::new(),
        })
    }

    /// Appends the ids of `text` to `out`, adding no special tokens.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        match &self.fast {
            Ok(fast) => fast.encode(text, out),
            Err(_) => {
                let encoding = self
                    .hf
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                out.extend_from_slice(encoding.get_ids());
            }
        }
        Ok(())
    }

    /// Appends the ids of `text` to `ids` and the byte range of `text` each stands for to
    /// `offsets`, as `tokenizers` encodes it (the offsets transformers' masks are built from),
    /// adding no special tokens.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        ids: &mut Vec<u32>,
        offsets: &mut Vec<(usize, usize)>,
    ) -> Result<(), TokenizerError> {
        // The fast encoder's tokens, laid end to end, when they cover exactly the text (an
        // added token that strips the whitespace around it, or a prefix space, would not).
        if let (Ok(fast), Some(lengths)) = (&self.fast, self.token_bytes()) {
            let (first, first_offset) = (ids.len(), offsets.len());
            fast.encode(text, ids);
            let mut end = 0;
            offsets.extend(ids[first..].iter().map(|&id| {
                let start = end;
                end += lengths.get(id as usize).copied().unwrap_or(0) as usize;
                (start, end)
            }));
            if end == text.len() {
                return Ok(());
            }
            ids.truncate(first);
            offsets.truncate(first_offset);
        }
        let encoding = self
            .hf
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        ids.extend_from_slice(encoding.get_ids());
        offsets.extend_from_slice(encoding.get_offsets());
        Ok(())
    }

    /// The bytes of text each id of the fast encoder's (byte-level) vocabulary stands for;
    /// `None` when a post-processor trims offsets.
    fn token_bytes(&self) -> Option<&[u32]> {
        self.token_bytes
            .get_or_init(|| {
                let trims = self.hf.get_post_processor().is_some_and(|processor| {
                    serde_json::to_value(processor).is_ok_and(|json| trims_offsets(&json))
                });
                if trims {
                    return None;
                }
                let added = self.hf.get_added_tokens_decoder();
                let mut lengths = vec![0; self.vocab_size];
                for (token, id) in self.hf.get_vocab(false) {
                    // Byte-level tokens spell each byte with one character.
                    lengths[id as usize] = token.chars().count() as u32;
                }
                for (id, token) in added {
                    lengths[id as usize] = token.content.len() as u32;
                }
                Some(lengths)
            })
            .as_deref()
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.hf
            .decode(ids, false)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// One more than the largest id, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token)
    }

    pub fn implementation(&self) -> TokenizerImplementation {
        match self.fast {
            Ok(_) => TokenizerImplementation::FastllmBpe,
            Err(_) => TokenizerImplementation::Tokenizers,
        }
    }

    /// Why the fast encoder does not handle this tokenizer, when it does not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fast.as_ref().err().map(String::as_str)
    }

    /// The `tokenizer.json` read.
    pub fn json_path(&self) -> &Path {
        &self.json_path
    }

    /// SHA-256 of `tokenizer.json`, in hex.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The end-of-document token: `name` if given (an error if it is not in the vocabulary),
    /// else tokenizer_config.json's `eos_token`, else the first usual name in the vocabulary.
    pub fn eos_token(&self, name: Option<&str>) -> Result<Option<SpecialToken>, TokenizerError> {
        self.special_token(name, self.configured_eos.as_deref(), &EOS_NAMES)
    }

    /// The beginning-of-document token, found like [`eos_token`](Self::eos_token).
    pub fn bos_token(&self, name: Option<&str>) -> Result<Option<SpecialToken>, TokenizerError> {
        self.special_token(name, self.configured_bos.as_deref(), &BOS_NAMES)
    }

    fn special_token(
        &self,
        name: Option<&str>,
        configured: Option<&str>,
        usual: &[&str],
    ) -> Result<Option<SpecialToken>, TokenizerError> {
        let found = |text: &str| {
            self.token_to_id(text).map(|id| SpecialToken {
                text: text.to_owned(),
                id,
            })
        };
        match name {
            Some(name) => found(name)
                .map(Some)
                .ok_or_else(|| TokenizerError::UnknownToken {
                    path: self.json_path.clone(),
                    token: name.to_owned(),
                }),
            None => Ok(configured
                .into_iter()
                .chain(usual.iter().copied())
                .find_map(found)),
        }
    }
}

/// Whether a post-processor (as JSON) trims whitespace off token offsets anywhere.
fn trims_offsets(json: &serde_json::Value) -> bool {
    match json {
        serde_json::Value::Object(map) => map.iter().any(|(key, value)| {
            (key == "trim_offsets" && value == &serde_json::Value::Bool(true))
                || trims_offsets(value)
        }),
        serde_json::Value::Array(items) => items.iter().any(trims_offsets),
        _ => false,
    }
}

/// `tokenizer_config.json`, or `null` when there is none.
fn read_config(path: &Path) -> Result<serde_json::Value, TokenizerError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| TokenizerError::Config {
            path: path.to_owned(),
            source,
        }),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(serde_json::Value::Null),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A token named in tokenizer_config.json: a string, or an object with the string `content`.
fn configured_token(config: &serde_json::Value, key: &str) -> Option<String> {
    let value = config.get(key)?;
    value
        .as_str()
        .or_else(|| value.get("content")?.as_str())
        .map(str::to_owned)
}
