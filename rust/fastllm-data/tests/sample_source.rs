use std::path::{Path, PathBuf};

use fastllm_data::{
    BlendingIndex, Cancel, DataError, Fim, FimConfig, FimSplit, IndexedDataset,
    IndexedDatasetWriter, SampleSource, SampleSourceConfig, SamplingConfig, SamplingIndex,
    SamplingMode, TextCodec, TokenDtype,
};

const EOS: i64 = 3;
const PREFIX: i64 = 4;
const MIDDLE: i64 = 5;
const SUFFIX: i64 = 6;
const PAD: i64 = 7;

/// Dataset `d` holds documents of 1 to 29 tokens, each `100 * (d + 1) + (0..90)` then EOS, so
/// every token tells its dataset.
fn documents(dataset: usize, count: usize) -> Vec<Vec<i64>> {
    (0..count)
        .map(|doc| {
            let length = 1 + (doc * 7919 + dataset * 13) % 29;
            let mut tokens: Vec<i64> = (0..length)
                .map(|t| (100 * (dataset + 1) + (doc * 31 + t) % 90) as i64)
                .collect();
            tokens.push(EOS);
            tokens
        })
        .collect()
}

/// Writes `dir/NAME.{bin,idx}` and returns the prefix to open it by.
fn write_dataset(dir: &Path, name: &str, documents: &[Vec<i64>], dtype: TokenDtype) -> PathBuf {
    let prefix = dir.join(name);
    let mut writer = IndexedDatasetWriter::create(&prefix, dtype).unwrap();
    for document in documents {
        writer.add_document(document).unwrap();
    }
    writer.finish().unwrap();
    prefix
}

fn open_all(prefixes: &[PathBuf]) -> Vec<IndexedDataset> {
    prefixes
        .iter()
        .map(|prefix| IndexedDataset::open(prefix).unwrap())
        .collect()
}

/// Which dataset a sample comes from, told by its first token other than EOS.
fn dataset_of_sample(sample: &[i64]) -> usize {
    let token = sample.iter().find(|&&t| t != EOS).unwrap();
    *token as usize / 100 - 1
}

fn source_config(dir: &Path, num_samples: usize, mode: SamplingMode) -> SampleSourceConfig {
    SampleSourceConfig {
        sequence_length: 16,
        num_samples,
        seed: 42,
        mode,
        weights: None,
        cache_dir: dir.join("cache"),
        threads: 1,
        vocab_size: None,
    }
}

fn fim_config(split: FimSplit) -> FimConfig {
    FimConfig {
        rate: 1.0,
        spm_rate: 0.5,
        max_middle_len: None,
        split,
        prefix: PREFIX as u32,
        middle: MIDDLE as u32,
        suffix: SUFFIX as u32,
        pad: PAD as u32,
        eos: EOS as u32,
    }
}

/// Token `t` is the character of code point `t`.
struct CharCodec;

impl TextCodec for CharCodec {
    fn decode(&self, tokens: &[u32]) -> Result<String, String> {
        tokens
            .iter()
            .map(|&t| char::from_u32(t).ok_or_else(|| format!("no character {t}")))
            .collect()
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.chars().map(u32::from).collect())
    }
}

struct Batch {
    tokens: Vec<i64>,
    document_ids: Vec<i32>,
    loss_mask: Vec<u8>,
}

fn fill(source: &SampleSource, first: u64, count: usize) -> Result<Batch, DataError> {
    let n = count * source.sample_length();
    let mut batch = Batch {
        tokens: vec![-1; n],
        document_ids: vec![-1; n],
        loss_mask: vec![9; n],
    };
    source.fill(
        first,
        &mut batch.tokens,
        &mut batch.document_ids,
        &mut batch.loss_mask,
        None,
    )?;
    Ok(batch)
}

#[test]
fn batches_match_the_documents_the_indices_name() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<Vec<i64>>> = (0..3).map(|d| documents(d, 20 + 15 * d)).collect();
    let dtypes = [TokenDtype::U16, TokenDtype::I32, TokenDtype::I64];
    let weights = [1.0, 2.0, 3.0];
    let prefixes: Vec<PathBuf> = (0..3)
        .map(|d| write_dataset(dir.path(), &format!("d{d}"), &docs[d], dtypes[d]))
        .collect();
    for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
        let datasets = open_all(&prefixes);
        let config = SampleSourceConfig {
            weights: Some(weights.to_vec()),
            ..source_config(dir.path(), 60, mode)
        };
        let source = SampleSource::new(datasets, config, None, &Cancel::default()).unwrap();
        assert_eq!((source.len(), source.sample_length()), (60, 17));
        let batch = fill(&source, 0, 60).unwrap();

        let blending = BlendingIndex::build(&weights, 60).unwrap();
        let indices: Vec<SamplingIndex> = (0..3)
            .map(|d| {
                let lengths: Vec<usize> = docs[d].iter().map(Vec::len).collect();
                let lengths: Vec<u32> = lengths.iter().map(|&l| l as u32).collect();
                let config = SamplingConfig {
                    sequence_length: 16,
                    num_samples: blending.samples_per_dataset()[d] as usize,
                    seed: 42,
                    mode,
                };
                SamplingIndex::build(&lengths, config).unwrap()
            })
            .collect();
        for sample in 0..60 {
            let dataset = blending.dataset_indices()[sample] as usize;
            let pieces = indices[dataset]
                .pieces(blending.sample_indices()[sample] as usize)
                .unwrap();
            let (mut tokens, mut ids) = (Vec::new(), Vec::new());
            for (id, piece) in pieces.enumerate() {
                let document = &docs[dataset][piece.document as usize];
                let (start, end) = (
                    piece.offset as usize,
                    (piece.offset + piece.length) as usize,
                );
                tokens.extend_from_slice(&document[start..end]);
                ids.resize(tokens.len(), id as i32);
            }
            let real = tokens.len();
            let padding_id = ids.last().unwrap() + 1;
            tokens.resize(17, 0);
            ids.resize(17, padding_id);
            let mask: Vec<u8> = (0..17).map(|i| u8::from(i < real)).collect();
            let at = sample * 17..(sample + 1) * 17;
            assert_eq!(batch.tokens[at.clone()], tokens, "{mode:?} sample {sample}");
            assert_eq!(
                batch.document_ids[at.clone()],
                ids,
                "{mode:?} sample {sample}"
            );
            assert_eq!(batch.loss_mask[at], mask, "{mode:?} sample {sample}");
        }
    }
}

#[test]
fn blending_follows_the_weights_or_else_the_token_counts() {
    let dir = tempfile::tempdir().unwrap();
    // 40 and 120 documents: about one to three in tokens.
    let docs = [documents(0, 40), documents(1, 120)];
    let tokens: Vec<f64> = docs
        .iter()
        .map(|d| d.iter().map(Vec::len).sum::<usize>() as f64)
        .collect();
    let prefixes = [
        write_dataset(dir.path(), "small", &docs[0], TokenDtype::U16),
        write_dataset(dir.path(), "large", &docs[1], TokenDtype::U16),
    ];
    for weights in [Some(vec![0.2, 0.8]), None] {
        let datasets = open_all(&prefixes);
        let config = SampleSourceConfig {
            weights: weights.clone(),
            ..source_config(dir.path(), 1000, SamplingMode::Packed)
        };
        let source = SampleSource::new(datasets, config, None, &Cancel::default()).unwrap();
        let batch = fill(&source, 0, 1000).unwrap();
        let from_second = batch
            .tokens
            .chunks(17)
            .filter(|sample| dataset_of_sample(sample) == 1)
            .count();
        let share = weights.map_or(tokens[1] / (tokens[0] + tokens[1]), |w| w[1]);
        assert!(
            (from_second as f64 - 1000.0 * share).abs() <= 1.0,
            "{from_second} samples of 1000 from the second dataset, expected share {share}"
        );
    }
}

#[test]
fn document_ids_restart_every_sample_and_step_at_piece_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let docs = documents(0, 30);
    let dataset =
        IndexedDataset::open(write_dataset(dir.path(), "d", &docs, TokenDtype::U16)).unwrap();
    let lengths: Vec<i32> = dataset.document_lengths().to_vec();
    let config = source_config(dir.path(), 50, SamplingMode::Packed);
    let source = SampleSource::new(vec![dataset], config, None, &Cancel::default()).unwrap();
    let batch = fill(&source, 0, 50).unwrap();
    let index = SamplingIndex::build(
        &lengths,
        SamplingConfig {
            sequence_length: 16,
            num_samples: 50,
            seed: 42,
            mode: SamplingMode::Packed,
        },
    )
    .unwrap();
    let mut several = 0;
    for (sample, ids) in batch.document_ids.chunks(17).enumerate() {
        let boundaries = index.document_boundaries(sample).unwrap();
        let expected: Vec<i32> = (0..17)
            .map(|i| boundaries.iter().filter(|&&b| b as usize <= i).count() as i32 - 1)
            .collect();
        assert_eq!(ids, expected, "sample {sample}");
        assert_eq!(ids[0], 0);
        several += usize::from(ids[16] > 0);
    }
    assert!(several > 10, "packed samples span several documents");
    assert!(
        batch.loss_mask.iter().all(|&m| m == 1),
        "packed samples have no padding"
    );
}

#[test]
fn truncated_samples_mask_their_padding() {
    let dir = tempfile::tempdir().unwrap();
    let docs = vec![vec![200, 201, 202, EOS], (0..30).collect()];
    let dataset =
        IndexedDataset::open(write_dataset(dir.path(), "d", &docs, TokenDtype::I32)).unwrap();
    let config = source_config(dir.path(), 2, SamplingMode::Truncated);
    let source = SampleSource::new(vec![dataset], config, None, &Cancel::default()).unwrap();
    let batch = fill(&source, 0, 2).unwrap();
    let mut samples: Vec<(&[i64], &[i32], &[u8])> = batch
        .tokens
        .chunks(17)
        .zip(batch.document_ids.chunks(17))
        .zip(batch.loss_mask.chunks(17))
        .map(|((t, d), m)| (t, d, m))
        .collect();
    samples.sort_by_key(|(tokens, _, _)| tokens[0] == 200);
    let long: Vec<i64> = (0..17).collect();
    assert_eq!(samples[0], (&long[..], &[0; 17][..], &[1; 17][..]));
    let short: Vec<i64> = [200, 201, 202, EOS].into_iter().chain([0; 13]).collect();
    let ids: Vec<i32> = [0; 4].into_iter().chain([1; 13]).collect();
    let mask: Vec<u8> = [1; 4].into_iter().chain([0; 13]).collect();
    assert_eq!(samples[1], (&short[..], &ids[..], &mask[..]));
}

#[test]
fn fim_through_fill_is_the_same_whatever_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let prefixes = [
        write_dataset(dir.path(), "a", &documents(0, 30), TokenDtype::U16),
        write_dataset(dir.path(), "b", &documents(1, 30), TokenDtype::U16),
    ];
    for split in [FimSplit::Token, FimSplit::Character] {
        let make = || {
            let datasets = open_all(&prefixes);
            let fim = Fim::new(fim_config(split), Some(Box::new(CharCodec))).unwrap();
            let config = source_config(dir.path(), 24, SamplingMode::Packed);
            SampleSource::new(datasets, config, Some(fim), &Cancel::default()).unwrap()
        };
        let source = make();
        let whole = fill(&source, 0, 24).unwrap();
        for sample in whole.tokens.chunks(17) {
            assert!(sample.contains(&PREFIX), "rate 1 transforms every sample");
        }
        for (first, count) in [(0, 1), (5, 1), (7, 9), (20, 4)] {
            let part = fill(&source, first as u64, count).unwrap();
            let at = first * 17..(first + count) * 17;
            assert_eq!(part.tokens, whole.tokens[at.clone()]);
            assert_eq!(part.document_ids, whole.document_ids[at.clone()]);
            assert_eq!(part.loss_mask, whole.loss_mask[at]);
        }
        let again = fill(&make(), 0, 24).unwrap();
        assert_eq!(again.tokens, whole.tokens);
    }
}

#[test]
fn thread_count_does_not_change_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let prefixes = [
        write_dataset(dir.path(), "a", &documents(0, 50), TokenDtype::U16),
        write_dataset(dir.path(), "b", &documents(1, 70), TokenDtype::U16),
    ];
    let run = |threads: usize, fim: Option<FimSplit>, sequence_length: u32, count: usize| {
        let datasets = open_all(&prefixes);
        let fim = fim.map(|split| Fim::new(fim_config(split), Some(Box::new(CharCodec))).unwrap());
        let config = SampleSourceConfig {
            sequence_length,
            threads,
            vocab_size: None,
            ..source_config(dir.path(), 5000, SamplingMode::Packed)
        };
        let source = SampleSource::new(datasets, config, fim, &Cancel::default()).unwrap();
        let batch = fill(&source, 100, count).unwrap();
        (batch.tokens, batch.document_ids, batch.loss_mask)
    };
    // Character FIM spreads from two samples on; plain copies from 2^17 tokens per thread.
    for (fim, sequence_length, count) in [
        (Some(FimSplit::Character), 16, 37),
        (Some(FimSplit::Token), 64, 4500),
        (None, 64, 4500),
    ] {
        let one = run(1, fim, sequence_length, count);
        assert_eq!(one, run(3, fim, sequence_length, count), "{fim:?}");
        assert_eq!(one, run(0, fim, sequence_length, count), "{fim:?}");
    }
}

#[test]
fn out_of_range_samples_and_bad_buffers_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let prefixes = [
        write_dataset(dir.path(), "a", &documents(0, 10), TokenDtype::U16),
        write_dataset(dir.path(), "b", &documents(1, 11), TokenDtype::U16),
    ];
    let source = SampleSource::new(
        open_all(&prefixes[..1]),
        source_config(dir.path(), 8, SamplingMode::Packed),
        None,
        &Cancel::default(),
    )
    .unwrap();
    assert!(fill(&source, 6, 2).is_ok());
    for (first, count, reported) in [(7, 2, 8), (8, 1, 8), (20, 1, 20), (u64::MAX, 1, usize::MAX)] {
        let error = fill(&source, first, count).err().unwrap();
        assert!(
            matches!(error, DataError::SampleOutOfRange { sample, samples: 8 } if sample == reported),
            "{error}"
        );
    }
    let (mut tokens, mut ids, mut mask) = (vec![0; 34], vec![0; 34], vec![0; 34]);
    for (t, d, m) in [(33, 33, 33), (34, 17, 34), (34, 34, 17)] {
        let error = source
            .fill(0, &mut tokens[..t], &mut ids[..d], &mut mask[..m], None)
            .unwrap_err();
        assert!(
            matches!(
                error,
                DataError::BadBatchBuffers {
                    sample_length: 17,
                    ..
                }
            ),
            "{error}"
        );
    }

    let config = SampleSourceConfig {
        weights: Some(vec![1.0]),
        ..source_config(dir.path(), 8, SamplingMode::Packed)
    };
    assert!(matches!(
        SampleSource::new(open_all(&prefixes), config, None, &Cancel::default()),
        Err(DataError::WeightCountMismatch {
            weights: 1,
            datasets: 2
        })
    ));
    assert!(matches!(
        SampleSource::new(
            Vec::new(),
            source_config(dir.path(), 8, SamplingMode::Packed),
            None,
            &Cancel::default(),
        ),
        Err(DataError::NoDatasets)
    ));
}

#[test]
fn a_token_outside_the_vocabulary_fails_the_batch_naming_its_document() {
    let dir = tempfile::tempdir().unwrap();
    let mut docs = documents(0, 40);
    docs[17][1] = 60_000;
    let prefix = write_dataset(dir.path(), "data", &docs, TokenDtype::U16);
    for (vocab_size, fails) in [(60_001, false), (60_000, true), (4096, true)] {
        let config = SampleSourceConfig {
            vocab_size: Some(vocab_size),
            ..source_config(dir.path(), 200, SamplingMode::Packed)
        };
        let source = SampleSource::new(
            open_all(std::slice::from_ref(&prefix)),
            config,
            None,
            &Cancel::default(),
        )
        .unwrap();
        let error = fill(&source, 0, 200).err();
        assert_eq!(error.is_some(), fails, "vocabulary of {vocab_size}");
        if let Some(error) = error {
            let DataError::BeyondVocabulary {
                path,
                document,
                token,
                ..
            } = &error
            else {
                panic!("{error}")
            };
            assert_eq!((document, token), (&17, &60_000));
            assert_eq!(path, &dir.path().join("data.bin"));
        }
    }
}

#[test]
fn a_cancelled_build_stops_and_caches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let prefixes = [
        write_dataset(dir.path(), "a", &documents(0, 40), TokenDtype::U16),
        write_dataset(dir.path(), "b", &documents(1, 40), TokenDtype::U16),
    ];
    let cancel = Cancel::default();
    cancel.cancel();
    for datasets in [&prefixes[..1], &prefixes[..]] {
        let config = source_config(dir.path(), 100_000, SamplingMode::Packed);
        let result = SampleSource::new(open_all(datasets), config, None, &cancel);
        assert!(matches!(result, Err(DataError::Cancelled)));
    }
    assert!(!dir.path().join("cache").exists(), "no index was cached");
}
