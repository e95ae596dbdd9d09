//! Moving sharded state (a checkpoint, master weights, optimizer states) between two layouts of
//! the same parameters, e.g. saved with one world size and loaded with another.

use std::ops::Range;

use crate::{Layout, LayoutError};

/// One contiguous copy: elements of one parameter from a source shard into a target shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReshardCopy {
    /// Index of the parameter in the target layout.
    pub parameter: usize,
    pub from_stage: u32,
    /// Within the source rank's shard of `from_stage`.
    pub from_range: Range<u64>,
    pub to_stage: u32,
    /// Within the target rank's shard of `to_stage`; as long as `from_range`.
    pub to_range: Range<u64>,
}

/// The copies that fill rank `to_rank`'s shards of `to` from rank `from_rank`'s shards of `from`,
/// in target order.
///
/// Running the plans of every source rank fills each parameter element of the target shards
/// exactly once; padding is never copied, so target buffers start zeroed. Parameters are matched
/// by name, so the two layouts may differ in world size, alignment, order and stages, but must
/// hold the same parameters with the same sizes.
pub fn reshard_plan(
    from: &Layout,
    from_rank: u32,
    to: &Layout,
    to_rank: u32,
) -> Result<Vec<ReshardCopy>, LayoutError> {
    let sources = match_parameters(from, to)?;
    from.check_rank(from_rank)?;
    to.check_rank(to_rank)?;
    let mut copies = Vec::new();
    for to_stage in 0..to.stages().len() as u32 {
        for target in to.shard(to_stage, to_rank)?.pieces() {
            let source_index = sources[target.parameter];
            let from_stage = from.parameters()[source_index].stage;
            let Some(source) = from.shard(from_stage, from_rank)?.piece(source_index) else {
                continue;
            };
            let start = source
                .parameter_range
                .start
                .max(target.parameter_range.start);
            let end = source.parameter_range.end.min(target.parameter_range.end);
            if start < end {
                let from_start = source.shard_range.start + (start - source.parameter_range.start);
                let to_start = target.shard_range.start + (start - target.parameter_range.start);
                copies.push(ReshardCopy {
                    parameter: target.parameter,
                    from_stage,
                    from_range: from_start..from_start + (end - start),
                    to_stage,
                    to_range: to_start..to_start + (end - start),
                });
            }
        }
    }
    Ok(copies)
}

/// For each parameter of `to`, the index of the same-named parameter in `from`.
fn match_parameters(from: &Layout, to: &Layout) -> Result<Vec<usize>, LayoutError> {
    let sources = to
        .parameters()
        .iter()
        .map(|target| {
            let index = from.parameter_index(&target.name).map_err(|_| {
                LayoutError::ParameterNotShared {
                    name: target.name.clone(),
                }
            })?;
            let source = &from.parameters()[index];
            if source.numel != target.numel {
                return Err(LayoutError::NumelMismatch {
                    name: target.name.clone(),
                    from: source.numel,
                    to: target.numel,
                });
            }
            Ok(index)
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Names are unique, so equal counts mean every source parameter was matched.
    if sources.len() != from.parameters().len() {
        if let Some(extra) = from
            .parameters()
            .iter()
            .find(|source| to.parameter_index(&source.name).is_err())
        {
            return Err(LayoutError::ParameterNotShared {
                name: extra.name.clone(),
            });
        }
    }
    Ok(sources)
}
