//! Megatron's "MMIDIDX" indexed dataset, version 1: the format `megatron/core/datasets/
//! indexed_dataset.py` and Fast-LLM read and write, so datasets move freely between them and us.
//!
//! `PREFIX.bin` holds the tokens of every sequence back to back, little-endian. `PREFIX.idx` is:
//!
//! | bytes | field |
//! |---|---|
//! | 9 | magic `MMIDIDX\0\0` |
//! | u64 | version, 1 |
//! | u8 | token dtype code (see [`TokenDtype::code`]) |
//! | u64 | sequence count `S` |
//! | u64 | document index count `D` |
//! | i32 × S | sequence lengths in tokens |
//! | i64 × S | byte offset of each sequence in `.bin` |
//! | i64 × D | document indices: 0, then the sequence count at each document end |
//!
//! Megatron may group several sequences into one document; like Fast-LLM we serve sequences, and
//! call them documents. We write one sequence per document, so the indices are `0, 1, …, S`.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::atomic_file::write_atomically;
use crate::loss_spans::LossSpans;
use crate::preference_spans::PreferenceSpans;
use crate::token::{TokenDtype, TokenSlice};
use crate::DataError;

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const VERSION: u64 = 1;
const HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

fn idx_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".idx")
}

pub(crate) fn bin_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".bin")
}

/// Appends rather than replaces, as Megatron does, so dots in the prefix survive.
fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(prefix.as_os_str());
    name.push(suffix);
    name.into()
}

/// A read-only indexed dataset: `.bin` is memory-mapped and documents are served in place.
///
/// The files must not be modified while the dataset is open.
pub struct IndexedDataset {
    bin_path: PathBuf,
    bin: Mmap,
    idx: Mmap,
    dtype: TokenDtype,
    lengths: Vec<i32>,
    num_tokens: u64,
    loss_spans: Option<LossSpans>,
    preference_spans: Option<PreferenceSpans>,
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin`, checking that the index is well formed and agrees
    /// with the size of `.bin`; and `PREFIX.spans`, the loss-masking spans, and
    /// `PREFIX.preference`, the spans of preference pairs, when there are, checking them
    /// against the index.
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        let prefix = prefix.as_ref();
        let idx_path = idx_path(prefix);
        let idx = map(&idx_path)?;
        let header = Header::parse(&idx, &idx_path)?;
        let lengths = header.check_arrays(&idx, &idx_path)?;
        let num_tokens = lengths.iter().map(|&l| l as u64).sum::<u64>();

        let bin_path = bin_path(prefix);
        let bin = map(&bin_path)?;
        let expected = u128::from(num_tokens) * header.dtype.size() as u128;
        if expected != bin.len() as u128 {
            return Err(DataError::SizeMismatch {
                path: bin_path,
                expected,
                actual: bin.len() as u64,
            });
        }
        let loss_spans = LossSpans::open(prefix, &lengths)?;
        let preference_spans = PreferenceSpans::open(prefix, &lengths)?;
        Ok(Self {
            bin_path,
            bin,
            idx,
            dtype: header.dtype,
            lengths,
            num_tokens,
            loss_spans,
            preference_spans,
        })
    }

    /// The tokens of each document that are not trained on, when the dataset has a sidecar.
    pub fn loss_spans(&self) -> Option<&LossSpans> {
        self.loss_spans.as_ref()
    }

    /// Where the answers of each preference pair lie, when the dataset holds pairs.
    pub fn preference_spans(&self) -> Option<&PreferenceSpans> {
        self.preference_spans.as_ref()
    }

    /// `PREFIX.bin`.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// Number of documents (Megatron's sequences).
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Every token of the dataset, borrowed from the mapped file.
    pub fn all_tokens(&self) -> TokenSlice<'_> {
        if self.bin.is_empty() {
            // The mapping of an empty file need not be aligned.
            return TokenSlice::empty(self.dtype);
        }
        TokenSlice::from_bytes(self.dtype, &self.bin)
    }

    /// Tokens per document; every entry is non-negative.
    pub fn document_lengths(&self) -> &[i32] {
        &self.lengths
    }

    /// All tokens of document `document`, borrowed from the mapped file.
    pub fn document(&self, document: usize) -> Result<TokenSlice<'_>, DataError> {
        let length = self.document_length(document)?;
        self.tokens(document, 0, length)
    }

    /// Tokens `offset..offset + length` of document `document`, borrowed from the mapped file.
    pub fn tokens(
        &self,
        document: usize,
        offset: usize,
        length: usize,
    ) -> Result<TokenSlice<'_>, DataError> {
        let document_length = self.document_length(document)?;
        if offset
            .checked_add(length)
            .is_none_or(|end| end > document_length)
        {
            return Err(DataError::TokensOutOfRange {
                path: self.bin_path.clone(),
                document,
                offset,
                length,
                document_length,
            });
        }
        let size = self.dtype.size();
        let start = self.pointer(document) + offset * size;
        Ok(TokenSlice::from_bytes(
            self.dtype,
            &self.bin[start..start + length * size],
        ))
    }

    fn document_length(&self, document: usize) -> Result<usize, DataError> {
        match self.lengths.get(document) {
            Some(&length) => Ok(length as usize),
            None => Err(DataError::DocumentOutOfRange {
                path: self.bin_path.clone(),
                document,
                documents: self.len(),
            }),
        }
    }

    /// Byte offset of `document` in `.bin`, read from the index (validated at open).
    fn pointer(&self, document: usize) -> usize {
        let at = HEADER_LEN + 4 * self.len() + 8 * document;
        read_i64(&self.idx, at) as usize
    }
}

fn map(path: &Path) -> Result<Mmap, DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    // SAFETY: the mapping is read-only; as documented on `IndexedDataset`, the files must not be
    // modified while open, the usual condition for memory-mapped files.
    unsafe { Mmap::map(&file) }.map_err(DataError::io(path))
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn read_i64(bytes: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

struct Header {
    dtype: TokenDtype,
    sequence_count: u64,
    document_index_count: u64,
}

impl Header {
    fn parse(idx: &[u8], path: &Path) -> Result<Self, DataError> {
        if idx.get(..MAGIC.len()) != Some(MAGIC) {
            return Err(DataError::BadMagic {
                path: path.to_owned(),
            });
        }
        if idx.len() < HEADER_LEN {
            return Err(DataError::SizeMismatch {
                path: path.to_owned(),
                expected: HEADER_LEN as u128,
                actual: idx.len() as u64,
            });
        }
        let version = read_u64(idx, 9);
        if version != VERSION {
            return Err(DataError::UnsupportedVersion {
                path: path.to_owned(),
                version,
            });
        }
        let code = idx[17];
        let dtype = TokenDtype::from_code(code).ok_or_else(|| DataError::UnsupportedDtype {
            path: path.to_owned(),
            code,
        })?;
        let header = Self {
            dtype,
            sequence_count: read_u64(idx, 18),
            document_index_count: read_u64(idx, 26),
        };
        let expected = HEADER_LEN as u128
            + 12 * u128::from(header.sequence_count)
            + 8 * u128::from(header.document_index_count);
        if expected != idx.len() as u128 {
            return Err(DataError::SizeMismatch {
                path: path.to_owned(),
                expected,
                actual: idx.len() as u64,
            });
        }
        Ok(header)
    }

    /// Checks the three arrays after the header and returns the sequence lengths.
    fn check_arrays(&self, idx: &[u8], path: &Path) -> Result<Vec<i32>, DataError> {
        // The size check in `parse` bounds `sequences` by the file length, so it fits in usize.
        let sequences = self.sequence_count as usize;
        let lengths_at = HEADER_LEN;
        let pointers_at = lengths_at + 4 * sequences;
        let indices_at = pointers_at + 8 * sequences;

        let mut lengths = Vec::with_capacity(sequences);
        let mut expected_pointer = 0u64;
        for sequence in 0..sequences {
            let at = lengths_at + 4 * sequence;
            let length = i32::from_le_bytes(idx[at..at + 4].try_into().expect("4 bytes"));
            if length < 0 {
                return Err(DataError::NegativeLength {
                    path: path.to_owned(),
                    sequence,
                    length,
                });
            }
            let pointer = read_i64(idx, pointers_at + 8 * sequence);
            if u64::try_from(pointer) != Ok(expected_pointer) {
                return Err(DataError::BadPointer {
                    path: path.to_owned(),
                    sequence,
                    expected: expected_pointer,
                    actual: pointer,
                });
            }
            expected_pointer += length as u64 * self.dtype.size() as u64;
            lengths.push(length);
        }

        let indices =
            (0..self.document_index_count as usize).map(|i| read_i64(idx, indices_at + 8 * i));
        if !document_indices_are_valid(indices, self.sequence_count) {
            return Err(DataError::BadDocumentIndices {
                path: path.to_owned(),
                sequences: self.sequence_count,
            });
        }
        Ok(lengths)
    }
}

fn document_indices_are_valid(mut indices: impl Iterator<Item = i64>, sequences: u64) -> bool {
    if indices.next() != Some(0) {
        return false;
    }
    let mut previous = 0;
    for index in indices {
        if index < previous {
            return false;
        }
        previous = index;
    }
    u64::try_from(previous) == Ok(sequences)
}

/// Writes an indexed dataset one document at a time.
///
/// Tokens stream to `PREFIX.bin`; [`finish`](Self::finish) writes `PREFIX.idx`. A stale
/// `PREFIX.idx` is removed up front, so an interrupted write never passes for a dataset.
pub struct IndexedDatasetWriter {
    bin: BufWriter<File>,
    bin_path: PathBuf,
    idx_path: PathBuf,
    dtype: TokenDtype,
    lengths: Vec<i32>,
    encoded: Vec<u8>,
}

impl IndexedDatasetWriter {
    pub fn create(prefix: impl AsRef<Path>, dtype: TokenDtype) -> Result<Self, DataError> {
        let prefix = prefix.as_ref();
        let idx_path = idx_path(prefix);
        match fs::remove_file(&idx_path) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                return Err(DataError::Io {
                    path: idx_path,
                    source: error,
                })
            }
            _ => {}
        }
        let bin_path = bin_path(prefix);
        let bin = File::create(&bin_path).map_err(DataError::io(&bin_path))?;
        Ok(Self {
            bin: BufWriter::with_capacity(1 << 20, bin),
            bin_path,
            idx_path,
            dtype,
            lengths: Vec::new(),
            encoded: Vec::new(),
        })
    }

    /// Appends one document. A token that does not fit the dtype is an error, and then nothing
    /// of this document is written.
    pub fn add_document<T: Copy + Into<i64>>(&mut self, tokens: &[T]) -> Result<(), DataError> {
        let length = i32::try_from(tokens.len()).map_err(|_| DataError::DocumentTooLong {
            path: self.bin_path.clone(),
            length: tokens.len(),
        })?;
        self.encoded.clear();
        if let Err(value) = encode_tokens(self.dtype, tokens, &mut self.encoded) {
            return Err(DataError::TokenOutOfRange {
                path: self.bin_path.clone(),
                value,
                dtype: self.dtype,
            });
        }
        self.bin
            .write_all(&self.encoded)
            .map_err(DataError::io(&self.bin_path))?;
        self.lengths.push(length);
        Ok(())
    }

    /// Appends documents already encoded by [`encode_tokens`]: `tokens` holds them back to back,
    /// `lengths` counts the tokens of each.
    pub(crate) fn add_encoded(&mut self, tokens: &[u8], lengths: &[i32]) -> Result<(), DataError> {
        self.bin
            .write_all(tokens)
            .map_err(DataError::io(&self.bin_path))?;
        self.lengths.extend_from_slice(lengths);
        Ok(())
    }

    /// Flushes and fsyncs `.bin`, then writes `.idx` atomically.
    pub fn finish(self) -> Result<(), DataError> {
        let bin = self.bin.into_inner().map_err(|error| DataError::Io {
            path: self.bin_path.clone(),
            source: error.into_error(),
        })?;
        bin.sync_all().map_err(DataError::io(&self.bin_path))?;

        let (lengths, dtype) = (&self.lengths, self.dtype);
        write_atomically(&self.idx_path, |w| {
            w.write_all(MAGIC)?;
            w.write_all(&VERSION.to_le_bytes())?;
            w.write_all(&[dtype.code()])?;
            w.write_all(&(lengths.len() as u64).to_le_bytes())?;
            w.write_all(&(lengths.len() as u64 + 1).to_le_bytes())?;
            for length in lengths {
                w.write_all(&length.to_le_bytes())?;
            }
            let mut pointer = 0i64;
            for &length in lengths {
                w.write_all(&pointer.to_le_bytes())?;
                pointer += i64::from(length) * dtype.size() as i64;
            }
            for index in 0..=lengths.len() as i64 {
                w.write_all(&index.to_le_bytes())?;
            }
            Ok(())
        })
    }
}

/// Appends the little-endian bytes of every token in `dtype` to `out`, as `.bin` stores them, or
/// returns the first token that does not fit and leaves `out` as it was.
pub(crate) fn encode_tokens<T: Copy + Into<i64>>(
    dtype: TokenDtype,
    tokens: &[T],
    out: &mut Vec<u8>,
) -> Result<(), i64> {
    let range = dtype.range();
    let fits = |token: &T| range.contains(&(*token).into());
    // Check, then copy: two loops without early exits beat one that checks as it copies.
    if !tokens.iter().fold(true, |all, token| all & fits(token)) {
        let token = tokens.iter().find(|token| !fits(token));
        return Err((*token.expect("a token does not fit")).into());
    }
    match dtype {
        TokenDtype::U8 => extend(tokens, out, |v| (v as u8).to_le_bytes()),
        TokenDtype::I8 => extend(tokens, out, |v| (v as i8).to_le_bytes()),
        TokenDtype::I16 => extend(tokens, out, |v| (v as i16).to_le_bytes()),
        TokenDtype::U16 => extend(tokens, out, |v| (v as u16).to_le_bytes()),
        TokenDtype::I32 => extend(tokens, out, |v| (v as i32).to_le_bytes()),
        TokenDtype::I64 => extend(tokens, out, i64::to_le_bytes),
    }
    Ok(())
}

fn extend<T: Copy + Into<i64>, const N: usize>(
    tokens: &[T],
    out: &mut Vec<u8>,
    to_bytes: impl Fn(i64) -> [u8; N],
) {
    out.reserve(N * tokens.len());
    out.extend(tokens.iter().flat_map(|&token| to_bytes(token.into())));
}
