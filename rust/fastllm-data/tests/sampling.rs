use std::collections::{HashMap, HashSet};

use fastllm_data::{DataError, Piece, SamplingConfig, SamplingIndex, SamplingMode};
use proptest::prelude::*;

fn config(
    sequence_length: u32,
    num_samples: usize,
    seed: u64,
    mode: SamplingMode,
) -> SamplingConfig {
    SamplingConfig {
        sequence_length,
        num_samples,
        seed,
        mode,
    }
}

fn pieces(index: &SamplingIndex, sample: usize) -> Vec<Piece> {
    index.pieces(sample).unwrap().collect()
}

fn all_pieces(index: &SamplingIndex) -> Vec<Vec<Piece>> {
    (0..index.len())
        .map(|sample| pieces(index, sample))
        .collect()
}

fn piece(document: u32, offset: u32, length: u32) -> Piece {
    Piece {
        document,
        offset,
        length,
    }
}

/// Checks one epoch of the token stream, given as (document, token) pairs: documents follow one
/// another whole, each at most once; only the stream's last document may be cut short. A
/// complete epoch holds every non-empty document.
fn check_epoch(
    tokens: &[(u32, u32)],
    lengths: &[u32],
    complete: bool,
) -> Result<(), TestCaseError> {
    let mut seen = HashSet::new();
    let mut i = 0;
    while i < tokens.len() {
        let document = tokens[i].0;
        prop_assert!(
            seen.insert(document),
            "document {} visited twice in an epoch",
            document
        );
        let length = lengths[document as usize] as usize;
        let run = length.min(tokens.len() - i);
        for t in 0..run {
            prop_assert_eq!(tokens[i + t], (document, t as u32));
        }
        prop_assert!(
            run == length || i + run == tokens.len(),
            "document cut short mid-stream"
        );
        i += run;
    }
    if complete {
        prop_assert_eq!(seen.len(), lengths.iter().filter(|&&l| l > 0).count());
    }
    Ok(())
}

proptest! {
    #[test]
    fn packed_samples_read_every_token_of_every_epoch_exactly_once(
        lengths in prop::collection::vec(0u32..20, 1..15),
        sequence_length in 1u32..30,
        num_samples in 1usize..60,
        seed in any::<u64>(),
    ) {
        prop_assume!(lengths.iter().any(|&l| l > 0));
        let index = SamplingIndex::build(&lengths, config(sequence_length, num_samples, seed, SamplingMode::Packed)).unwrap();
        let l = sequence_length as usize;

        // The stream: the first L tokens of every sample, then the last sample's final token.
        let mut stream = Vec::new();
        let mut previous_last = None;
        for sample in 0..num_samples {
            let mut tokens = Vec::new();
            for p in pieces(&index, sample) {
                prop_assert!(p.length > 0 && p.offset + p.length <= lengths[p.document as usize]);
                tokens.extend((p.offset..p.offset + p.length).map(|t| (p.document, t)));
            }
            prop_assert_eq!(tokens.len(), l + 1);
            if let Some(last) = previous_last {
                // Consecutive samples share a token: the last label is the next first input.
                prop_assert_eq!(tokens[0], last);
            }
            stream.extend_from_slice(&tokens[..l]);
            previous_last = Some(tokens[l]);
        }
        stream.push(previous_last.unwrap());

        let epoch_tokens = lengths.iter().sum::<u32>() as usize;
        for epoch in stream.chunks(epoch_tokens) {
            check_epoch(epoch, &lengths, epoch.len() == epoch_tokens)?;
        }
    }

    #[test]
    fn truncated_samples_visit_every_document_once_per_epoch(
        lengths in prop::collection::vec(0u32..20, 1..15),
        sequence_length in 1u32..30,
        num_samples in 1usize..60,
        seed in any::<u64>(),
    ) {
        let documents = lengths.iter().filter(|&&l| l > 0).count();
        prop_assume!(documents > 0);
        let index = SamplingIndex::build(&lengths, config(sequence_length, num_samples, seed, SamplingMode::Truncated)).unwrap();
        let mut visited = Vec::new();
        for sample in 0..num_samples {
            let sample_pieces = pieces(&index, sample);
            prop_assert_eq!(sample_pieces.len(), 1);
            let p = sample_pieces[0];
            let real = lengths[p.document as usize].min(sequence_length + 1);
            prop_assert_eq!(p, piece(p.document, 0, real));
            prop_assert_eq!(index.document_boundaries(sample).unwrap(), vec![0, real]);
            visited.push(p.document);
        }
        for epoch in visited.chunks(documents) {
            let distinct: HashSet<_> = epoch.iter().collect();
            prop_assert_eq!(distinct.len(), epoch.len());
        }
    }

    #[test]
    fn more_samples_only_append(
        lengths in prop::collection::vec(0u32..50, 1..20),
        sequence_length in 1u32..40,
        num_samples in 1usize..40,
        extra in 1usize..40,
        seed in any::<u64>(),
        truncated in any::<bool>(),
    ) {
        prop_assume!(lengths.iter().any(|&l| l > 0));
        let mode = if truncated { SamplingMode::Truncated } else { SamplingMode::Packed };
        let short = SamplingIndex::build(&lengths, config(sequence_length, num_samples, seed, mode)).unwrap();
        let long = SamplingIndex::build(&lengths, config(sequence_length, num_samples + extra, seed, mode)).unwrap();
        for sample in 0..num_samples {
            prop_assert_eq!(pieces(&short, sample), pieces(&long, sample));
        }
    }
}

#[test]
fn a_single_document_is_cut_at_the_stride_and_repeated_each_epoch() {
    let index = SamplingIndex::build(&[5u32], config(2, 3, 0, SamplingMode::Packed)).unwrap();
    assert_eq!(
        all_pieces(&index),
        [
            vec![piece(0, 0, 3)],
            vec![piece(0, 2, 3)],
            vec![piece(0, 4, 1), piece(0, 0, 2)],
        ]
    );
    assert_eq!(index.document_boundaries(2).unwrap(), [0, 1, 3]);
    assert_eq!(index.sample_length(), 3);
}

#[test]
fn empty_documents_are_never_sampled() {
    let lengths = [0i32, 4, 0, 0, 3, 0];
    for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
        let index = SamplingIndex::build(&lengths, config(3, 50, 9, mode)).unwrap();
        for sample_pieces in all_pieces(&index) {
            assert!(sample_pieces
                .iter()
                .all(|p| p.document == 1 || p.document == 4));
        }
    }
}

#[test]
fn the_same_inputs_give_the_same_index_and_another_seed_another_one() {
    let lengths: Vec<u32> = (0..50).map(|d| 1 + d % 7).collect();
    for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
        let a = SamplingIndex::build(&lengths, config(8, 200, 3, mode)).unwrap();
        let b = SamplingIndex::build(&lengths, config(8, 200, 3, mode)).unwrap();
        let c = SamplingIndex::build(&lengths, config(8, 200, 4, mode)).unwrap();
        assert!(a == b);
        assert_eq!(all_pieces(&a), all_pieces(&b));
        assert_ne!(all_pieces(&a), all_pieces(&c));
    }
}

#[test]
fn each_epoch_is_shuffled_afresh() {
    let lengths = vec![1u32; 50];
    let index =
        SamplingIndex::build(&lengths, config(1, 150, 11, SamplingMode::Truncated)).unwrap();
    let order: Vec<u32> = (0..150).map(|s| pieces(&index, s)[0].document).collect();
    assert_ne!(order[..50], order[50..100]);
    assert_ne!(order[50..100], order[100..]);
}

#[test]
fn every_permutation_of_an_epoch_is_equally_likely() {
    // An off-by-one in Fisher–Yates skews this; 6000 draws of 6 permutations: mean 1000, sd 29.
    let mut counts: HashMap<Vec<u32>, u32> = HashMap::new();
    for seed in 0..6000 {
        let index =
            SamplingIndex::build(&[1u32, 1, 1], config(1, 3, seed, SamplingMode::Truncated))
                .unwrap();
        let permutation = (0..3).map(|s| pieces(&index, s)[0].document).collect();
        *counts.entry(permutation).or_default() += 1;
    }
    assert_eq!(counts.len(), 6);
    assert!(
        counts.values().all(|&c| (850..1150).contains(&c)),
        "{counts:?}"
    );
}

#[test]
fn long_documents_are_truncated_and_short_ones_leave_padding() {
    let index =
        SamplingIndex::build(&[10u32, 2], config(4, 2, 0, SamplingMode::Truncated)).unwrap();
    let mut real: Vec<(u32, u32)> = (0..2)
        .map(|s| {
            (
                pieces(&index, s)[0].document,
                *index.document_boundaries(s).unwrap().last().unwrap(),
            )
        })
        .collect();
    real.sort();
    assert_eq!(real, [(0, 5), (1, 2)]);
}

#[test]
fn invalid_inputs_are_errors() {
    let packed = |l, n| config(l, n, 0, SamplingMode::Packed);
    for sequence_length in [0, u32::MAX] {
        assert!(matches!(
            SamplingIndex::build(&[5u32], packed(sequence_length, 1)),
            Err(DataError::BadSequenceLength { .. })
        ));
    }
    assert!(matches!(
        SamplingIndex::build(&[0u32, 0], packed(4, 1)),
        Err(DataError::NoTokens { num_samples: 1 })
    ));
    assert!(matches!(
        SamplingIndex::build(&[3i32, -2], packed(4, 1)),
        Err(DataError::BadDocumentLength {
            document: 1,
            length: -2
        })
    ));
    let empty = SamplingIndex::build(&[0u32], packed(4, 0)).unwrap();
    assert!(empty.is_empty());
    let index = SamplingIndex::build(&[5u32], packed(4, 2)).unwrap();
    assert!(matches!(
        index.pieces(2),
        Err(DataError::SampleOutOfRange {
            sample: 2,
            samples: 2
        })
    ));
}
