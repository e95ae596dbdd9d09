//! A fast byte-level BPE encoder for `fastllm prepare`.
//!
//! [`ByteLevelBpe`] reads a Hugging Face `tokenizer.json` and returns the same ids as the
//! `tokenizers` crate for the configurations it accepts: a BPE model over GPT-2's byte-level
//! alphabet, no normalizer, a `ByteLevel` pre-tokenizer (GPT-2's regex), optionally after
//! `Split` (the GPT-2, Llama 3 or Qwen2 pattern) and `Digits` steps, and added tokens.
//! Anything else is [`BpeError::Unsupported`], and the caller uses `tokenizers` instead.
//!
//! It is faster because the pre-tokenizer regexes are hand-written scanners, words are cached
//! per thread without locks, and short words merge by a scan instead of a heap.

mod added_tokens;
mod byte_level;
mod char_class;
mod encoder;
mod error;
mod model;
mod pre_tokenizer;
mod tokenizer_json;
mod word_cache;

pub use encoder::ByteLevelBpe;
pub use error::BpeError;
