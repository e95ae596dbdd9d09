//! Added tokens: found in the text before pre-tokenization and emitted as their own ids,
//! a port of `tokenizers`' `AddedVocabulary` for tokenizers without a normalizer.

use crate::char_class::{previous_char_start, CharClasses, CHAR_CLASSES, SPACE, WORD};
use crate::tokenizer_json::AddedTokenJson;
use aho_corasick::{AhoCorasick, MatchKind};
use std::collections::HashMap;

pub(crate) struct AddedTokens {
    /// Tokens with `normalized: false`, matched first, on the whole text.
    raw: Matcher,
    /// Tokens with `normalized: true`, matched next, in the text between the first ones (with
    /// no normalizer their normalized form is their content).
    normalized: Matcher,
}

/// A piece of the text: an added token's id, or text (a byte range) to pre-tokenize.
pub(crate) enum Piece {
    Token(u32),
    Text(usize, usize),
}

struct Matcher {
    automaton: Option<AhoCorasick>,
    /// Per pattern: the token's id and entry.
    tokens: Vec<(u32, AddedTokenJson)>,
}

impl AddedTokens {
    /// Registers the tokens as `tokenizers` does when loading a file, returning them with the
    /// map from content to id: a content already in `vocab` keeps its id, others are numbered
    /// from the size of `vocab` on, and a repeated content takes the flags of its last entry.
    pub(crate) fn new(
        tokens: Vec<AddedTokenJson>,
        vocab: &HashMap<String, u32>,
    ) -> Result<(Self, HashMap<String, u32>), aho_corasick::BuildError> {
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut by_id: HashMap<u32, AddedTokenJson> = HashMap::new();
        let mut next_id = vocab.len() as u32;
        for token in tokens.into_iter().filter(|t| !t.content.is_empty()) {
            let id = match ids
                .get(&token.content)
                .or_else(|| vocab.get(&token.content))
            {
                Some(&id) => id,
                None => {
                    next_id += 1;
                    next_id - 1
                }
            };
            ids.insert(token.content.clone(), id);
            by_id.insert(id, token);
        }
        let (normalized, raw): (Vec<_>, Vec<_>) =
            by_id.into_iter().partition(|(_, token)| token.normalized);
        let added = Self {
            raw: Matcher::new(raw)?,
            normalized: Matcher::new(normalized)?,
        };
        Ok((added, ids))
    }

    /// Calls `piece` with the pieces of `text` in order.
    pub(crate) fn split(&self, text: &str, piece: &mut impl FnMut(Piece)) {
        self.raw.split(text, 0, &mut |p| match p {
            Piece::Text(start, end) => self
                .normalized
                .split(&text[start..end], start, &mut |p| piece(p)),
            token => piece(token),
        });
    }
}

impl Matcher {
    fn new(tokens: Vec<(u32, AddedTokenJson)>) -> Result<Self, aho_corasick::BuildError> {
        let automaton = if tokens.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(tokens.iter().map(|(_, token)| &token.content))?,
            )
        };
        Ok(Self { automaton, tokens })
    }

    /// `AddedVocabulary::find_matches`: pieces of `sentence`, whose offsets are shifted by
    /// `offset` (the position of `sentence` in the whole text); empty pieces are dropped.
    fn split(&self, sentence: &str, offset: usize, piece: &mut impl FnMut(Piece)) {
        let Some(automaton) = &self.automaton else {
            if !sentence.is_empty() {
                piece(Piece::Text(offset, offset + sentence.len()));
            }
            return;
        };
        let classes = &*CHAR_CLASSES;
        let s = sentence.as_bytes();
        let mut text_start = 0;
        for m in automaton.find_iter(sentence) {
            let (id, token) = &self.tokens[m.pattern().as_usize()];
            let (mut start, mut stop) = (m.start(), m.end());
            if token.single_word
                && (ends_with_word(classes, &s[..start]) || starts_with_word(classes, &s[stop..]))
            {
                continue;
            }
            if token.lstrip {
                // Spaces already taken by the previous token's rstrip stay with it.
                start = trailing_space_start(classes, &s[..start]).max(text_start);
            }
            if token.rstrip {
                stop += leading_space_len(classes, &s[stop..]);
            }
            if text_start < start {
                piece(Piece::Text(offset + text_start, offset + start));
            }
            // Empty when a whitespace token lies in spaces the previous token's rstrip took.
            if start < stop {
                piece(Piece::Token(*id));
            }
            text_start = stop;
        }
        if text_start < s.len() {
            piece(Piece::Text(offset + text_start, offset + s.len()));
        }
    }
}

fn ends_with_word(classes: &CharClasses, s: &[u8]) -> bool {
    !s.is_empty() && classes.at(s, previous_char_start(s, s.len())).0 & WORD != 0
}

fn starts_with_word(classes: &CharClasses, s: &[u8]) -> bool {
    !s.is_empty() && classes.at(s, 0).0 & WORD != 0
}

fn trailing_space_start(classes: &CharClasses, s: &[u8]) -> usize {
    let mut start = s.len();
    while start > 0 {
        let c = previous_char_start(s, start);
        if classes.at(s, c).0 & SPACE == 0 {
            break;
        }
        start = c;
    }
    start
}

fn leading_space_len(classes: &CharClasses, s: &[u8]) -> usize {
    let mut end = 0;
    while end < s.len() {
        let (flags, len) = classes.at(s, end);
        if flags & SPACE == 0 {
            break;
        }
        end += len;
    }
    end
}
