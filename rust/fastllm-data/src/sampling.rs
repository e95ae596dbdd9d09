//! The sampling index: which tokens of which documents make up each training sample.
//!
//! Documents are visited epoch after epoch, each epoch a fresh seeded shuffle of the non-empty
//! documents (forward Fisher–Yates with SplitMix64). The index is a pure function of its inputs,
//! identical on every platform, and asking for more samples only appends: sample `i` does not
//! depend on `num_samples`.

use crate::random::{mix, SplitMix64};
use crate::{Cancel, DataError};

/// How documents fill samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SamplingMode {
    /// Megatron style: the visited documents form one token stream that samples cut at a stride
    /// of `sequence_length`, so no token is wasted and a sample may span several documents. The
    /// last sample may stop in the middle of a document.
    #[default]
    Packed,
    /// One document per sample, cut to the sample length; a shorter one leaves padding.
    Truncated,
}

/// Everything a sampling index is built from, besides the document lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SamplingConfig {
    /// Tokens the model reads per sample. A sample holds one more, so that inputs and the labels
    /// shifted by one both come from it; in packed mode consecutive samples share that token.
    pub sequence_length: u32,
    pub num_samples: usize,
    pub seed: u64,
    pub mode: SamplingMode,
}

/// Tokens `offset..offset + length` of document `document`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    pub document: u32,
    pub offset: u32,
    pub length: u32,
}

/// For each sample, the pieces of documents that form it.
///
/// Stored compactly: the visiting order of documents plus, in packed mode, where each sample
/// starts in it. Pieces are derived on demand.
#[derive(Clone, PartialEq, Eq)]
pub struct SamplingIndex {
    pub(crate) config: SamplingConfig,
    pub(crate) document_lengths: Vec<u32>,
    /// Non-empty documents in visiting order, cut where the last sample ends.
    pub(crate) order: Vec<u32>,
    /// Packed mode: sample `i` starts at token `start_offsets[i]` of document
    /// `order[start_positions[i]]`. Empty in truncated mode, where sample `i` is `order[i]`.
    pub(crate) start_positions: Vec<u64>,
    pub(crate) start_offsets: Vec<u32>,
}

impl SamplingIndex {
    /// Builds the index for documents of the given lengths (any integer type, e.g. the `i32`
    /// lengths of an [`IndexedDataset`](crate::IndexedDataset)). Empty documents are skipped.
    pub fn build<T: Copy + Into<i64>>(
        document_lengths: &[T],
        config: SamplingConfig,
    ) -> Result<Self, DataError> {
        Self::build_from(
            checked_lengths(document_lengths)?,
            config,
            &Cancel::default(),
        )
    }

    pub(crate) fn build_from(
        document_lengths: Vec<u32>,
        config: SamplingConfig,
        cancel: &Cancel,
    ) -> Result<Self, DataError> {
        if config.sequence_length == 0 || config.sequence_length == u32::MAX {
            return Err(DataError::BadSequenceLength {
                sequence_length: config.sequence_length,
            });
        }
        let documents: Vec<u32> = (0..document_lengths.len() as u32)
            .filter(|&d| document_lengths[d as usize] > 0)
            .collect();
        let mut index = Self {
            config,
            document_lengths,
            order: Vec::new(),
            start_positions: Vec::new(),
            start_offsets: Vec::new(),
        };
        let num_samples = config.num_samples;
        if num_samples == 0 {
            return Ok(index);
        }
        if documents.is_empty() {
            return Err(DataError::NoTokens { num_samples });
        }
        let lengths = &index.document_lengths;
        match config.mode {
            SamplingMode::Packed => {
                // Sample i covers stream tokens i·L ..= i·L + L, so the last one ends at n·L + 1.
                let needed = num_samples as u128 * u128::from(config.sequence_length) + 1;
                let epoch_tokens: u128 = documents
                    .iter()
                    .map(|&d| u128::from(lengths[d as usize]))
                    .sum();
                let expected_visits = needed * documents.len() as u128 / epoch_tokens + 1;
                let mut covered = 0u128;
                let enough = |d: u32| {
                    covered += u128::from(lengths[d as usize]);
                    covered >= needed
                };
                index.order = visiting_order(
                    &documents,
                    config.seed,
                    expected_visits as usize,
                    enough,
                    cancel,
                )?;
                (index.start_positions, index.start_offsets) =
                    packed_starts(&index.order, &index.document_lengths, config, cancel)?;
            }
            SamplingMode::Truncated => {
                let mut visits = 0;
                let enough = |_| {
                    visits += 1;
                    visits == num_samples
                };
                index.order = visiting_order(&documents, config.seed, num_samples, enough, cancel)?;
            }
        }
        Ok(index)
    }

    /// Why reading a sample of this index would index out of bounds, if it would. A built index
    /// never does; a loaded one passed a checksum, which detects accidents, not a file written
    /// to pass it, so its content is checked before it is trusted.
    pub(crate) fn check_bounds(&self) -> Result<(), &'static str> {
        let lengths = &self.document_lengths;
        let length_of = |position: usize| {
            let document = *self.order.get(position)?;
            lengths.get(document as usize).copied()
        };
        if (0..self.order.len()).any(|position| length_of(position).is_none_or(|l| l == 0)) {
            return Err("it visits a document that is out of range or empty");
        }
        let samples = self.config.num_samples;
        if self.config.mode == SamplingMode::Truncated {
            return match self.order.len() >= samples && self.start_positions.is_empty() {
                true => Ok(()),
                false => Err("it has too few documents for its samples"),
            };
        }
        if samples == 0 {
            return Ok(());
        }
        if self.start_positions.len() != samples || self.start_offsets.len() != samples {
            return Err("it has too few sample starts");
        }
        // Starts in stream order, each inside its document; then every sample has its tokens
        // once the last one has.
        let mut previous = (0, 0);
        for start in self.start_positions.iter().zip(&self.start_offsets) {
            let (position, offset) = (*start.0, *start.1);
            let inside = usize::try_from(position)
                .ok()
                .and_then(length_of)
                .is_some_and(|length| offset < length);
            if !inside || (position, offset) < previous {
                return Err("a sample starts out of order or outside its document");
            }
            previous = (position, offset);
        }
        let (position, offset) = previous;
        let left: u64 = self.order[position as usize..]
            .iter()
            .map(|&document| u64::from(lengths[document as usize]))
            .sum();
        if left - u64::from(offset) < u64::from(self.sample_length()) {
            return Err("its documents end before its last sample");
        }
        Ok(())
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.config.num_samples
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Tokens per sample: `sequence_length + 1`.
    pub fn sample_length(&self) -> u32 {
        self.config.sequence_length + 1
    }

    /// The pieces of documents that form sample `sample`, in order. In packed mode their lengths
    /// add up to [`sample_length`](Self::sample_length); in truncated mode there is one piece,
    /// and the rest of the sample is padding.
    pub fn pieces(&self, sample: usize) -> Result<Pieces<'_>, DataError> {
        if sample >= self.len() {
            return Err(DataError::SampleOutOfRange {
                sample,
                samples: self.len(),
            });
        }
        let (position, offset, remaining) = match self.config.mode {
            SamplingMode::Packed => (
                self.start_positions[sample] as usize,
                self.start_offsets[sample],
                self.sample_length(),
            ),
            SamplingMode::Truncated => {
                let length = self.document_lengths[self.order[sample] as usize];
                (sample, 0, length.min(self.sample_length()))
            }
        };
        Ok(Pieces {
            order: &self.order,
            lengths: &self.document_lengths,
            position,
            offset,
            remaining,
        })
    }

    /// Where documents begin and end inside sample `sample`, for attention that must not cross
    /// documents: 0, then the cumulative lengths of its pieces. The last entry is the number of
    /// real (non-padding) tokens.
    pub fn document_boundaries(&self, sample: usize) -> Result<Vec<u32>, DataError> {
        let mut boundaries = vec![0];
        let mut end = 0;
        for piece in self.pieces(sample)? {
            end += piece.length;
            boundaries.push(end);
        }
        Ok(boundaries)
    }
}

/// Iterator over the pieces of one sample; see [`SamplingIndex::pieces`].
pub struct Pieces<'a> {
    order: &'a [u32],
    lengths: &'a [u32],
    position: usize,
    offset: u32,
    remaining: u32,
}

impl Iterator for Pieces<'_> {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.remaining == 0 {
            return None;
        }
        let document = self.order[self.position];
        let length = (self.lengths[document as usize] - self.offset).min(self.remaining);
        let piece = Piece {
            document,
            offset: self.offset,
            length,
        };
        self.remaining -= length;
        self.position += 1;
        self.offset = 0;
        Some(piece)
    }
}

pub(crate) fn checked_lengths<T: Copy + Into<i64>>(lengths: &[T]) -> Result<Vec<u32>, DataError> {
    if lengths.len() > u32::MAX as usize {
        return Err(DataError::TooManyDocuments {
            documents: lengths.len(),
        });
    }
    lengths
        .iter()
        .enumerate()
        .map(|(document, &length)| {
            let length = length.into();
            u32::try_from(length).map_err(|_| DataError::BadDocumentLength { document, length })
        })
        .collect()
}

/// `documents` epoch after epoch, each epoch shuffled with its own seed, until `enough` returns
/// true for the document just visited, or `cancel` stops it.
///
/// Forward Fisher–Yates fixes position `i` of an epoch at step `i`, so stopping early yields a
/// prefix of the full shuffle: more samples never change the earlier ones.
pub(crate) fn visiting_order(
    documents: &[u32],
    seed: u64,
    expected_visits: usize,
    mut enough: impl FnMut(u32) -> bool,
    cancel: &Cancel,
) -> Result<Vec<u32>, DataError> {
    let mut order = Vec::with_capacity(expected_visits);
    let mut permutation = Vec::with_capacity(documents.len());
    for epoch in 0u64.. {
        permutation.clear();
        permutation.extend_from_slice(documents);
        let mut rng = SplitMix64::new(mix(seed) ^ mix(epoch.wrapping_add(1)));
        for i in 0..permutation.len() {
            cancel.check_at(order.len())?;
            let j = i + rng.below((permutation.len() - i) as u64) as usize;
            permutation.swap(i, j);
            order.push(permutation[i]);
            if enough(permutation[i]) {
                return Ok(order);
            }
        }
    }
    unreachable!("the callers' conditions are met within finitely many epochs")
}

/// Where each packed sample starts: sample `i` starts at stream token `i × sequence_length`.
fn packed_starts(
    order: &[u32],
    lengths: &[u32],
    config: SamplingConfig,
    cancel: &Cancel,
) -> Result<(Vec<u64>, Vec<u32>), DataError> {
    let num_samples = config.num_samples;
    let mut positions = Vec::with_capacity(num_samples);
    let mut offsets = Vec::with_capacity(num_samples);
    let (mut position, mut offset) = (0usize, 0u32);
    for sample in 0..num_samples {
        cancel.check_at(sample)?;
        positions.push(position as u64);
        offsets.push(offset);
        if sample + 1 == num_samples {
            break;
        }
        let mut remaining = config.sequence_length;
        loop {
            let available = lengths[order[position] as usize] - offset;
            if remaining < available {
                offset += remaining;
                break;
            }
            // A sample never starts at the very end of a document: move on to the next one.
            remaining -= available;
            position += 1;
            offset = 0;
        }
    }
    Ok((positions, offsets))
}
