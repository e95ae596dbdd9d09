//! A bounded map from word bytes to their ids, one per thread.
//!
//! Words and ids live in two arenas, so inserting allocates nothing once the arenas have grown;
//! when the cache is full it is cleared, which keeps frequent words (they come right back) and
//! bounds memory without bookkeeping on every hit.

use hashbrown::HashTable;
use std::hash::BuildHasher;

/// Longer words are rare and would fill the arena: they are merged every time.
pub(crate) const MAX_CACHED_WORD_BYTES: usize = 64;
const MAX_ENTRIES: usize = 1 << 18;

#[derive(Default)]
pub(crate) struct WordCache {
    table: HashTable<Entry>,
    words: Vec<u8>,
    ids: Vec<u32>,
}

struct Entry {
    hash: u64,
    word_start: u32,
    word_len: u32,
    ids_start: u32,
    ids_len: u32,
}

fn hash(word: &[u8]) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(word)
}

impl WordCache {
    /// The cached ids of `word`, and the hash to insert it with if absent.
    #[inline]
    pub(crate) fn get(&self, word: &[u8]) -> Result<&[u32], u64> {
        let hash = hash(word);
        let found = self.table.find(hash, |e| {
            e.hash == hash && &self.words[e.word_start as usize..][..e.word_len as usize] == word
        });
        match found {
            Some(e) => Ok(&self.ids[e.ids_start as usize..][..e.ids_len as usize]),
            None => Err(hash),
        }
    }

    pub(crate) fn insert(&mut self, hash: u64, word: &[u8], ids: &[u32]) {
        if self.table.len() >= MAX_ENTRIES {
            self.clear();
        }
        let entry = Entry {
            hash,
            word_start: self.words.len() as u32,
            word_len: word.len() as u32,
            ids_start: self.ids.len() as u32,
            ids_len: ids.len() as u32,
        };
        self.words.extend_from_slice(word);
        self.ids.extend_from_slice(ids);
        self.table.insert_unique(hash, entry, |e| e.hash);
    }

    pub(crate) fn clear(&mut self) {
        self.table.clear();
        self.words.clear();
        self.ids.clear();
    }
}
