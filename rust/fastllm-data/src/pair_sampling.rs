//! Samples of whole preference pairs: a pair is never cut, so each sample holds whole pairs
//! (one in truncated mode; as many as fit, in visiting order, in packed mode) and padding.
//!
//! In a sample a pair takes one token more than it stores: its prompt's last token is repeated
//! at the start of the rejected answer (see [`SampleSource::fill`](crate::SampleSource::fill)).
//! Pairs that do not fit the sequence are never visited, and counted. Epochs are shuffled as
//! [`SamplingIndex`](crate::SamplingIndex)'s are, and more samples only append: sample `i` does
//! not depend on `num_samples`. The index is small and quick to build (a few milliseconds per
//! million pairs), so it is built each run rather than cached.

use crate::random::mix;
use crate::sampling::visiting_order;
use crate::{Cancel, DataError, SamplingConfig, SamplingMode};

/// For each sample, the pairs (documents) it holds, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairIndex {
    config: SamplingConfig,
    /// Pairs in visiting order.
    order: Vec<u32>,
    /// Sample `i` holds `order[starts[i]..starts[i + 1]]`.
    starts: Vec<usize>,
    /// Pairs left out for being longer than the sequence.
    skipped_pairs: u64,
}

impl PairIndex {
    /// Builds the index for pairs of `document_lengths` tokens as stored. Samples hold
    /// `config.sequence_length + 1` tokens, the last of them always padding: a pair's last
    /// token has no label, so a pair of `n` stored tokens fits when `n + 1 <= sequence_length`.
    pub fn build(
        document_lengths: &[u32],
        config: SamplingConfig,
        cancel: &Cancel,
    ) -> Result<Self, DataError> {
        let sequence = config.sequence_length;
        if sequence < 2 || sequence == u32::MAX {
            return Err(DataError::BadSequenceLength {
                sequence_length: sequence,
            });
        }
        let in_sample = |pair: u32| document_lengths[pair as usize] as u64 + 1;
        let fitting: Vec<u32> = (0..document_lengths.len() as u32)
            .filter(|&pair| in_sample(pair) <= u64::from(sequence))
            .collect();
        let skipped_pairs = (document_lengths.len() - fitting.len()) as u64;
        let num_samples = config.num_samples;
        let mut index = Self {
            config,
            order: Vec::new(),
            starts: vec![0],
            skipped_pairs,
        };
        if num_samples == 0 {
            return Ok(index);
        }
        if fitting.is_empty() {
            return Err(DataError::NoPairFits {
                pairs: document_lengths.len(),
                sequence_length: sequence,
                shortest: document_lengths.iter().min().copied().unwrap_or(0),
            });
        }
        let seed = mix(config.seed ^ 0x7061_6972); // apart from the token index of the same seed
        match config.mode {
            SamplingMode::Truncated => {
                let mut visits = 0;
                let enough = |_| {
                    visits += 1;
                    visits == num_samples
                };
                index.order = visiting_order(&fitting, seed, num_samples, enough, cancel)?;
                index.starts = (0..=num_samples).collect();
            }
            SamplingMode::Packed => {
                // Visits until a pair opens sample `num_samples`, which closes the last sample
                // as more samples would: that pair is then left out.
                let mut starts = Vec::with_capacity(num_samples + 1);
                let (mut visited, mut filled) = (0usize, u64::from(sequence));
                let enough = |pair: u32| {
                    let length = in_sample(pair);
                    if filled + length > u64::from(sequence) {
                        starts.push(visited);
                        filled = 0;
                    }
                    filled += length;
                    visited += 1;
                    starts.len() > num_samples
                };
                index.order = visiting_order(&fitting, seed, num_samples, enough, cancel)?;
                index.order.pop();
                index.starts = starts;
                index.starts[num_samples] = index.order.len();
            }
        }
        Ok(index)
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pairs left out for being longer than the sequence (a pair is never cut).
    pub fn skipped_pairs(&self) -> u64 {
        self.skipped_pairs
    }

    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// The pairs of sample `sample`, in order.
    pub fn sample(&self, sample: usize) -> Result<&[u32], DataError> {
        if sample >= self.len() {
            return Err(DataError::SampleOutOfRange {
                sample,
                samples: self.len(),
            });
        }
        Ok(&self.order[self.starts[sample]..self.starts[sample + 1]])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sequence_length: u32, num_samples: usize, mode: SamplingMode) -> SamplingConfig {
        SamplingConfig {
            sequence_length,
            num_samples,
            seed: 7,
            mode,
        }
    }

    fn build(lengths: &[u32], config: SamplingConfig) -> PairIndex {
        PairIndex::build(lengths, config, &Cancel::default()).unwrap()
    }

    #[test]
    fn packed_samples_hold_whole_pairs_greedily_in_visiting_order() {
        let lengths: Vec<u32> = (0..50).map(|k| 3 + (k * 7) % 13).collect();
        let index = build(&lengths, config(24, 40, SamplingMode::Packed));
        let mut visited = Vec::new();
        for sample in 0..index.len() {
            let pairs = index.sample(sample).unwrap();
            let used: u32 = pairs.iter().map(|&p| lengths[p as usize] + 1).sum();
            assert!(!pairs.is_empty() && used <= 24, "sample {sample}: {used}");
            visited.extend_from_slice(pairs);
            // Greedy: the next sample's first pair did not fit this one.
            if let Ok(next) = index.sample(sample + 1) {
                assert!(used + lengths[next[0] as usize] + 1 > 24);
            }
        }
        assert_eq!(visited, index.order);
        // Each epoch visits every pair once.
        let mut epoch = visited[..50].to_vec();
        epoch.sort_unstable();
        assert_eq!(epoch, (0..50).collect::<Vec<u32>>());
    }

    #[test]
    fn more_samples_only_append() {
        let lengths: Vec<u32> = (0..9).map(|k| 2 + k % 5).collect();
        for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
            let long = build(&lengths, config(16, 60, mode));
            for num_samples in [1, 2, 7, 59] {
                let short = build(&lengths, config(16, num_samples, mode));
                for sample in 0..num_samples {
                    assert_eq!(short.sample(sample).unwrap(), long.sample(sample).unwrap());
                }
            }
        }
    }

    #[test]
    fn pairs_longer_than_the_sequence_are_left_out_and_counted() {
        // In a sample each pair takes one token more than stored: 9 fits 10, 10 does not.
        let lengths = [5, 9, 10, 4, 30];
        for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
            let index = build(&lengths, config(10, 30, mode));
            assert_eq!(index.skipped_pairs(), 2);
            let mut visited = index.order.clone();
            visited.sort_unstable();
            visited.dedup();
            assert_eq!(visited, [0, 1, 3]);
        }
        let truncated = build(&lengths, config(10, 4, SamplingMode::Truncated));
        assert!((0..4).all(|s| truncated.sample(s).unwrap().len() == 1));
        let error = PairIndex::build(
            &[12, 20],
            config(10, 1, SamplingMode::Packed),
            &Cancel::default(),
        );
        assert!(matches!(
            error,
            Err(DataError::NoPairFits {
                pairs: 2,
                sequence_length: 10,
                shortest: 12
            })
        ));
    }
}
