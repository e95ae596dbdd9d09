//! Loss-masking spans: the tokens of each document that are not trained on, in a sidecar
//! `PREFIX.spans` beside the Megatron `PREFIX.bin`/`PREFIX.idx` pair, which stays exactly what
//! any Megatron reader opens.
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `FLLMSPAN` |
//! | u64 | version, 1 |
//! | u64 | document count `D` (the index's) |
//! | u64 | token count (the index's) |
//! | u64 | span count `S` |
//! | u64 × (D + 1) | 0, then the number of spans up to each document's end |
//! | (u32, u32) × S | `begin, end`: tokens `begin..end` of the document, masked |
//!
//! A document's spans are sorted, disjoint, non-empty and inside it; all little-endian.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::atomic_file::write_atomically;
use crate::sidecar::{check_size, header_len, read_sidecar};
use crate::DataError;

const MAGIC: &[u8; 8] = b"FLLMSPAN";
const VERSION: u64 = 1;
const HEADER_LEN: usize = header_len(1);

/// `PREFIX.spans`.
pub(crate) fn spans_path(prefix: &Path) -> PathBuf {
    let mut name = OsString::from(prefix.as_os_str());
    name.push(".spans");
    name.into()
}

/// The masked token spans of every document of one indexed dataset.
#[derive(Clone, Debug)]
pub struct LossSpans {
    offsets: Vec<u64>,
    spans: Vec<[u32; 2]>,
}

impl LossSpans {
    /// Reads `PREFIX.spans` if there is one, checking it against the dataset's documents.
    pub fn open(prefix: &Path, document_lengths: &[i32]) -> Result<Option<Self>, DataError> {
        let path = spans_path(prefix);
        let bad = |reason: String| DataError::BadLossSpans {
            path: path.clone(),
            reason,
        };
        let Some(file) =
            read_sidecar(&path, MAGIC, VERSION, 1, "loss-span", document_lengths, bad)?
        else {
            return Ok(None);
        };
        let (documents, count) = (document_lengths.len() as u64, file.fields[0]);
        let expected = HEADER_LEN as u128 + 8 * (u128::from(documents) + 1) + 8 * u128::from(count);
        check_size(&file, expected, bad)?;
        let bytes = file.body();
        let offsets_end = 8 * (documents as usize + 1);
        let offsets: Vec<u64> = bytes[..offsets_end]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let spans: Vec<[u32; 2]> = bytes[offsets_end..]
            .chunks_exact(8)
            .map(|b| {
                let word = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
                [word(0), word(1)]
            })
            .collect();
        if offsets[0] != 0
            || offsets.windows(2).any(|w| w[0] > w[1])
            || offsets[documents as usize] != count
        {
            return Err(bad(
                "span offsets must start at 0, never decrease and end at the span count".into(),
            ));
        }
        let loss_spans = Self { offsets, spans };
        for (document, &length) in document_lengths.iter().enumerate() {
            let mut previous_end = 0;
            for &[begin, end] in loss_spans.document(document) {
                if begin < previous_end || begin >= end || end as i64 > i64::from(length) {
                    return Err(bad(format!(
                        "document {document}: span {begin}..{end} is empty, unsorted, \
                         overlapping or outside its {length} tokens"
                    )));
                }
                previous_end = end;
            }
        }
        Ok(Some(loss_spans))
    }

    /// The masked spans of `document`, in order.
    pub fn document(&self, document: usize) -> &[[u32; 2]] {
        let (start, end) = (self.offsets[document], self.offsets[document + 1]);
        &self.spans[start as usize..end as usize]
    }

    /// Tokens of `document` trained on: its length less its masked tokens.
    pub fn trained_tokens(&self, document: usize, length: u32) -> u32 {
        length
            - self
                .document(document)
                .iter()
                .map(|[b, e]| e - b)
                .sum::<u32>()
    }
}

/// Collects the spans of a shard's documents as they are written; [`finish`](Self::finish)
/// writes `PREFIX.spans` atomically.
pub(crate) struct LossSpansWriter {
    path: PathBuf,
    offsets: Vec<u64>,
    spans: Vec<[u32; 2]>,
    tokens: u64,
}

impl LossSpansWriter {
    pub fn new(prefix: &Path) -> Self {
        Self {
            path: spans_path(prefix),
            offsets: vec![0],
            spans: Vec::new(),
            tokens: 0,
        }
    }

    /// Adds documents: `lengths` tokens each, `counts` spans each, taken in order from `spans`.
    pub fn add(&mut self, lengths: &[i32], counts: &[u32], spans: &[[u32; 2]]) {
        self.spans.extend_from_slice(spans);
        let mut total = *self.offsets.last().expect("starts with 0");
        for (&length, &count) in lengths.iter().zip(counts) {
            total += u64::from(count);
            self.offsets.push(total);
            self.tokens += length as u64;
        }
    }

    pub fn finish(self) -> Result<(), DataError> {
        let documents = self.offsets.len() as u64 - 1;
        write_atomically(&self.path, |w| {
            w.write_all(MAGIC)?;
            for field in [VERSION, documents, self.tokens, self.spans.len() as u64] {
                w.write_all(&field.to_le_bytes())?;
            }
            let mut block = Vec::with_capacity(8 * (self.offsets.len() + self.spans.len()));
            for offset in &self.offsets {
                block.extend_from_slice(&offset.to_le_bytes());
            }
            for [begin, end] in &self.spans {
                block.extend_from_slice(&begin.to_le_bytes());
                block.extend_from_slice(&end.to_le_bytes());
            }
            w.write_all(&block)
        })
    }
}
