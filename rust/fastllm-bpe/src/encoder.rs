use crate::added_tokens::{AddedTokens, Piece};
use crate::error::BpeError;
use crate::model::{BpeModel, MergeScratch};
use crate::pre_tokenizer::PreTokenizer;
use crate::tokenizer_json::{ModelJson, TokenizerJson};
use crate::word_cache::{WordCache, MAX_CACHED_WORD_BYTES};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A byte-level BPE tokenizer read from a `tokenizer.json`, whose [`encode`](Self::encode)
/// gives the ids of `tokenizers`' `Tokenizer::encode(text, false)` with truncation and padding
/// off: no post-processor template (the caller adds BOS/EOS ids itself), no length limit.
///
/// One instance serves any number of threads; each thread keeps its own bounded word cache.
pub struct ByteLevelBpe {
    /// Tells the thread-local caches which instance they hold words of.
    instance: u64,
    added_tokens: AddedTokens,
    pre_tokenizer: PreTokenizer,
    model: BpeModel,
    token_ids: HashMap<String, u32>,
    vocab_size: usize,
}

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(0);

/// What a thread reuses from one `encode` call to the next.
#[derive(Default)]
struct ThreadState {
    instance: Option<u64>,
    cache: WordCache,
    merge: MergeScratch,
    prefixed: Vec<u8>,
}

thread_local! {
    static THREAD_STATE: RefCell<ThreadState> = RefCell::new(ThreadState::default());
}

impl ByteLevelBpe {
    /// Reads a `tokenizer.json` file (see [`from_json_str`](Self::from_json_str)).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, BpeError> {
        let path = path.as_ref();
        let json = std::fs::read_to_string(path).map_err(|source| BpeError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&json)
    }

    /// Reads a `tokenizer.json`; [`BpeError::Unsupported`] names what this encoder cannot
    /// reproduce.
    pub fn from_json_str(json: &str) -> Result<Self, BpeError> {
        let json: TokenizerJson = serde_json::from_str(json)?;
        if json.normalizer.is_some() {
            return Err(BpeError::Unsupported("a normalizer".into()));
        }
        let ModelJson::Bpe(model) = json.model else {
            return Err(BpeError::Unsupported("a model other than BPE".into()));
        };
        let pre_tokenizer = PreTokenizer::new(json.pre_tokenizer)?;
        let (added_tokens, added_ids) = AddedTokens::new(json.added_tokens, &model.vocab)
            .map_err(|e| BpeError::Invalid(format!("added tokens: {e}")))?;
        let mut token_ids = model.vocab.clone();
        token_ids.extend(added_ids);
        let vocab_size = token_ids.values().max().map_or(0, |&id| id as usize + 1);
        Ok(Self {
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            added_tokens,
            pre_tokenizer,
            model: BpeModel::new(model)?,
            token_ids,
            vocab_size,
        })
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        THREAD_STATE.with(|state| {
            let state = &mut *state.borrow_mut();
            if state.instance != Some(self.instance) {
                state.cache.clear();
                state.instance = Some(self.instance);
            }
            let ThreadState {
                cache,
                merge,
                prefixed,
                ..
            } = state;
            self.added_tokens.split(text, &mut |piece| match piece {
                Piece::Token(id) => out.push(id),
                Piece::Text(start, end) => {
                    self.pre_tokenizer.for_each_word(
                        &text.as_bytes()[start..end],
                        prefixed,
                        &mut |word| self.encode_word(word, cache, merge, out),
                    );
                }
            });
        });
    }

    #[inline]
    fn encode_word(
        &self,
        word: &[u8],
        cache: &mut WordCache,
        merge: &mut MergeScratch,
        out: &mut Vec<u32>,
    ) {
        if word.len() > MAX_CACHED_WORD_BYTES {
            self.model.encode_word(word, merge, out);
            return;
        }
        match cache.get(word) {
            Ok(ids) => out.extend_from_slice(ids),
            Err(hash) => {
                let start = out.len();
                self.model.encode_word(word, merge, out);
                cache.insert(hash, word, &out[start..]);
            }
        }
    }

    /// The id of a token, written as in `tokenizer.json` (byte-level chars for the
    /// vocabulary, plain text for added tokens).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.token_ids.get(token).copied()
    }

    /// One more than the largest id `encode` can return.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}
