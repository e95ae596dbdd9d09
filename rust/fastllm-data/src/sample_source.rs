//! Training batches from one or more datasets: sampling, blending and FIM put together.
//!
//! The stream of samples is a pure function of the datasets and the configuration. Blended
//! sample `i` is sample `j` of dataset `d`, as the [`BlendingIndex`] says (with one dataset,
//! `d = 0` and `j = i`); sample `j` of a dataset is the pieces its [`SamplingIndex`] lists; FIM
//! then transforms it with randomness drawn from `(seed, i)`. Any sample can thus be computed
//! alone, on any thread, in any batch: resuming after `n` consumed samples is simply filling
//! from sample `n`.
//!
//! Datasets with loss-masking spans mask those tokens, and their samples without a single
//! trained label (every target masked) are skipped: sample `j` of such a dataset is the `j`-th
//! sample of its index that has one, the index being drawn long enough to hold them all.
//!
//! Datasets of preference pairs are sampled by a [`PairIndex`], whole pairs to a sample, and
//! filled with the parts of each pair (see [`SampleSource::fill`]); a blend is of pairs only
//! or of none.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::thread;

use std::path::Path;

use crate::fim::{Fim, FimSplit};
use crate::{
    BlendingIndex, Cancel, DataError, IndexedDataset, LossSpans, PairIndex, SamplingConfig,
    SamplingIndex, SamplingMode,
};

/// The part of a preference pair each token of a sample belongs to.
pub mod part {
    pub const PROMPT: i8 = 0;
    pub const CHOSEN: i8 = 1;
    pub const REJECTED: i8 = 2;
    pub const PADDING: i8 = -1;
}

/// How a dataset's samples are drawn: pieces of its token stream, or whole pairs.
enum DatasetIndex {
    Tokens(SamplingIndex),
    Pairs(PairIndex),
}

/// A dataset whose index holds fewer samples with a trained label than one in this many is
/// refused rather than drawn ever longer.
const MAX_UNTRAINED_RATIO: usize = 64;

/// Below this many tokens per thread, copying is cheaper than starting a thread.
const MIN_TOKENS_PER_THREAD: usize = 1 << 17;

/// How a [`SampleSource`] draws its samples.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleSourceConfig {
    /// Tokens the model reads per sample; samples hold one more (see [`SamplingConfig`]).
    pub sequence_length: u32,
    /// Samples in the blended stream.
    pub num_samples: usize,
    /// Seeds every dataset's sampling index and the FIM transforms.
    pub seed: u64,
    pub mode: SamplingMode,
    /// One blending weight per dataset; `None` weighs each dataset by its token count. Ignored
    /// for a single dataset.
    pub weights: Option<Vec<f64>>,
    /// Where sampling indices are cached (see [`SamplingIndex::load_or_build`]).
    pub cache_dir: PathBuf,
    /// Most threads one [`SampleSource::fill`] uses; 0 for one per available core.
    pub threads: usize,
    /// The model's vocabulary: every token copied into a batch is checked to lie in
    /// `0..vocab_size`, so that a bad id is an error naming its document, never an
    /// out-of-range embedding lookup. `None` checks nothing.
    pub vocab_size: Option<u64>,
}

/// Samples of one or more datasets, written into caller-provided batch buffers.
pub struct SampleSource {
    datasets: Vec<IndexedDataset>,
    indices: Vec<DatasetIndex>,
    /// For datasets with loss-masking spans: the samples of the index that have a trained
    /// label, which are the dataset's samples.
    trained_samples: Vec<Option<Vec<usize>>>,
    /// Samples of the indices skipped for having no trained label.
    skipped_samples: u64,
    /// The datasets hold preference pairs.
    preference: bool,
    /// Pairs left out for being longer than the sequence.
    skipped_pairs: u64,
    /// `None` for a single dataset, whose samples are the stream's.
    blending: Option<BlendingIndex>,
    fim: Option<Fim>,
    seed: u64,
    num_samples: usize,
    sample_length: usize,
    padding_token: i64,
    threads: usize,
    vocab_size: Option<u64>,
}

impl SampleSource {
    /// Blends `datasets` (building or reusing their sampling indices in `config.cache_dir`) and
    /// applies `fim`, if any, to every sample; `cancel` stops the building of the indices.
    pub fn new(
        datasets: Vec<IndexedDataset>,
        config: SampleSourceConfig,
        fim: Option<Fim>,
        cancel: &Cancel,
    ) -> Result<Self, DataError> {
        if datasets.is_empty() {
            return Err(DataError::NoDatasets);
        }
        if let Some(weights) = &config.weights {
            if weights.len() != datasets.len() {
                return Err(DataError::WeightCountMismatch {
                    weights: weights.len(),
                    datasets: datasets.len(),
                });
            }
        }
        let blending = if datasets.len() > 1 {
            let weights = config
                .weights
                .clone()
                .unwrap_or_else(|| datasets.iter().map(|d| d.num_tokens() as f64).collect());
            Some(BlendingIndex::build_unless_cancelled(
                &weights,
                config.num_samples,
                cancel,
            )?)
        } else {
            None
        };
        let samples_per_dataset = match &blending {
            Some(blending) => blending
                .samples_per_dataset()
                .iter()
                .map(|&n| n as usize)
                .collect(),
            None => vec![config.num_samples],
        };
        if fim.is_some() {
            if let Some(dataset) = datasets.iter().find(|d| d.loss_spans().is_some()) {
                return Err(DataError::FimWithLossSpans {
                    path: dataset.bin_path().to_owned(),
                });
            }
        }
        let has_pairs = |d: &&IndexedDataset| d.preference_spans().is_some();
        let preference = match (
            datasets.iter().find(has_pairs),
            datasets.iter().find(|d| !has_pairs(d)),
        ) {
            (Some(pairs), Some(other)) => {
                return Err(DataError::MixedPreference {
                    pairs: pairs.bin_path().to_owned(),
                    other: other.bin_path().to_owned(),
                })
            }
            (Some(pairs), None) if fim.is_some() => {
                return Err(DataError::FimWithPreference {
                    path: pairs.bin_path().to_owned(),
                })
            }
            (pairs, _) => pairs.is_some(),
        };
        let mut skipped_pairs = 0;
        let mut indices = Vec::with_capacity(datasets.len());
        let mut trained_samples = Vec::with_capacity(datasets.len());
        let mut skipped_samples = 0;
        for (dataset, num_samples) in datasets.iter().zip(samples_per_dataset) {
            let sampling = SamplingConfig {
                sequence_length: config.sequence_length,
                num_samples,
                seed: config.seed,
                mode: config.mode,
            };
            let (index, trained) = match dataset.loss_spans() {
                _ if preference => {
                    let lengths = crate::sampling::checked_lengths(dataset.document_lengths())?;
                    let pairs = PairIndex::build(&lengths, sampling, cancel)?;
                    skipped_pairs += pairs.skipped_pairs();
                    (DatasetIndex::Pairs(pairs), None)
                }
                None => (
                    DatasetIndex::Tokens(index(&config.cache_dir, dataset, sampling, cancel)?),
                    None,
                ),
                Some(spans) => {
                    let (index, trained, skipped) =
                        trained_index(&config.cache_dir, dataset, spans, sampling, cancel)?;
                    skipped_samples += skipped;
                    (DatasetIndex::Tokens(index), Some(trained))
                }
            };
            indices.push(index);
            trained_samples.push(trained);
        }
        let threads = match config.threads {
            0 => thread::available_parallelism().map_or(1, NonZeroUsize::get),
            threads => threads,
        };
        Ok(Self {
            datasets,
            indices,
            trained_samples,
            skipped_samples,
            preference,
            skipped_pairs,
            blending,
            padding_token: fim.as_ref().map_or(0, |fim| fim.config().pad.into()),
            fim,
            seed: config.seed,
            num_samples: config.num_samples,
            sample_length: config.sequence_length as usize + 1,
            threads,
            vocab_size: config.vocab_size,
        })
    }

    /// Tokens per sample: `sequence_length + 1`.
    pub fn sample_length(&self) -> usize {
        self.sample_length
    }

    /// Samples of the datasets' indices skipped for having no trained label.
    pub fn skipped_samples(&self) -> u64 {
        self.skipped_samples
    }

    /// Whether the datasets hold preference pairs.
    pub fn is_preference(&self) -> bool {
        self.preference
    }

    /// Preference pairs left out for being longer than the sequence (counted once per pair,
    /// over every dataset).
    pub fn skipped_pairs(&self) -> u64 {
        self.skipped_pairs
    }

    /// The dataset (its place among those [`new`](Self::new) took) and the pairs (its
    /// documents) of sample `sample` of a stream of preference pairs: pair `k` of the list is
    /// document `k` of the sample as [`fill`](Self::fill) writes it.
    pub fn sample_pairs(&self, sample: usize) -> Result<(usize, &[u32]), DataError> {
        if sample >= self.len() {
            return Err(DataError::SampleOutOfRange {
                sample,
                samples: self.len(),
            });
        }
        let (dataset, dataset_sample) = self.locate(sample);
        match &self.indices[dataset] {
            DatasetIndex::Pairs(index) => Ok((dataset, index.sample(dataset_sample)?)),
            DatasetIndex::Tokens(_) => Err(DataError::NotPreference),
        }
    }

    /// The dataset of blended sample `sample`, and which of that dataset's samples it is.
    fn locate(&self, sample: usize) -> (usize, usize) {
        match &self.blending {
            Some(blending) => (
                blending.dataset_indices()[sample] as usize,
                blending.sample_indices()[sample] as usize,
            ),
            None => (0, sample),
        }
    }

    /// Samples in the stream.
    pub fn len(&self) -> usize {
        self.num_samples
    }

    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// Writes samples `first_sample, first_sample + 1, …` into the buffers, one sample per
    /// `sample_length` positions, as many as the buffers hold:
    ///
    /// - `tokens`: the sample's tokens;
    /// - `document_ids`: for each position, which document piece of its sample it comes from,
    ///   counted 0, 1, 2, … from the sample's start, so attention can stay inside documents;
    ///   padding counts as one more document after the last;
    /// - `loss_mask`: 0 on padding (a short truncated document, or a sample FIM shortened) and
    ///   on the tokens of loss-masking spans, 1 elsewhere. Padding tokens are FIM's pad token,
    ///   or 0 without FIM.
    /// - `parts`: for preference pairs only (`None` otherwise), which part of its pair each
    ///   position holds ([`part`]).
    ///
    /// A preference pair of `P` prompt, `C` chosen and `R` rejected tokens fills `P + C + R + 1`
    /// positions, one document: the prompt but its last token (part 0), that last token then
    /// the chosen answer (part 1), that last token again then the rejected answer (part 2).
    /// Each answer's part thus starts with the token that predicts its first token, so that
    /// every label is the next token of the same part; `loss_mask` is 1 on the answers' tokens
    /// (the labels) and 0 on the rest.
    ///
    /// The buffers must have equal lengths, a multiple of the sample length, and every sample
    /// must exist: the stream does not wrap around.
    pub fn fill(
        &self,
        first_sample: u64,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
        mut parts: Option<&mut [i8]>,
    ) -> Result<(), DataError> {
        let length = self.sample_length;
        if tokens.len() % length != 0
            || document_ids.len() != tokens.len()
            || loss_mask.len() != tokens.len()
        {
            return Err(DataError::BadBatchBuffers {
                sample_length: length,
                tokens: tokens.len(),
                document_ids: document_ids.len(),
                loss_mask: loss_mask.len(),
            });
        }
        let parts_length = parts.as_ref().map(|parts| parts.len());
        let expected = self.preference.then_some(tokens.len());
        if parts_length != expected {
            return Err(DataError::BadPartsBuffer {
                tokens: expected.unwrap_or(0),
                parts: parts_length.unwrap_or(0),
            });
        }
        let count = tokens.len() / length;
        if count == 0 {
            return Ok(());
        }
        let first = usize::try_from(first_sample).unwrap_or(usize::MAX);
        if first.checked_add(count).is_none_or(|end| end > self.len()) {
            return Err(DataError::SampleOutOfRange {
                sample: first.max(self.len()),
                samples: self.len(),
            });
        }

        let threads = self.threads_for(count);
        if threads == 1 {
            return self.fill_samples(first, tokens, document_ids, loss_mask, parts);
        }
        let per_thread = count.div_ceil(threads) * length;
        let mut parts = parts.as_mut().map(|parts| parts.chunks_mut(per_thread));
        thread::scope(|scope| {
            let workers: Vec<_> = tokens
                .chunks_mut(per_thread)
                .zip(document_ids.chunks_mut(per_thread))
                .zip(loss_mask.chunks_mut(per_thread))
                .enumerate()
                .map(|(k, ((tokens, document_ids), loss_mask))| {
                    let first = first + k * (per_thread / length);
                    let parts = parts.as_mut().map(|chunks| chunks.next().expect("as many"));
                    scope.spawn(move || {
                        self.fill_samples(first, tokens, document_ids, loss_mask, parts)
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
        })
    }

    /// Threads worth starting for `count` samples: character FIM (decoding and re-encoding
    /// text) is slow enough to spread sample by sample; plain copies only in large batches.
    fn threads_for(&self, count: usize) -> usize {
        let character_fim = self
            .fim
            .as_ref()
            .is_some_and(|fim| fim.config().split == FimSplit::Character);
        let min_samples = if character_fim {
            1
        } else {
            (MIN_TOKENS_PER_THREAD / self.sample_length).max(1)
        };
        self.threads.min(count.div_ceil(min_samples)).max(1)
    }

    fn fill_samples(
        &self,
        first: usize,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
        parts: Option<&mut [i8]>,
    ) -> Result<(), DataError> {
        let length = self.sample_length;
        let samples = tokens
            .chunks_exact_mut(length)
            .zip(document_ids.chunks_exact_mut(length))
            .zip(loss_mask.chunks_exact_mut(length));
        let mut parts = parts.map(|parts| parts.chunks_exact_mut(length));
        for (k, ((tokens, document_ids), loss_mask)) in samples.enumerate() {
            let sample = first + k;
            let (dataset, dataset_sample) = self.locate(sample);
            match (&self.indices[dataset], parts.as_mut()) {
                (DatasetIndex::Pairs(index), Some(parts)) => self.fill_pairs(
                    &self.datasets[dataset],
                    index.sample(dataset_sample)?,
                    tokens,
                    document_ids,
                    loss_mask,
                    parts.next().expect("as many samples"),
                )?,
                (DatasetIndex::Tokens(index), None) => self.fill_sample(
                    sample,
                    dataset,
                    index,
                    dataset_sample,
                    tokens,
                    document_ids,
                    loss_mask,
                )?,
                _ => unreachable!("`fill` checked that parts come with pairs only"),
            }
        }
        Ok(())
    }

    /// One sample of whole preference pairs, laid out as [`fill`](Self::fill) says.
    fn fill_pairs(
        &self,
        source: &IndexedDataset,
        pairs: &[u32],
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
        parts: &mut [i8],
    ) -> Result<(), DataError> {
        let spans = source
            .preference_spans()
            .expect("pair indices are built for preference datasets only");
        let mut end = 0;
        for (id, &pair) in pairs.iter().enumerate() {
            let document = pair as usize;
            let span = spans.pair(document);
            let last = span.prompt_length() as usize - 1;
            // (offset in the document, length, part, first position trained)
            let pieces = [
                (0, last, part::PROMPT, usize::MAX),
                (last, 1 + span.chosen_length() as usize, part::CHOSEN, 1),
                (last, 1, part::REJECTED, usize::MAX),
                (
                    span.rejected[0] as usize,
                    span.rejected_length() as usize,
                    part::REJECTED,
                    0,
                ),
            ];
            let start = end;
            for (offset, length, piece_part, trained_from) in pieces {
                let range = end..end + length;
                source
                    .tokens(document, offset, length)?
                    .copy_to(&mut tokens[range.clone()]);
                parts[range.clone()].fill(piece_part);
                loss_mask[range.clone()].fill(0);
                if trained_from < length {
                    loss_mask[range.start + trained_from..range.end].fill(1);
                }
                end = range.end;
            }
            if let Some(vocab_size) = self.vocab_size {
                check_vocabulary(&tokens[start..end], vocab_size, source, pair)?;
            }
            document_ids[start..end].fill(id as i32);
        }
        tokens[end..].fill(self.padding_token);
        document_ids[end..].fill(pairs.len() as i32);
        loss_mask[end..].fill(0);
        parts[end..].fill(part::PADDING);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn fill_sample(
        &self,
        sample: usize,
        dataset: usize,
        index: &SamplingIndex,
        dataset_sample: usize,
        tokens: &mut [i64],
        document_ids: &mut [i32],
        loss_mask: &mut [u8],
    ) -> Result<(), DataError> {
        let dataset_sample = match &self.trained_samples[dataset] {
            Some(trained) => trained[dataset_sample],
            None => dataset_sample,
        };
        let source = &self.datasets[dataset];
        let mut end = 0;
        // A sample has at most `sample_length` pieces, so their ids fit i32 in any real batch.
        for (id, piece) in index.pieces(dataset_sample)?.enumerate() {
            let range = end..end + piece.length as usize;
            source
                .tokens(piece.document as usize, piece.offset as usize, range.len())?
                .copy_to(&mut tokens[range.clone()]);
            if let Some(vocab_size) = self.vocab_size {
                check_vocabulary(&tokens[range.clone()], vocab_size, source, piece.document)?;
            }
            document_ids[range.clone()].fill(id as i32);
            loss_mask[range.clone()].fill(1);
            if let Some(spans) = source.loss_spans() {
                for masked in masked_in(spans, piece.document, piece.offset, piece.length) {
                    loss_mask[range.start + masked.start..range.start + masked.end].fill(0);
                }
            }
            end = range.end;
        }
        match &self.fim {
            Some(fim) => {
                fim.fill_sample(
                    self.seed,
                    sample as u64,
                    tokens,
                    document_ids,
                    loss_mask,
                    end,
                )?;
            }
            None => pad_sample(tokens, document_ids, loss_mask, end, self.padding_token),
        }
        Ok(())
    }
}

/// Makes positions `real..` of a sample padding: `token`, one document after the last real
/// token's (document 0 when none is real), not trained (loss mask 0).
pub(crate) fn pad_sample(
    tokens: &mut [i64],
    document_ids: &mut [i32],
    loss_mask: &mut [u8],
    real: usize,
    token: i64,
) {
    let padding_id = real.checked_sub(1).map_or(0, |last| document_ids[last] + 1);
    tokens[real..].fill(token);
    document_ids[real..].fill(padding_id);
    loss_mask[real..].fill(0);
}

/// Fails unless every token lies in `0..vocab_size`: one branch-free pass over the copied
/// tokens (a negative id wraps to a huge u64), the search only on failure.
fn check_vocabulary(
    tokens: &[i64],
    vocab_size: u64,
    source: &IndexedDataset,
    document: u32,
) -> Result<(), DataError> {
    if tokens
        .iter()
        .fold(true, |all, &t| all & ((t as u64) < vocab_size))
    {
        return Ok(());
    }
    let token = *tokens
        .iter()
        .find(|&&t| t as u64 >= vocab_size)
        .expect("a token is outside the vocabulary");
    Err(DataError::BeyondVocabulary {
        path: source.bin_path().to_owned(),
        document: document as usize,
        token,
        vocab_size,
    })
}

fn index(
    cache_dir: &Path,
    dataset: &IndexedDataset,
    sampling: SamplingConfig,
    cancel: &Cancel,
) -> Result<SamplingIndex, DataError> {
    SamplingIndex::load_or_build(cache_dir, dataset.document_lengths(), sampling, cancel)
        .map(|(index, _)| index)
}

/// An index holding `sampling.num_samples` samples with a trained label, those samples, and
/// how many samples without one come before the last of them.
fn trained_index(
    cache_dir: &Path,
    dataset: &IndexedDataset,
    spans: &LossSpans,
    sampling: SamplingConfig,
    cancel: &Cancel,
) -> Result<(SamplingIndex, Vec<usize>, u64), DataError> {
    let needed = sampling.num_samples;
    let limit = needed.saturating_mul(MAX_UNTRAINED_RATIO);
    let mut drawn = needed;
    loop {
        let index = index(
            cache_dir,
            dataset,
            SamplingConfig {
                num_samples: drawn,
                ..sampling
            },
            cancel,
        )?;
        let mut trained = Vec::with_capacity(needed);
        for sample in 0..drawn {
            cancel.check_at(sample)?;
            if trained.len() == needed {
                break;
            }
            if has_trained_label(&index, spans, sample)? {
                trained.push(sample);
            }
        }
        if trained.len() == needed {
            let skipped = trained.last().map_or(0, |&last| last + 1 - needed);
            return Ok((index, trained, skipped as u64));
        }
        if drawn >= limit {
            return Err(DataError::TooFewTrainedTokens {
                path: dataset.bin_path().to_owned(),
                ratio: MAX_UNTRAINED_RATIO,
            });
        }
        // Samples after the first `drawn` have trained labels about as often as those.
        let estimate = match trained.len() {
            0 => drawn.saturating_mul(2),
            found => (drawn as u128 * needed as u128).div_ceil(found as u128) as usize + 1,
        };
        drawn = estimate.min(limit);
    }
}

/// Whether some label of the sample (tokens 1, 2, … of it) is trained on.
fn has_trained_label(
    index: &SamplingIndex,
    spans: &LossSpans,
    sample: usize,
) -> Result<bool, DataError> {
    let mut position = 0u32;
    for piece in index.pieces(sample)? {
        // The sample's first token is only ever an input.
        let skip = u32::from(position == 0);
        let (offset, length) = (piece.offset + skip, piece.length.saturating_sub(skip));
        let masked: usize = masked_in(spans, piece.document, offset, length)
            .map(|range| range.len())
            .sum();
        if (masked as u32) < length {
            return Ok(true);
        }
        position += piece.length;
    }
    Ok(false)
}

/// The masked tokens among tokens `offset..offset + length` of `document`, relative to `offset`.
fn masked_in(
    spans: &LossSpans,
    document: u32,
    offset: u32,
    length: u32,
) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let spans = spans.document(document as usize);
    let end = offset + length;
    let first = spans.partition_point(|&[_, span_end]| span_end <= offset);
    spans[first..]
        .iter()
        .take_while(move |&&[begin, _]| begin < end)
        .map(move |&[begin, span_end]| {
            (begin.max(offset) - offset) as usize..(span_end.min(end) - offset) as usize
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preference_spans::PreferenceSpansWriter;
    use crate::{IndexedDatasetWriter, PairSpans, TokenDtype};

    /// Pairs of (prompt, chosen, rejected) lengths, each token its pair's number times 100
    /// plus its place in the pair.
    fn write_pairs(prefix: &Path, lengths: &[(u32, u32, u32)]) -> Vec<Vec<i64>> {
        let mut writer = IndexedDatasetWriter::create(prefix, TokenDtype::U16).unwrap();
        let mut spans = PreferenceSpansWriter::new(prefix);
        let mut documents = Vec::new();
        for (k, &(p, c, r)) in lengths.iter().enumerate() {
            let document: Vec<i64> = (0..p + c + r)
                .map(|t| (100 * k as u32 + t) as i64)
                .collect();
            writer.add_document(&document).unwrap();
            spans.add(&[document.len() as i32], &[PairSpans::of_lengths(p, c, r)]);
            documents.push(document);
        }
        writer.finish().unwrap();
        spans.finish().unwrap();
        documents
    }

    #[test]
    fn a_pair_fills_its_prompt_once_and_each_answer_after_the_prompts_last_token() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("pairs");
        let lengths = [(3, 2, 1), (1, 1, 2), (4, 3, 3)];
        let documents = write_pairs(&prefix, &lengths);
        let config = SampleSourceConfig {
            sequence_length: 16,
            num_samples: 3,
            seed: 1,
            mode: SamplingMode::Truncated,
            weights: None,
            cache_dir: dir.path().join("cache"),
            threads: 2,
            vocab_size: Some(1000),
        };
        let datasets = vec![IndexedDataset::open(&prefix).unwrap()];
        let source = SampleSource::new(datasets, config, None, &Cancel::default()).unwrap();
        assert!(source.is_preference());
        let n = 3 * 17;
        let (mut tokens, mut ids, mut mask, mut parts) =
            (vec![-1; n], vec![-1; n], vec![9; n], vec![9; n]);
        source
            .fill(0, &mut tokens, &mut ids, &mut mask, Some(&mut parts))
            .unwrap();
        let mut seen = Vec::new();
        for sample in 0..3 {
            let row = sample * 17..(sample + 1) * 17;
            let pair = (tokens[row.start] / 100) as usize;
            seen.push(pair);
            let (p, c, r) = lengths[pair];
            let (p, c, r) = (p as usize, c as usize, r as usize);
            let document = &documents[pair];
            let last = document[p - 1];
            let mut expected = document[..p - 1].to_vec();
            expected.push(last);
            expected.extend_from_slice(&document[p..p + c]);
            expected.push(last);
            expected.extend_from_slice(&document[p + c..]);
            let used = expected.len();
            assert_eq!(used, p + c + r + 1);
            expected.resize(17, 0);
            assert_eq!(tokens[row.clone()], expected[..]);
            let mut expected_parts = vec![part::PROMPT; p - 1];
            expected_parts.extend(vec![part::CHOSEN; c + 1]);
            expected_parts.extend(vec![part::REJECTED; r + 1]);
            expected_parts.resize(17, part::PADDING);
            assert_eq!(parts[row.clone()], expected_parts[..]);
            let mut expected_mask = vec![0; p];
            expected_mask.extend(vec![1; c]);
            expected_mask.push(0);
            expected_mask.extend(vec![1; r]);
            expected_mask.resize(17, 0);
            assert_eq!(mask[row.clone()], expected_mask[..]);
            let mut expected_ids = vec![0; used];
            expected_ids.resize(17, 1);
            assert_eq!(ids[row], expected_ids[..]);
        }
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2]);
        for sample in 0..3 {
            let pair = tokens[sample * 17] / 100;
            assert_eq!(
                source.sample_pairs(sample).unwrap(),
                (0, &[pair as u32][..])
            );
        }
        assert!(matches!(
            source.sample_pairs(3),
            Err(DataError::SampleOutOfRange { sample: 3, .. })
        ));

        let error = source.fill(0, &mut tokens, &mut ids, &mut mask, None);
        assert!(matches!(error, Err(DataError::BadPartsBuffer { .. })));
    }

    #[test]
    fn sample_pairs_name_each_documents_dataset_and_pair() {
        let dir = tempfile::tempdir().unwrap();
        let lengths = [
            vec![(3, 2, 1), (1, 1, 2), (4, 3, 3), (2, 2, 2), (1, 1, 1)],
            vec![(2, 1, 1), (5, 1, 2), (1, 3, 1)],
        ];
        for (name, lengths) in ["a", "b"].iter().zip(&lengths) {
            write_pairs(&dir.path().join(name), lengths);
        }
        let datasets = ["a", "b"]
            .map(|name| IndexedDataset::open(dir.path().join(name)).unwrap())
            .into_iter()
            .collect();
        let (length, count) = (24, 12);
        let config = SampleSourceConfig {
            sequence_length: length as u32 - 1,
            num_samples: count,
            seed: 5,
            mode: SamplingMode::Packed,
            weights: None,
            cache_dir: dir.path().join("cache"),
            threads: 1,
            vocab_size: None,
        };
        let source = SampleSource::new(datasets, config, None, &Cancel::default()).unwrap();
        let n = count * length;
        let (mut tokens, mut ids, mut mask, mut parts) =
            (vec![0; n], vec![0; n], vec![0; n], vec![0; n]);
        source
            .fill(0, &mut tokens, &mut ids, &mut mask, Some(&mut parts))
            .unwrap();
        let mut datasets_seen = [false; 2];
        for sample in 0..count {
            let (dataset, pairs) = source.sample_pairs(sample).unwrap();
            datasets_seen[dataset] = true;
            let row = sample * length..(sample + 1) * length;
            for (k, &pair) in pairs.iter().enumerate() {
                let document: Vec<usize> = row
                    .clone()
                    .filter(|&t| ids[t] == k as i32 && parts[t] != part::PADDING)
                    .collect();
                let (p, c, r) = lengths[dataset][pair as usize];
                assert_eq!(document.len() as u32, p + c + r + 1);
                assert_eq!(tokens[document[0]], 100 * i64::from(pair));
            }
            assert!(ids[row].iter().all(|&id| id as usize <= pairs.len()));
        }
        assert_eq!(datasets_seen, [true, true]);
    }

    #[test]
    fn pairs_do_not_blend_with_other_datasets() {
        let dir = tempfile::tempdir().unwrap();
        write_pairs(&dir.path().join("pairs"), &[(2, 1, 1)]);
        let mut writer =
            IndexedDatasetWriter::create(dir.path().join("text"), TokenDtype::U16).unwrap();
        writer.add_document(&[1i64, 2, 3]).unwrap();
        writer.finish().unwrap();
        let datasets = ["pairs", "text"]
            .map(|name| IndexedDataset::open(dir.path().join(name)).unwrap())
            .into_iter()
            .collect();
        let config = SampleSourceConfig {
            sequence_length: 8,
            num_samples: 2,
            seed: 1,
            mode: SamplingMode::Packed,
            weights: None,
            cache_dir: dir.path().join("cache"),
            threads: 1,
            vocab_size: None,
        };
        let error = SampleSource::new(datasets, config, None, &Cancel::default());
        assert!(matches!(error, Err(DataError::MixedPreference { .. })));
    }
}
