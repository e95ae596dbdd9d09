use fastllm_data::{BlendingIndex, DataError};
use proptest::prelude::*;

proptest! {
    #[test]
    fn every_prefix_stays_within_the_proven_bounds_of_its_targets(
        weights in prop::collection::vec(0.001f64..100.0, 1..8),
        num_samples in 0usize..1500,
    ) {
        let index = BlendingIndex::build(&weights, num_samples).unwrap();
        let k = weights.len() as f64;
        let total: f64 = weights.iter().sum();
        let (lower, upper) = (-(1.0 - 1.0 / k), (k - 1.0) * (k - 1.0) / k);
        let mut counts = vec![0u64; weights.len()];
        for (n, (&dataset, &sample)) in index.dataset_indices().iter().zip(index.sample_indices()).enumerate() {
            let dataset = dataset as usize;
            prop_assert_eq!(sample, counts[dataset], "samples of a dataset are numbered 0, 1, 2, …");
            counts[dataset] += 1;
            for (d, &count) in counts.iter().enumerate() {
                let deficit = weights[d] / total * (n + 1) as f64 - count as f64;
                prop_assert!(lower - 1e-9 <= deficit && deficit <= upper + 1e-9,
                    "after {} samples dataset {} is {} behind its target", n + 1, d, deficit);
            }
        }
        prop_assert_eq!(index.samples_per_dataset(), &counts[..]);
        prop_assert_eq!(index.len(), num_samples);
    }

    #[test]
    fn two_datasets_never_stray_more_than_half_a_sample(
        weight in 0.001f64..0.999,
        num_samples in 1usize..3000,
    ) {
        let index = BlendingIndex::build(&[weight, 1.0 - weight], num_samples).unwrap();
        let mut first = 0u64;
        for (n, &dataset) in index.dataset_indices().iter().enumerate() {
            first += u64::from(dataset == 0);
            let deficit = weight * (n + 1) as f64 - first as f64;
            prop_assert!(deficit.abs() <= 0.5 + 1e-9, "after {} samples: {}", n + 1, deficit);
        }
    }
}

#[test]
fn equal_weights_take_turns_from_the_lowest_index() {
    let index = BlendingIndex::build(&[1.0, 1.0, 1.0], 7).unwrap();
    assert_eq!(index.dataset_indices(), [0, 1, 2, 0, 1, 2, 0]);
    assert_eq!(index.sample_indices(), [0, 0, 0, 1, 1, 1, 2]);
    assert_eq!(index.samples_per_dataset(), [3, 2, 2]);
}

#[test]
fn a_one_to_three_blend_follows_the_greedy_rule() {
    // Deficits w·(i+1) − count: i=0 (.25, .75) → 1; i=1 (.5, .5) tie → 0; i=2 (−.25, 1.25) → 1;
    // i=3 (0, 1) → 1; then the pattern repeats.
    let index = BlendingIndex::build(&[1.0, 3.0], 8).unwrap();
    assert_eq!(index.dataset_indices(), [1, 0, 1, 1, 1, 0, 1, 1]);
    assert_eq!(index.samples_per_dataset(), [2, 6]);
}

#[test]
fn weights_are_normalized() {
    let a = BlendingIndex::build(&[2.0, 6.0, 0.5], 500).unwrap();
    let b = BlendingIndex::build(&[0.25, 0.75, 0.0625], 500).unwrap();
    assert_eq!(a, b);
}

#[test]
fn huge_weights_do_not_overflow() {
    let index = BlendingIndex::build(&[1.0, f64::MAX, f64::MAX], 4).unwrap();
    assert_eq!(index.dataset_indices(), [1, 2, 1, 2]);
}

#[test]
fn bad_weights_are_errors() {
    assert!(matches!(
        BlendingIndex::build(&[], 5),
        Err(DataError::NoDatasets)
    ));
    for (weights, bad) in [
        (vec![1.0, 0.0], 1),
        (vec![-1.0, 1.0], 0),
        (vec![1.0, f64::NAN], 1),
        (vec![f64::INFINITY], 0),
    ] {
        let error = BlendingIndex::build(&weights, 5).unwrap_err();
        assert!(
            matches!(error, DataError::BadWeight { dataset, .. } if dataset == bad),
            "{weights:?}: {error}"
        );
    }
}
