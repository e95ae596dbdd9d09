mod common;

use fastllm_memory::{DecayRun, Layout, LayoutConfig, ParameterSpec, ShardPiece};
use proptest::prelude::*;

fn spec(name: &str, numel: u64, weight_decay: bool) -> ParameterSpec {
    ParameterSpec {
        name: name.to_owned(),
        numel,
        stage: 0,
        weight_decay,
    }
}

fn piece(parameter: usize, parameter_start: u64, shard_start: u64, len: u64) -> ShardPiece {
    ShardPiece {
        parameter,
        parameter_range: parameter_start..parameter_start + len,
        shard_range: shard_start..shard_start + len,
    }
}

fn run(start: u64, end: u64, weight_decay: bool) -> DecayRun {
    DecayRun {
        range: start..end,
        weight_decay,
    }
}

/// Stage 0 of alignment 4, data-parallel size 2: `w` 0..6, `norm` 8..9, `v` 12..22, padded to 24.
fn example() -> Layout {
    Layout::new(
        vec![
            spec("w", 6, true),
            spec("norm", 1, false),
            spec("v", 10, true),
        ],
        LayoutConfig {
            alignment: 4,
            data_size: 2,
        },
    )
    .unwrap()
}

#[test]
fn splits_parameters_at_shard_boundaries() {
    let layout = example();
    let first = layout.shard(0, 0).unwrap();
    assert_eq!(first.range(), 0..12);
    assert_eq!(first.pieces(), [piece(0, 0, 0, 6), piece(1, 0, 8, 1)]);
    let second = layout.shard(0, 1).unwrap();
    assert_eq!(second.range(), 12..24);
    assert_eq!(second.pieces(), [piece(2, 0, 0, 10)]);
    assert_eq!(second.piece(0), None);
    assert_eq!(second.piece(2), Some(piece(2, 0, 0, 10)));
}

#[test]
fn decay_runs_give_padding_to_the_run_before_it() {
    let layout = example();
    assert_eq!(
        layout.shard(0, 0).unwrap().decay_runs(),
        [run(0, 8, true), run(8, 12, false)]
    );
    assert_eq!(layout.shard(0, 1).unwrap().decay_runs(), [run(0, 12, true)]);
}

#[test]
fn a_shard_of_padding_only_is_one_run_without_decay() {
    let layout = Layout::new(
        vec![spec("w", 3, true)],
        LayoutConfig {
            alignment: 2,
            data_size: 4,
        },
    )
    .unwrap();
    let last = layout.shard(0, 3).unwrap();
    assert!(last.pieces().is_empty());
    assert_eq!(last.decay_runs(), [run(0, 2, false)]);
}

proptest! {
    #[test]
    fn shards_of_a_stage_partition_it_into_equal_aligned_ranges(
        specs in common::specs(),
        config in common::config(),
    ) {
        let layout = Layout::new(specs, config).unwrap();
        for (stage_index, stage) in layout.stages().iter().enumerate() {
            let mut end = 0;
            for rank in 0..config.data_size {
                let range = layout.shard(stage_index as u32, rank).unwrap().range();
                prop_assert_eq!(range.start, end);
                prop_assert_eq!(range.start % config.alignment, 0);
                prop_assert_eq!(range.end - range.start, stage.shard_size);
                end = range.end;
            }
            prop_assert_eq!(end, stage.size);
        }
    }

    #[test]
    fn every_parameter_element_is_owned_by_exactly_one_rank(
        specs in common::specs(),
        config in common::config(),
    ) {
        let layout = Layout::new(specs, config).unwrap();
        // Per parameter, the end of the elements the ranks so far have claimed, in rank order.
        let mut claimed = vec![0u64; layout.parameters().len()];
        for stage in 0..layout.stages().len() as u32 {
            for rank in 0..config.data_size {
                let shard = layout.shard(stage, rank).unwrap();
                let mut shard_end = 0;
                for piece in shard.pieces() {
                    let parameter = layout.parameter(piece.parameter).unwrap();
                    prop_assert_eq!(parameter.stage, stage);
                    prop_assert_eq!(piece.parameter_range.start, claimed[piece.parameter]);
                    prop_assert!(piece.parameter_range.start < piece.parameter_range.end);
                    prop_assert_eq!(
                        piece.shard_range.end - piece.shard_range.start,
                        piece.parameter_range.end - piece.parameter_range.start
                    );
                    // The piece is the same elements seen from the stage buffer.
                    prop_assert_eq!(
                        shard.range().start + piece.shard_range.start,
                        parameter.offset + piece.parameter_range.start
                    );
                    prop_assert!(piece.shard_range.start >= shard_end);
                    prop_assert!(piece.shard_range.end <= shard.range().end - shard.range().start);
                    prop_assert_eq!(shard.piece(piece.parameter), Some(piece.clone()));
                    shard_end = piece.shard_range.end;
                    claimed[piece.parameter] = piece.parameter_range.end;
                }
            }
        }
        let numels: Vec<u64> = layout.parameters().iter().map(|p| p.numel).collect();
        prop_assert_eq!(claimed, numels);
    }

    #[test]
    fn decay_runs_cover_the_shard_in_aligned_maximal_runs_of_the_parameters_flags(
        specs in common::specs(),
        config in common::config(),
    ) {
        let layout = Layout::new(specs, config).unwrap();
        for stage in 0..layout.stages().len() as u32 {
            for rank in 0..config.data_size {
                let shard = layout.shard(stage, rank).unwrap();
                let runs = shard.decay_runs();
                let mut end = 0;
                for (i, run) in runs.iter().enumerate() {
                    prop_assert_eq!(run.range.start, end);
                    prop_assert!(run.range.start < run.range.end);
                    prop_assert_eq!(run.range.start % config.alignment, 0);
                    if i > 0 {
                        prop_assert_ne!(run.weight_decay, runs[i - 1].weight_decay);
                    }
                    end = run.range.end;
                }
                prop_assert_eq!(end, shard.range().end - shard.range().start);
                for piece in shard.pieces() {
                    let weight_decay = layout.parameter(piece.parameter).unwrap().weight_decay;
                    let holder = runs.iter().find(|run| {
                        run.range.start <= piece.shard_range.start
                            && piece.shard_range.end <= run.range.end
                    });
                    prop_assert_eq!(holder.map(|run| run.weight_decay), Some(weight_decay));
                }
            }
        }
    }
}
