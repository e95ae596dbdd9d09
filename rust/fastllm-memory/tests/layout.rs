mod common;

use fastllm_memory::{Layout, LayoutConfig, LayoutError, ParameterSpec, PlacedParameter};
use proptest::prelude::*;

fn spec(name: &str, numel: u64, stage: u32, weight_decay: bool) -> ParameterSpec {
    ParameterSpec {
        name: name.to_owned(),
        numel,
        stage,
        weight_decay,
    }
}

fn config(alignment: u64, data_size: u32) -> LayoutConfig {
    LayoutConfig {
        alignment,
        data_size,
    }
}

fn error(parameters: Vec<ParameterSpec>, config: LayoutConfig) -> LayoutError {
    Layout::new(parameters, config).unwrap_err()
}

#[test]
fn places_parameters_at_aligned_offsets_and_pads_stages_to_equal_aligned_shards() {
    let layout = Layout::new(
        vec![
            spec("a", 5, 0, true),
            spec("b", 3, 0, false),
            spec("c", 8, 1, true),
        ],
        config(4, 2),
    )
    .unwrap();
    let offsets: Vec<_> = layout
        .parameters()
        .iter()
        .map(|p| (p.stage, p.offset, p.numel))
        .collect();
    assert_eq!(offsets, [(0, 0, 5), (0, 8, 3), (1, 0, 8)]);
    let sizes: Vec<_> = layout
        .stages()
        .iter()
        .map(|s| (s.parameters.clone(), s.size, s.shard_size))
        .collect();
    assert_eq!(sizes, [(0..2, 16, 8), (2..3, 8, 4)]);
    assert_eq!(layout.num_elements(), 24);
}

#[test]
fn empty_parameters_take_no_space() {
    let layout = Layout::new(
        vec![
            spec("a", 3, 0, true),
            spec("empty", 0, 0, true),
            spec("b", 1, 0, true),
        ],
        config(2, 1),
    )
    .unwrap();
    let offsets: Vec<_> = layout.parameters().iter().map(|p| p.offset).collect();
    assert_eq!(offsets, [0, 4, 4]);
    assert_eq!(layout.stage(0).unwrap().size, 6);
}

#[test]
fn a_model_without_parameters_has_no_stages() {
    let layout = Layout::new(Vec::new(), config(8, 4)).unwrap();
    assert!(layout.stages().is_empty());
    assert_eq!(layout.num_elements(), 0);
}

#[test]
fn looks_parameters_up_by_index_and_name() {
    let layout = Layout::new(
        vec![spec("embed", 10, 0, false), spec("head", 7, 1, true)],
        config(4, 1),
    )
    .unwrap();
    assert_eq!(layout.parameter_index("head"), Ok(1));
    assert_eq!(
        layout.parameter(1),
        Ok(&PlacedParameter {
            name: "head".to_owned(),
            stage: 1,
            offset: 0,
            numel: 7,
            weight_decay: true,
        })
    );
    assert_eq!(
        layout.parameter_index("tail"),
        Err(LayoutError::UnknownParameter {
            name: "tail".to_owned()
        })
    );
    assert_eq!(
        layout.parameter(2),
        Err(LayoutError::ParameterOutOfRange {
            index: 2,
            num_parameters: 2
        })
    );
    assert_eq!(
        layout.stage(2),
        Err(LayoutError::StageOutOfRange {
            stage: 2,
            num_stages: 2
        })
    );
    assert_eq!(
        layout.shard(0, 1).unwrap_err(),
        LayoutError::RankOutOfRange {
            rank: 1,
            data_size: 1
        }
    );
}

#[test]
fn rejects_a_zero_data_size_or_alignment() {
    assert_eq!(error(Vec::new(), config(1, 0)), LayoutError::ZeroDataSize);
    assert_eq!(error(Vec::new(), config(0, 1)), LayoutError::ZeroAlignment);
}

#[test]
fn rejects_duplicate_names() {
    let parameters = vec![
        spec("w", 1, 0, true),
        spec("v", 1, 0, true),
        spec("w", 1, 1, true),
    ];
    assert_eq!(
        error(parameters, config(1, 1)),
        LayoutError::DuplicateName {
            name: "w".to_owned(),
            first: 0,
            second: 2
        }
    );
}

#[test]
fn rejects_stages_out_of_order() {
    let parameters = vec![
        spec("a", 1, 0, true),
        spec("b", 1, 1, true),
        spec("c", 1, 0, true),
    ];
    let out_of_order = error(parameters, config(1, 1));
    assert_eq!(
        out_of_order,
        LayoutError::StageOutOfOrder {
            name: "c".to_owned(),
            index: 2,
            stage: 0,
            previous: 1
        }
    );
    assert!(out_of_order.to_string().contains("\"c\""));
}

#[test]
fn stages_without_parameters_are_empty_buffers() {
    // Frozen parameters leave stages of the trained ones empty: before, between and after.
    let parameters = vec![spec("a", 3, 1, true), spec("b", 5, 3, true)];
    let layout = Layout::new(parameters, config(4, 2))
        .unwrap()
        .padded_to(6)
        .unwrap();
    let sizes: Vec<(u64, u64)> = layout
        .stages()
        .iter()
        .map(|stage| (stage.size, stage.shard_size))
        .collect();
    assert_eq!(sizes, [(0, 0), (8, 4), (0, 0), (8, 4), (0, 0), (0, 0)]);
    let stages: Vec<_> = layout
        .stages()
        .iter()
        .map(|s| s.parameters.clone())
        .collect();
    assert_eq!(stages, [0..0, 0..1, 1..1, 1..2, 2..2, 2..2]);
    assert_eq!(layout.shard(2, 1).unwrap().range(), 0..0);
    assert!(matches!(
        layout.padded_to(3),
        Err(LayoutError::StageOutOfRange {
            stage: 5,
            num_stages: 3
        })
    ));
}

#[test]
fn rejects_layouts_beyond_64_bit_offsets() {
    let aligned_past_the_end = vec![spec("a", 1, 0, true), spec("b", u64::MAX - 1, 0, true)];
    assert_eq!(
        error(aligned_past_the_end, config(2, 1)),
        LayoutError::Overflow { stage: 0 }
    );
    let padded_past_the_end = vec![spec("a", u64::MAX, 0, true)];
    assert_eq!(
        error(padded_past_the_end, config(1, 2)),
        LayoutError::Overflow { stage: 0 }
    );
    let total_past_the_end = vec![spec("a", 1 << 63, 0, true), spec("b", 1 << 63, 1, true)];
    assert_eq!(
        error(total_past_the_end, config(1, 1)),
        LayoutError::Overflow { stage: 1 }
    );
    assert_eq!(
        error(Vec::new(), config(u64::MAX, 2)),
        LayoutError::ShardAlignmentOverflow {
            alignment: u64::MAX,
            data_size: 2
        }
    );
}

proptest! {
    #[test]
    fn parameters_are_aligned_never_overlap_and_padding_is_minimal(
        specs in common::specs(),
        config in common::config(),
    ) {
        let layout = Layout::new(specs.clone(), config).unwrap();
        prop_assert_eq!(layout.parameters().len(), specs.len());
        let granule = config.alignment * u64::from(config.data_size);
        let mut total = 0;
        for (stage_index, stage) in layout.stages().iter().enumerate() {
            let mut end = 0;
            for index in stage.parameters.clone() {
                let parameter = layout.parameter(index).unwrap();
                let spec = &specs[index];
                prop_assert_eq!(
                    (&parameter.name, parameter.numel, parameter.stage, parameter.weight_decay),
                    (&spec.name, spec.numel, stage_index as u32, spec.weight_decay)
                );
                prop_assert_eq!(parameter.offset % config.alignment, 0);
                prop_assert!(parameter.offset >= end);
                // Each parameter sits at the first aligned offset after the previous one.
                prop_assert!(parameter.offset < end + config.alignment);
                end = parameter.range().end;
            }
            prop_assert_eq!(stage.size % granule, 0);
            prop_assert!(stage.size >= end && stage.size < end + granule);
            prop_assert_eq!(stage.shard_size * u64::from(config.data_size), stage.size);
            total += stage.size;
        }
        prop_assert_eq!(layout.num_elements(), total);
        let listed: usize = layout.stages().iter().map(|s| s.parameters.len()).sum();
        prop_assert_eq!(listed, specs.len());
    }

    #[test]
    fn every_parameter_is_found_by_its_name(specs in common::specs(), config in common::config()) {
        let layout = Layout::new(specs.clone(), config).unwrap();
        for (index, spec) in specs.iter().enumerate() {
            prop_assert_eq!(layout.parameter_index(&spec.name), Ok(index));
        }
    }

    #[test]
    fn layouts_for_different_data_sizes_place_the_same_parameters_alike(
        specs in common::specs(),
        alignment in 1u64..12,
        data_sizes in (1u32..9, 1u32..9),
    ) {
        let small = Layout::new(specs.clone(), LayoutConfig { alignment, data_size: data_sizes.0 })
            .unwrap();
        let large = Layout::new(specs, LayoutConfig { alignment, data_size: data_sizes.1 })
            .unwrap();
        prop_assert_eq!(small.parameters(), large.parameters());
        prop_assert_eq!(small.stages().len(), large.stages().len());
    }
}
