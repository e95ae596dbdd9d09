mod common;

use fastllm_memory::{reshard_plan, Layout, LayoutConfig, LayoutError, ParameterSpec};
use proptest::prelude::*;

/// Element `e` of parameter `p` holds a value unique to both, padding holds 0.
fn value(parameter: usize, element: u64) -> u64 {
    ((parameter as u64) << 32 | element) + 1
}

/// Each rank's shard of each stage, filled with `value`s; parameters keyed by `names` index.
fn filled_shards(layout: &Layout, names: &[ParameterSpec]) -> Vec<Vec<Vec<u64>>> {
    (0..layout.config().world_size)
        .map(|rank| {
            (0..layout.stages().len() as u32)
                .map(|stage| {
                    let shard = layout.shard(stage, rank).unwrap();
                    let mut buffer = vec![0; (shard.range().end - shard.range().start) as usize];
                    for piece in shard.pieces() {
                        let name = &layout.parameter(piece.parameter).unwrap().name;
                        let key = names.iter().position(|spec| &spec.name == name).unwrap();
                        for (at, element) in piece.shard_range.zip(piece.parameter_range) {
                            buffer[at as usize] = value(key, element);
                        }
                    }
                    buffer
                })
                .collect()
        })
        .collect()
}

fn config(alignment: u64, world_size: u32) -> LayoutConfig {
    LayoutConfig {
        alignment,
        world_size,
    }
}

fn spec(name: &str, numel: u64) -> ParameterSpec {
    ParameterSpec {
        name: name.to_owned(),
        numel,
        stage: 0,
        weight_decay: true,
    }
}

proptest! {
    #[test]
    fn resharding_fills_every_target_shard_from_the_source_shards(
        specs in common::specs(),
        from_config in common::config(),
        to_config in common::config(),
        merge_source_stages in any::<bool>(),
        reverse_source_order in any::<bool>(),
    ) {
        // The source may group and order the same parameters differently.
        let mut source_specs = specs.clone();
        if merge_source_stages {
            source_specs.iter_mut().for_each(|spec| spec.stage = 0);
            if reverse_source_order {
                source_specs.reverse();
            }
        }
        let from = Layout::new(source_specs, from_config).unwrap();
        let to = Layout::new(specs.clone(), to_config).unwrap();
        let sources = filled_shards(&from, &specs);
        let expected = filled_shards(&to, &specs);
        for to_rank in 0..to_config.world_size {
            let mut written: Vec<Vec<u64>> =
                expected[to_rank as usize].iter().map(|stage| vec![0; stage.len()]).collect();
            let mut writes: Vec<Vec<u32>> =
                expected[to_rank as usize].iter().map(|stage| vec![0; stage.len()]).collect();
            for from_rank in 0..from_config.world_size {
                for copy in reshard_plan(&from, from_rank, &to, to_rank).unwrap() {
                    let source = &sources[from_rank as usize][copy.from_stage as usize];
                    let target = &mut written[copy.to_stage as usize];
                    let count = &mut writes[copy.to_stage as usize];
                    prop_assert_eq!(
                        copy.from_range.end - copy.from_range.start,
                        copy.to_range.end - copy.to_range.start
                    );
                    for (from_at, to_at) in copy.from_range.zip(copy.to_range) {
                        target[to_at as usize] = source[from_at as usize];
                        count[to_at as usize] += 1;
                    }
                }
            }
            prop_assert_eq!(&written, &expected[to_rank as usize]);
            for (stage, counts) in writes.iter().enumerate() {
                for (at, &count) in counts.iter().enumerate() {
                    let is_parameter = expected[to_rank as usize][stage][at] != 0;
                    prop_assert_eq!(count, u32::from(is_parameter));
                }
            }
        }
    }
}

#[test]
fn resharding_to_the_same_layout_copies_each_parameter_piece_in_place() {
    let layout = Layout::new(vec![spec("a", 5), spec("b", 7)], config(4, 2)).unwrap();
    let plan = reshard_plan(&layout, 1, &layout, 1).unwrap();
    let pieces: Vec<_> = plan
        .iter()
        .map(|copy| {
            (
                copy.parameter,
                copy.from_range.clone(),
                copy.to_range.clone(),
            )
        })
        .collect();
    assert_eq!(pieces, [(1, 0..7, 0..7)]);
    assert!(reshard_plan(&layout, 0, &layout, 1).unwrap().is_empty());
}

#[test]
fn resharding_needs_the_same_parameters_with_the_same_sizes() {
    let from = Layout::new(vec![spec("a", 5), spec("b", 7)], config(1, 1)).unwrap();
    let resized = Layout::new(vec![spec("a", 5), spec("b", 8)], config(1, 1)).unwrap();
    assert_eq!(
        reshard_plan(&from, 0, &resized, 0),
        Err(LayoutError::NumelMismatch {
            name: "b".to_owned(),
            from: 7,
            to: 8
        })
    );
    let renamed = Layout::new(vec![spec("a", 5), spec("c", 7)], config(1, 1)).unwrap();
    assert_eq!(
        reshard_plan(&from, 0, &renamed, 0),
        Err(LayoutError::ParameterNotShared {
            name: "c".to_owned()
        })
    );
    let fewer = Layout::new(vec![spec("a", 5)], config(1, 1)).unwrap();
    assert_eq!(
        reshard_plan(&from, 0, &fewer, 0),
        Err(LayoutError::ParameterNotShared {
            name: "b".to_owned()
        })
    );
    assert_eq!(
        reshard_plan(&from, 1, &from, 0),
        Err(LayoutError::RankOutOfRange {
            rank: 1,
            world_size: 1
        })
    );
}
