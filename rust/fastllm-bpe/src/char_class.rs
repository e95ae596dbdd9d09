//! The Unicode classes the pre-tokenizer regexes use, as a two-level lookup table.
//!
//! The ranges come from `regex-syntax`, the parser behind the regex crate that `tokenizers`
//! matches `\p{L}`, `\p{N}`, `\s` and `\w` with, so both agree on every code point of the
//! Unicode version they share.

use regex_syntax::hir::{Class, HirKind};
use std::sync::LazyLock;

/// `\p{L}`: general category Letter.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`: general category Number.
pub(crate) const NUMBER: u8 = 2;
/// `\s`: the White_Space property.
pub(crate) const SPACE: u8 = 4;
/// `\w`: word characters, used by added tokens marked `single_word`.
pub(crate) const WORD: u8 = 8;

const BLOCK_BITS: u32 = 8;
const BLOCK_LEN: usize = 1 << BLOCK_BITS;

pub(crate) static CHAR_CLASSES: LazyLock<CharClasses> = LazyLock::new(CharClasses::new);

pub(crate) struct CharClasses {
    /// The flags of ASCII, looked up without decoding: most text is ASCII.
    ascii: [u8; 128],
    /// For each block of 256 code points, the offset of its flags in `flags`.
    block_start: Vec<u32>,
    /// Deduplicated blocks of per-code-point flags.
    flags: Vec<u8>,
}

impl CharClasses {
    fn new() -> Self {
        let mut all = vec![0u8; 0x11_0000];
        for (pattern, flag) in [
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
            (r"\w", WORD),
        ] {
            for (start, end) in unicode_ranges(pattern) {
                for f in &mut all[start as usize..=end as usize] {
                    *f |= flag;
                }
            }
        }
        let mut seen = std::collections::HashMap::new();
        let mut flags = Vec::new();
        let block_start = all
            .chunks(BLOCK_LEN)
            .map(|block| {
                *seen.entry(block).or_insert_with(|| {
                    flags.extend_from_slice(block);
                    (flags.len() - BLOCK_LEN) as u32
                })
            })
            .collect();
        let mut ascii = [0; 128];
        ascii.copy_from_slice(&all[..128]);
        Self {
            ascii,
            block_start,
            flags,
        }
    }

    /// The flags of the char starting at byte `i` of valid UTF-8, and its length in bytes.
    #[inline]
    pub(crate) fn at(&self, s: &[u8], i: usize) -> (u8, usize) {
        let b = s[i];
        if b < 0x80 {
            (self.ascii[usize::from(b)], 1)
        } else {
            let (c, len) = decode(s, i);
            (self.of(c), len)
        }
    }

    /// The flags of a code point (a valid one: decoded from a `str`).
    #[inline]
    pub(crate) fn of(&self, code_point: u32) -> u8 {
        let block = self.block_start[(code_point >> BLOCK_BITS) as usize] as usize;
        self.flags[block + (code_point as usize & (BLOCK_LEN - 1))]
    }
}

fn unicode_ranges(pattern: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("a fixed class pattern");
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect(),
        other => unreachable!("{pattern} parsed to {other:?}"),
    }
}

/// The code point starting at byte `i` of valid UTF-8, and its length in bytes.
#[inline]
pub(crate) fn decode(s: &[u8], i: usize) -> (u32, usize) {
    let b = s[i];
    if b < 0x80 {
        (u32::from(b), 1)
    } else if b < 0xE0 {
        ((u32::from(b & 0x1F) << 6) | u32::from(s[i + 1] & 0x3F), 2)
    } else if b < 0xF0 {
        let c = (u32::from(b & 0x0F) << 12)
            | (u32::from(s[i + 1] & 0x3F) << 6)
            | u32::from(s[i + 2] & 0x3F);
        (c, 3)
    } else {
        let c = (u32::from(b & 0x07) << 18)
            | (u32::from(s[i + 1] & 0x3F) << 12)
            | (u32::from(s[i + 2] & 0x3F) << 6)
            | u32::from(s[i + 3] & 0x3F);
        (c, 4)
    }
}

/// The start of the code point that ends at byte `end` of valid UTF-8.
#[inline]
pub(crate) fn previous_char_start(s: &[u8], end: usize) -> usize {
    let mut i = end - 1;
    while s[i] & 0xC0 == 0x80 {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_sample_code_points() {
        let c = &*CHAR_CLASSES;
        assert_eq!(c.of('a' as u32), LETTER | WORD);
        assert_eq!(c.of('7' as u32), NUMBER | WORD);
        assert_eq!(c.of(' ' as u32), SPACE);
        assert_eq!(c.of('\u{3000}' as u32), SPACE);
        assert_eq!(c.of('Ⅻ' as u32) & NUMBER, NUMBER);
        assert_eq!(c.of('中' as u32), LETTER | WORD);
        assert_eq!(c.of('_' as u32), WORD);
        assert_eq!(
            c.of('\u{301}' as u32),
            WORD,
            "a combining mark is neither L nor N"
        );
        assert_eq!(c.of('€' as u32), 0);
        assert_eq!(c.of(0x10FFFF), 0);
    }

    #[test]
    fn decode_walks_every_utf8_length() {
        let s = "a\u{e9}\u{4e2d}\u{1F600}";
        let mut i = 0;
        let mut decoded = Vec::new();
        while i < s.len() {
            let (c, n) = decode(s.as_bytes(), i);
            decoded.push(char::from_u32(c).unwrap());
            i += n;
            assert_eq!(previous_char_start(s.as_bytes(), i), i - n);
        }
        assert_eq!(decoded, s.chars().collect::<Vec<_>>());
    }
}
