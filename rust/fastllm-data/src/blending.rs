//! Blending several datasets into one sample stream by weight.

use crate::{Cancel, DataError};

/// Which dataset, and which of its samples, each blended sample comes from.
///
/// Megatron's greedy rule, made exact at every prefix: sample `i` goes to the dataset furthest
/// behind its target after this sample, the one maximizing `weight[d] · (i + 1) − count[d]`
/// (ties to the lowest index). With `K` datasets and normalized weights, every count stays
/// within `−(1 − 1/K) ≤ weight[d] · n − count[d] ≤ (K − 1)² / K` after every `n` samples: the
/// chosen dataset's deficit is at least `1/K` before it drops by one, the others only rise, and
/// the deficits sum to zero. (Megatron itself uses `max(i, 1)` where we use `i + 1`.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlendingIndex {
    dataset_indices: Vec<u32>,
    sample_indices: Vec<u64>,
    samples_per_dataset: Vec<u64>,
}

impl BlendingIndex {
    /// Blends `num_samples` samples from datasets weighted by `weights`, which need not sum to
    /// one but must each be finite and positive.
    pub fn build(weights: &[f64], num_samples: usize) -> Result<Self, DataError> {
        Self::build_unless_cancelled(weights, num_samples, &Cancel::default())
    }

    /// [`BlendingIndex::build`] that `cancel` stops.
    pub(crate) fn build_unless_cancelled(
        weights: &[f64],
        num_samples: usize,
        cancel: &Cancel,
    ) -> Result<Self, DataError> {
        if weights.is_empty() {
            return Err(DataError::NoDatasets);
        }
        if let Some((dataset, &weight)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            return Err(DataError::BadWeight { dataset, weight });
        }
        // Scaling by the largest weight first keeps the sum from overflowing.
        let largest = weights.iter().copied().fold(0.0, f64::max);
        let total: f64 = weights.iter().map(|w| w / largest).sum();
        let weights: Vec<f64> = weights.iter().map(|w| w / largest / total).collect();

        let mut counts = vec![0u64; weights.len()];
        let mut dataset_indices = Vec::with_capacity(num_samples);
        let mut sample_indices = Vec::with_capacity(num_samples);
        for sample in 0..num_samples {
            cancel.check_at(sample)?;
            let target = (sample + 1) as f64;
            let mut chosen = 0;
            let mut largest_deficit = f64::NEG_INFINITY;
            for (dataset, (&weight, &count)) in weights.iter().zip(&counts).enumerate() {
                let deficit = weight * target - count as f64;
                if deficit > largest_deficit {
                    largest_deficit = deficit;
                    chosen = dataset;
                }
            }
            dataset_indices.push(chosen as u32);
            sample_indices.push(counts[chosen]);
            counts[chosen] += 1;
        }
        Ok(Self {
            dataset_indices,
            sample_indices,
            samples_per_dataset: counts,
        })
    }

    /// Number of blended samples.
    pub fn len(&self) -> usize {
        self.dataset_indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dataset_indices.is_empty()
    }

    /// For each blended sample, the dataset it comes from.
    pub fn dataset_indices(&self) -> &[u32] {
        &self.dataset_indices
    }

    /// For each blended sample, its index within its dataset: 0, 1, 2, … per dataset.
    pub fn sample_indices(&self) -> &[u64] {
        &self.sample_indices
    }

    /// How many samples each dataset supplies: the `num_samples` to sample it with.
    pub fn samples_per_dataset(&self) -> &[u64] {
        &self.samples_per_dataset
    }
}
