//! The BPE model: byte ids, merge ranks, and the merge loop over one pre-tokenized word.

use crate::byte_level::{byte_chars, ByteDecoder};
use crate::error::BpeError;
use crate::tokenizer_json::{BpeModelJson, MergesJson};
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Words up to this many symbols merge by rescanning all pairs (quadratic, but tiny and
/// cache-friendly); longer ones use a heap so that no input is quadratic.
const SCAN_MERGE_MAX_SYMBOLS: usize = 48;
const NO_MERGE: u64 = u64::MAX;

pub(crate) struct BpeModel {
    /// The id of each byte's char; `None` when the vocabulary lacks it, and `tokenizers`
    /// then drops that byte.
    byte_ids: [Option<u32>; 256],
    /// (left id, right id) → (rank, merged id), both packed in a u64 so that comparing the
    /// packed values orders by rank.
    merges: FxHashMap<u64, u64>,
    /// With `ignore_merges`, a word found here is one token whatever the merges say.
    whole_words: Option<HashMap<Vec<u8>, u32, FxBuildHasher>>,
}

/// Buffers reused from word to word.
#[derive(Default)]
pub(crate) struct MergeScratch {
    ids: Vec<u32>,
    ranks: Vec<u64>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u64, u32)>>,
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

impl BpeModel {
    pub(crate) fn new(json: BpeModelJson) -> Result<Self, BpeError> {
        if json.dropout.is_some_and(|p| p != 0.0) {
            return Err(BpeError::Unsupported("BPE dropout".into()));
        }
        if json.continuing_subword_prefix.is_some() || json.end_of_word_suffix.is_some() {
            return Err(BpeError::Unsupported(
                "continuing_subword_prefix / end_of_word_suffix".into(),
            ));
        }
        let mut ids_seen = FxHashSet::default();
        if !json.vocab.values().all(|id| ids_seen.insert(*id)) {
            // Two tokens sharing an id change which stale merges `tokenizers` still applies.
            return Err(BpeError::Unsupported(
                "vocabulary ids are not unique".into(),
            ));
        }
        let vocab = &json.vocab;
        let mut byte_ids = [None; 256];
        for (b, c) in byte_chars().into_iter().enumerate() {
            byte_ids[b] = vocab.get(c.encode_utf8(&mut [0; 4]) as &str).copied();
        }
        if byte_ids.contains(&None) {
            // `tokenizers` emits the unknown token or byte-fallback tokens for such bytes,
            // in an order this encoder does not reproduce; without either it drops them.
            if json.unk_token.is_some() || json.byte_fallback == Some(true) {
                return Err(BpeError::Unsupported(
                    "bytes missing from the vocabulary with unk_token or byte_fallback".into(),
                ));
            }
        }

        let mut merges = FxHashMap::default();
        for (rank, (left, right)) in merge_pairs(json.merges)?.into_iter().enumerate() {
            let id = |token: &str| {
                vocab.get(token).copied().ok_or_else(|| {
                    BpeError::Invalid(format!("merge token {token:?} is not in the vocabulary"))
                })
            };
            let key = (u64::from(id(&left)?) << 32) | u64::from(id(&right)?);
            let merged = id(&(left + &right))?;
            // Later duplicates win, as in `tokenizers`' map.
            merges.insert(key, ((rank as u64) << 32) | u64::from(merged));
        }

        let whole_words = json.ignore_merges.unwrap_or(false).then(|| {
            let decoder = ByteDecoder::new();
            vocab
                .iter()
                .filter_map(|(token, &id)| Some((decoder.token_bytes(token)?, id)))
                .collect()
        });
        Ok(Self {
            byte_ids,
            merges,
            whole_words,
        })
    }

    /// Appends the ids of one pre-tokenized word (its raw bytes, non-empty).
    pub(crate) fn encode_word(&self, word: &[u8], scratch: &mut MergeScratch, out: &mut Vec<u32>) {
        if let Some(&id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            out.push(id);
            return;
        }
        scratch.ids.clear();
        scratch
            .ids
            .extend(word.iter().filter_map(|&b| self.byte_ids[usize::from(b)]));
        if scratch.ids.len() <= SCAN_MERGE_MAX_SYMBOLS {
            self.merge_by_scan(scratch);
            out.extend_from_slice(&scratch.ids);
        } else {
            self.merge_by_heap(scratch, out);
        }
    }

    #[inline]
    fn merge_of(&self, left: u32, right: u32) -> u64 {
        let key = (u64::from(left) << 32) | u64::from(right);
        self.merges.get(&key).copied().unwrap_or(NO_MERGE)
    }

    /// Repeatedly applies the lowest-ranked merge, leftmost first: what `tokenizers`' heap
    /// computes, since its heap always holds every current pair ordered by (rank, position).
    fn merge_by_scan(&self, scratch: &mut MergeScratch) {
        let MergeScratch { ids, ranks, .. } = scratch;
        ranks.clear();
        ranks.extend(ids.windows(2).map(|w| self.merge_of(w[0], w[1])));
        loop {
            // The first of equal minima: the leftmost.
            let Some((i, &best)) = ranks.iter().enumerate().min_by_key(|&(_, &rank)| rank) else {
                return;
            };
            if best == NO_MERGE {
                return;
            }
            ids[i] = best as u32;
            ids.remove(i + 1);
            ranks.remove(i);
            if i > 0 {
                ranks[i - 1] = self.merge_of(ids[i - 1], ids[i]);
            }
            if i + 1 < ids.len() {
                ranks[i] = self.merge_of(ids[i], ids[i + 1]);
            }
        }
    }

    /// `tokenizers`' own algorithm: a heap of candidate merges over a linked list of symbols,
    /// skipping entries whose pair has changed since they were pushed.
    fn merge_by_heap(&self, scratch: &mut MergeScratch, out: &mut Vec<u32>) {
        let MergeScratch {
            ids, symbols, heap, ..
        } = scratch;
        let n = ids.len() as u32;
        symbols.clear();
        symbols.extend(ids.iter().enumerate().map(|(i, &id)| Symbol {
            id,
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NONE
            } else {
                i as u32 + 1
            },
            alive: true,
        }));
        heap.clear();
        for (i, w) in ids.windows(2).enumerate() {
            let merge = self.merge_of(w[0], w[1]);
            if merge != NO_MERGE {
                heap.push(Reverse((merge, i as u32)));
            }
        }
        while let Some(Reverse((merge, pos))) = heap.pop() {
            let left = symbols[pos as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            if self.merge_of(left.id, right.id) != merge {
                continue;
            }
            let merged = Symbol {
                id: merge as u32,
                next: right.next,
                ..left
            };
            symbols[pos as usize] = merged;
            symbols[left.next as usize].alive = false;
            if merged.next != NONE {
                symbols[merged.next as usize].prev = pos;
                let m = self.merge_of(merged.id, symbols[merged.next as usize].id);
                if m != NO_MERGE {
                    heap.push(Reverse((m, pos)));
                }
            }
            if merged.prev != NONE {
                let m = self.merge_of(symbols[merged.prev as usize].id, merged.id);
                if m != NO_MERGE {
                    heap.push(Reverse((m, merged.prev)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

fn merge_pairs(merges: MergesJson) -> Result<Vec<(String, String)>, BpeError> {
    match merges {
        MergesJson::Pairs(pairs) => Ok(pairs),
        MergesJson::Lines(lines) => lines
            .into_iter()
            .filter(|line| !line.starts_with("#version"))
            .enumerate()
            .map(|(i, line)| match line.split(' ').collect::<Vec<_>>()[..] {
                [left, right] => Ok((left.to_owned(), right.to_owned())),
                _ => Err(BpeError::Invalid(format!(
                    "merge {} is not two tokens separated by one space: {line:?}",
                    i + 1
                ))),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Merges over "a" and "b" that overlap and chain in many ways, so that the order in which
    /// they apply decides the result.
    fn tangled_model() -> BpeModel {
        let merges = [
            ("a", "a"),
            ("b", "a"),
            ("aa", "a"),
            ("a", "b"),
            ("ab", "ab"),
            ("aa", "aa"),
            ("ba", "b"),
            ("aaa", "b"),
            ("b", "b"),
            ("bb", "aa"),
            ("a", "ba"),
            ("aa", "b"),
        ];
        let mut vocab: Vec<String> = vec!["a".into(), "b".into()];
        vocab.extend(merges.iter().map(|(l, r)| format!("{l}{r}")));
        let vocab: HashMap<&str, usize> = vocab
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        let json = json!({"vocab": vocab, "merges": merges});
        BpeModel::new(serde_json::from_value(json).unwrap()).unwrap()
    }

    #[test]
    fn scan_and_heap_merges_agree() {
        let model = tangled_model();
        let mut scratch = MergeScratch::default();
        let mut state = 7u64;
        for len in 1..=SCAN_MERGE_MAX_SYMBOLS {
            for _ in 0..100 {
                let word: Vec<u8> = (0..len)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6_364_136_223_846_793_005)
                            .wrapping_add(1);
                        if state >> 63 == 0 {
                            b'a'
                        } else {
                            b'b'
                        }
                    })
                    .collect();
                let load = |scratch: &mut MergeScratch| {
                    scratch.ids.clear();
                    scratch.ids.extend(
                        word.iter()
                            .map(|&b| model.byte_ids[usize::from(b)].unwrap()),
                    );
                };
                load(&mut scratch);
                model.merge_by_scan(&mut scratch);
                let scanned = scratch.ids.clone();
                load(&mut scratch);
                let mut heaped = Vec::new();
                model.merge_by_heap(&mut scratch, &mut heaped);
                assert_eq!(scanned, heaped, "{}", String::from_utf8_lossy(&word));
            }
        }
    }
}
