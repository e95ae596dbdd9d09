//! Pre-tokenizers: split text into the words that BPE merges within, exactly where
//! `tokenizers`' regexes split it, with hand-written scanners instead of a regex engine.

use crate::char_class::{decode, CharClasses, CHAR_CLASSES, LETTER, NUMBER, SPACE};
use crate::error::BpeError;
use crate::tokenizer_json::{PreTokenizerJson, SplitPatternJson};

/// GPT-2's regex, built into `tokenizers`' `ByteLevel` and sometimes spelled out in a `Split`.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The class of a char for the regexes: `LETTER`, `NUMBER`, `SPACE`, or `OTHER` (none of them;
/// the three properties never overlap).
const OTHER: u8 = 0;

pub(crate) struct PreTokenizer {
    /// Applied in order, each to every piece the previous one produced.
    stages: Vec<Stage>,
}

enum Stage {
    Split(Splitter),
    /// `ByteLevel`'s `add_prefix_space`: a piece not starting with a space gets one.
    PrefixSpace,
}

/// A split `tokenizers` applies with `Isolated` behavior: every piece, match or not, is kept.
#[derive(Clone, Copy)]
enum Splitter {
    Gpt2,
    /// [`LLAMA3_PATTERN`] (at most 3 digits together) and [`QWEN2_PATTERN`] (1).
    Llama3 {
        max_digits: usize,
    },
    /// The `Digits` pre-tokenizer: numeric chars alone or in runs, apart from the rest.
    Digits {
        individual: bool,
    },
}

impl PreTokenizer {
    /// Accepts any number of `Split` (known patterns) and `Digits` steps followed by one `ByteLevel`.
    pub(crate) fn new(json: Option<PreTokenizerJson>) -> Result<Self, BpeError> {
        let steps = match json {
            None => return Err(unsupported("no pre-tokenizer (not byte-level)")),
            Some(PreTokenizerJson::Sequence { pretokenizers }) => pretokenizers,
            Some(step) => vec![step],
        };
        let Some((
            PreTokenizerJson::ByteLevel {
                add_prefix_space,
                use_regex,
            },
            splits,
        )) = steps.split_last()
        else {
            return Err(unsupported("the last pre-tokenizer is not ByteLevel"));
        };
        let mut stages = splits
            .iter()
            .map(|step| match step {
                PreTokenizerJson::Split {
                    pattern,
                    behavior,
                    invert,
                } => {
                    if behavior != "Isolated" || *invert {
                        return Err(unsupported(&format!(
                            "Split with behavior {behavior}, invert {invert}"
                        )));
                    }
                    match pattern {
                        SplitPatternJson::Regex(p) if p == GPT2_PATTERN => Ok(Splitter::Gpt2),
                        SplitPatternJson::Regex(p) if p == LLAMA3_PATTERN => {
                            Ok(Splitter::Llama3 { max_digits: 3 })
                        }
                        SplitPatternJson::Regex(p) if p == QWEN2_PATTERN => {
                            Ok(Splitter::Llama3 { max_digits: 1 })
                        }
                        SplitPatternJson::Regex(p) | SplitPatternJson::String(p) => {
                            Err(unsupported(&format!("Split pattern {p:?}")))
                        }
                    }
                }
                PreTokenizerJson::Digits { individual_digits } => Ok(Splitter::Digits {
                    individual: *individual_digits,
                }),
                _ => Err(unsupported(
                    "a pre-tokenizer other than Split, Digits, ByteLevel",
                )),
            })
            .map(|splitter| splitter.map(Stage::Split))
            .collect::<Result<Vec<_>, _>>()?;
        if *add_prefix_space {
            stages.push(Stage::PrefixSpace);
        }
        if *use_regex {
            stages.push(Stage::Split(Splitter::Gpt2));
        }
        Ok(Self { stages })
    }

    /// Calls `word` with each word of `piece` (valid UTF-8, non-empty). `prefixed` is scratch
    /// space for pieces that get a prefix space.
    pub(crate) fn for_each_word<F: FnMut(&[u8])>(
        &self,
        piece: &[u8],
        prefixed: &mut Vec<u8>,
        word: &mut F,
    ) {
        run_stages(&self.stages, &CHAR_CLASSES, piece, prefixed, word);
    }
}

fn unsupported(what: &str) -> BpeError {
    BpeError::Unsupported(format!("pre_tokenizer: {what}"))
}

fn run_stages<F: FnMut(&[u8])>(
    stages: &[Stage],
    classes: &CharClasses,
    piece: &[u8],
    prefixed: &mut Vec<u8>,
    word: &mut F,
) {
    match stages.split_first() {
        None => word(piece),
        Some((Stage::PrefixSpace, rest)) if !piece.starts_with(b" ") => {
            let mut buffer = std::mem::take(prefixed);
            buffer.clear();
            buffer.push(b' ');
            buffer.extend_from_slice(piece);
            run_stages(rest, classes, &buffer, prefixed, word);
            *prefixed = buffer;
        }
        Some((Stage::PrefixSpace, rest)) => run_stages(rest, classes, piece, prefixed, word),
        Some((Stage::Split(splitter), rest)) => {
            let mut start = 0;
            while start < piece.len() {
                let end = splitter.word_end(classes, piece, start);
                run_stages(rest, classes, &piece[start..end], prefixed, word);
                start = end;
            }
        }
    }
}

impl Splitter {
    /// The end of the word starting at byte `i` of `s`, i.e. of the regex match there.
    #[inline]
    fn word_end(self, classes: &CharClasses, s: &[u8], i: usize) -> usize {
        match self {
            Splitter::Gpt2 => gpt2_word_end(classes, s, i),
            Splitter::Llama3 { max_digits } => llama3_word_end(classes, s, i, max_digits),
            Splitter::Digits { individual } => digits_word_end(s, i, individual),
        }
    }
}

#[inline]
fn kind_at(classes: &CharClasses, s: &[u8], i: usize) -> (u8, usize) {
    let (flags, len) = classes.at(s, i);
    (flags & (LETTER | NUMBER | SPACE), len)
}

/// The end of the run of chars of `kind` starting at `i`.
#[inline]
fn run_end(classes: &CharClasses, s: &[u8], mut i: usize, kind: u8) -> usize {
    while i < s.len() {
        let (k, len) = kind_at(classes, s, i);
        if k != kind {
            break;
        }
        i += len;
    }
    i
}

/// After `'`, the length of `s|t|re|ve|m|ll|d` (case-insensitively: also `ſ`, which folds to `s`).
fn contraction_len(s: &[u8], i: usize, ignore_case: bool) -> Option<usize> {
    let at = |k: usize| {
        s.get(i + k).map(|&b| {
            if ignore_case {
                b.to_ascii_lowercase()
            } else {
                b
            }
        })
    };
    match at(0)? {
        b's' | b't' | b'm' | b'd' => Some(1),
        b'r' | b'v' if at(1) == Some(b'e') => Some(2),
        b'l' if at(1) == Some(b'l') => Some(2),
        0xC5 if ignore_case && at(1) == Some(0xBF) => Some(2),
        _ => None,
    }
}

/// A whitespace run starting at `i`: its end, the start of its last char, and the end of its
/// last `\r` or `\n`.
fn space_run(classes: &CharClasses, s: &[u8], i: usize) -> (usize, usize, Option<usize>) {
    let (mut end, mut last, mut after_newline) = (i, i, None);
    while end < s.len() {
        let (k, len) = kind_at(classes, s, end);
        if k != SPACE {
            break;
        }
        if s[end] == b'\r' || s[end] == b'\n' {
            after_newline = Some(end + 1);
        }
        last = end;
        end += len;
    }
    (end, last, after_newline)
}

/// `\s+(?!\S)|\s+` on the whitespace run [i, end) whose last char starts at `last`: the whole
/// run before the end of the text or when it is one char, else all but its last char (which
/// then goes with the word that follows).
fn trailing_space_end(s: &[u8], i: usize, end: usize, last: usize) -> usize {
    if end == s.len() || last == i {
        end
    } else {
        last
    }
}

/// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn gpt2_word_end(classes: &CharClasses, s: &[u8], i: usize) -> usize {
    if s[i] == b'\'' {
        if let Some(len) = contraction_len(s, i + 1, false) {
            return i + 1 + len;
        }
    }
    let (mut kind, _) = kind_at(classes, s, i);
    let mut start = i;
    if s[i] == b' ' && i + 1 < s.len() {
        let (next, _) = kind_at(classes, s, i + 1);
        if next != SPACE {
            (kind, start) = (next, i + 1);
        }
    }
    if kind != SPACE {
        return run_end(classes, s, start, kind);
    }
    let (end, last, _) = space_run(classes, s, i);
    trailing_space_end(s, i, end, last)
}

/// Llama 3 (and Qwen2 with `max_digits` 1): `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+
/// |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
fn llama3_word_end(classes: &CharClasses, s: &[u8], i: usize, max_digits: usize) -> usize {
    let b = s[i];
    if b == b'\'' {
        if let Some(len) = contraction_len(s, i + 1, true) {
            return i + 1 + len;
        }
    }
    let (kind, len) = kind_at(classes, s, i);
    match kind {
        LETTER => return run_end(classes, s, i, LETTER),
        NUMBER => {
            let mut end = i;
            for _ in 0..max_digits {
                if end == s.len() || kind_at(classes, s, end).0 != NUMBER {
                    break;
                }
                end += kind_at(classes, s, end).1;
            }
            return end;
        }
        _ => {}
    }
    // `[^\r\n\p{L}\p{N}]?\p{L}+`: one space or other char glued to the letters after it.
    if b != b'\r' && b != b'\n' && i + len < s.len() && kind_at(classes, s, i + len).0 == LETTER {
        return run_end(classes, s, i + len, LETTER);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let start = if b == b' ' && i + 1 < s.len() && kind_at(classes, s, i + 1).0 == OTHER {
        i + 1
    } else {
        i
    };
    if start > i || kind == OTHER {
        let mut end = run_end(classes, s, start, OTHER);
        while end < s.len() && (s[end] == b'\r' || s[end] == b'\n') {
            end += 1;
        }
        return end;
    }
    // `\s*[\r\n]+` ends after the run's last newline; then `\s+(?!\S)|\s+`.
    let (end, last, after_newline) = space_run(classes, s, i);
    after_newline.unwrap_or_else(|| trailing_space_end(s, i, end, last))
}

/// `Digits`: `char::is_numeric` chars (the test `tokenizers` uses), each alone or in runs, and
/// the runs of other chars between them.
fn digits_word_end(s: &[u8], i: usize, individual: bool) -> usize {
    let numeric_at = |j: usize| {
        let (c, len) = decode(s, j);
        (char::from_u32(c).is_some_and(char::is_numeric), len)
    };
    let (numeric, len) = numeric_at(i);
    if numeric && individual {
        return i + len;
    }
    let mut end = i + len;
    while end < s.len() {
        let (n, len) = numeric_at(end);
        if n != numeric {
            break;
        }
        end += len;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(splitter: Splitter, text: &str) -> Vec<&str> {
        let mut words = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = splitter.word_end(&CHAR_CLASSES, text.as_bytes(), start);
            words.push(&text[start..end]);
            start = end;
        }
        words
    }

    // Expected splits are those of `tokenizers`' `Split(pattern, "isolated")`.

    #[test]
    fn gpt2_splits_where_its_regex_matches() {
        assert_eq!(
            words(Splitter::Gpt2, "Hello world's  end 42 $x\n\n"),
            ["Hello", " world", "'s", " ", " end", " 42", " $", "x", "\n\n"]
        );
        assert_eq!(
            words(Splitter::Gpt2, "I'M ſ'S\t\tok  "),
            ["I", "'", "M", " ſ", "'", "S", "\t", "\t", "ok", "  "]
        );
    }

    #[test]
    fn llama3_splits_where_its_regex_matches() {
        let llama3 = Splitter::Llama3 { max_digits: 3 };
        assert_eq!(
            words(llama3, "I'M 12345 (abc.Hello\r\n  x  \n\ty"),
            [
                "I", "'M", " ", "123", "45", " (", "abc", ".Hello", "\r\n", " ", " x", "  \n",
                "\ty"
            ]
        );
        assert_eq!(
            words(llama3, "it'S 'ſt ));\n\nz"),
            ["it", "'S", " '", "ſt", " ));\n\n", "z"]
        );
    }

    #[test]
    fn digits_split_numeric_chars_alone_or_in_runs() {
        let text = "ab12٣ c";
        assert_eq!(
            words(Splitter::Digits { individual: true }, text),
            ["ab", "1", "2", "٣", " c"]
        );
        assert_eq!(
            words(Splitter::Digits { individual: false }, text),
            ["ab", "12٣", " c"]
        );
    }
}
