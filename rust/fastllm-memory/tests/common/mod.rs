//! Random models and configs shared by the property tests.

use fastllm_memory::{LayoutConfig, ParameterSpec};
use proptest::prelude::*;

/// Up to five stages of up to five parameters, some empty, named `s{stage}.p{i}`.
pub fn specs() -> impl Strategy<Value = Vec<ParameterSpec>> {
    let numel = prop_oneof![Just(0u64), 1u64..40, 100u64..300];
    prop::collection::vec(prop::collection::vec((numel, any::<bool>()), 1..6), 0..6).prop_map(
        |stages| {
            stages
                .into_iter()
                .enumerate()
                .flat_map(|(stage, parameters)| {
                    parameters
                        .into_iter()
                        .enumerate()
                        .map(move |(i, (numel, weight_decay))| ParameterSpec {
                            name: format!("s{stage}.p{i}"),
                            numel,
                            stage: stage as u32,
                            weight_decay,
                        })
                })
                .collect()
        },
    )
}

/// Alignments need not be powers of two.
pub fn config() -> impl Strategy<Value = LayoutConfig> {
    (1u64..12, 1u32..7).prop_map(|(alignment, data_size)| LayoutConfig {
        alignment,
        data_size,
    })
}
