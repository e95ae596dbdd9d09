//! Preference spans: where the chosen and the rejected answer of each preference pair lie in
//! its document, in a sidecar `PREFIX.preference` beside the Megatron `PREFIX.bin`/`PREFIX.idx`
//! pair, which stays exactly what any Megatron reader opens.
//!
//! A pair is one document: the prompt once, then the chosen answer, then the rejected one.
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `FLLMPREF` |
//! | u64 | version, 1 |
//! | u64 | document count `D` (the index's) |
//! | u64 | token count (the index's) |
//! | (u32, u32, u32, u32) × D | `chosen_begin, chosen_end, rejected_begin, rejected_end` |
//!
//! Spans are token offsets in the document, ends excluded (Fast-LLM's `chosen_spans` and
//! `rejected_spans`): `0 < chosen_begin < chosen_end == rejected_begin < rejected_end ==`
//! the document's length, so the prompt is tokens `0..chosen_begin`. All little-endian.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::atomic_file::write_atomically;
use crate::sidecar::{check_size, header_len, read_sidecar};
use crate::DataError;

const MAGIC: &[u8; 8] = b"FLLMPREF";
const VERSION: u64 = 1;
const HEADER_LEN: usize = header_len(0);

/// `PREFIX.preference`.
pub(crate) fn preference_path(prefix: &Path) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(".preference");
    name.into()
}

/// Where the prompt, the chosen and the rejected answer of one pair lie in its document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairSpans {
    /// Tokens `chosen[0]..chosen[1]`.
    pub chosen: [u32; 2],
    /// Tokens `rejected[0]..rejected[1]`.
    pub rejected: [u32; 2],
}

impl PairSpans {
    /// The spans of a pair of `prompt`, `chosen` and `rejected` tokens, in that order.
    pub fn of_lengths(prompt: u32, chosen: u32, rejected: u32) -> Self {
        Self {
            chosen: [prompt, prompt + chosen],
            rejected: [prompt + chosen, prompt + chosen + rejected],
        }
    }

    /// Tokens of the prompt: `0..prompt_length()`.
    pub fn prompt_length(&self) -> u32 {
        self.chosen[0]
    }

    pub fn chosen_length(&self) -> u32 {
        self.chosen[1] - self.chosen[0]
    }

    pub fn rejected_length(&self) -> u32 {
        self.rejected[1] - self.rejected[0]
    }

    /// Whether these are the spans of a pair of `length` tokens laid out as stored.
    fn fits(&self, length: i32) -> bool {
        let [chosen_begin, chosen_end] = self.chosen;
        let [rejected_begin, rejected_end] = self.rejected;
        0 < chosen_begin
            && chosen_begin < chosen_end
            && chosen_end == rejected_begin
            && rejected_begin < rejected_end
            && i64::from(rejected_end) == i64::from(length)
    }
}

/// The chosen and rejected spans of every document of one indexed dataset of pairs.
#[derive(Clone, Debug)]
pub struct PreferenceSpans {
    pairs: Vec<PairSpans>,
}

impl PreferenceSpans {
    /// Reads `PREFIX.preference` if there is one, checking it against the dataset's documents.
    pub fn open(prefix: &Path, document_lengths: &[i32]) -> Result<Option<Self>, DataError> {
        let path = preference_path(prefix);
        let bad = |reason: String| DataError::BadPreferenceSpans {
            path: path.clone(),
            reason,
        };
        let what = "preference-span";
        let Some(file) = read_sidecar(&path, MAGIC, VERSION, 0, what, document_lengths, bad)?
        else {
            return Ok(None);
        };
        let documents = document_lengths.len() as u64;
        check_size(&file, HEADER_LEN as u128 + 16 * u128::from(documents), bad)?;
        let pairs: Vec<PairSpans> = file
            .body()
            .chunks_exact(16)
            .map(|b| {
                let word = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
                PairSpans {
                    chosen: [word(0), word(1)],
                    rejected: [word(2), word(3)],
                }
            })
            .collect();
        for (document, (pair, &length)) in pairs.iter().zip(document_lengths).enumerate() {
            if !pair.fits(length) {
                return Err(bad(format!(
                    "document {document} of {length} tokens: chosen {:?} and rejected {:?} are \
                     not a non-empty prompt, then the chosen answer, then the rejected one",
                    pair.chosen, pair.rejected
                )));
            }
        }
        Ok(Some(Self { pairs }))
    }

    /// The spans of pair `document`.
    pub fn pair(&self, document: usize) -> PairSpans {
        self.pairs[document]
    }
}

/// Collects the spans of a shard's pairs as they are written; [`finish`](Self::finish) writes
/// `PREFIX.preference` atomically.
pub(crate) struct PreferenceSpansWriter {
    path: PathBuf,
    pairs: Vec<PairSpans>,
    tokens: u64,
}

impl PreferenceSpansWriter {
    pub fn new(prefix: &Path) -> Self {
        Self {
            path: preference_path(prefix),
            pairs: Vec::new(),
            tokens: 0,
        }
    }

    /// Adds pairs of `lengths` tokens each, with their spans.
    pub fn add(&mut self, lengths: &[i32], pairs: &[PairSpans]) {
        self.pairs.extend_from_slice(pairs);
        self.tokens += lengths.iter().map(|&l| l as u64).sum::<u64>();
    }

    pub fn finish(self) -> Result<(), DataError> {
        write_atomically(&self.path, |w| {
            w.write_all(MAGIC)?;
            for field in [VERSION, self.pairs.len() as u64, self.tokens] {
                w.write_all(&field.to_le_bytes())?;
            }
            let mut block = Vec::with_capacity(16 * self.pairs.len());
            for pair in &self.pairs {
                for word in pair.chosen.iter().chain(&pair.rejected) {
                    block.extend_from_slice(&word.to_le_bytes());
                }
            }
            w.write_all(&block)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_round_trip_and_a_bad_layout_is_refused_naming_the_document() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("shard");
        let pairs = [
            PairSpans::of_lengths(3, 2, 4),
            PairSpans::of_lengths(1, 1, 1),
        ];
        let mut writer = PreferenceSpansWriter::new(&prefix);
        writer.add(&[9, 3], &pairs);
        writer.finish().unwrap();
        let read = PreferenceSpans::open(&prefix, &[9, 3]).unwrap().unwrap();
        assert_eq!([read.pair(0), read.pair(1)], pairs);
        assert_eq!(pairs[0].chosen, [3, 5]);
        assert_eq!(pairs[0].rejected, [5, 9]);

        let error = PreferenceSpans::open(&prefix, &[9, 4])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("but the index has 2 documents of 13 tokens"),
            "{error}"
        );

        let mut writer = PreferenceSpansWriter::new(&prefix);
        writer.add(&[9, 3], &[pairs[0], PairSpans::of_lengths(0, 1, 2)]);
        writer.finish().unwrap();
        let error = PreferenceSpans::open(&prefix, &[9, 3])
            .unwrap_err()
            .to_string();
        assert!(error.contains("document 1 of 3 tokens"), "{error}");
        assert!(PreferenceSpans::open(&dir.path().join("none"), &[1])
            .unwrap()
            .is_none());
    }
}
