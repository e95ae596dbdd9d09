//! Parameters placed in per-stage flat buffers.

use std::collections::HashMap;
use std::ops::Range;

use crate::{LayoutError, Shard};

/// One parameter as the model declares it, in model order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParameterSpec {
    pub name: String,
    pub numel: u64,
    /// Stages are numbered 0, 1, 2, … in model order, so the list's stages never decrease; a
    /// stage none of the parameters is in is an empty buffer.
    pub stage: u32,
    pub weight_decay: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutConfig {
    /// Every parameter starts at a multiple of this many elements, and so does every shard.
    pub alignment: u64,
    /// Data-parallel ranks that split each stage into equal shards.
    pub data_size: u32,
}

/// A parameter and where it lives: elements `offset..offset + numel` of its stage's buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlacedParameter {
    pub name: String,
    pub stage: u32,
    pub offset: u64,
    pub numel: u64,
    pub weight_decay: bool,
}

impl PlacedParameter {
    /// The parameter's elements within its stage's buffer.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.numel
    }
}

/// One stage's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stage {
    /// Indices of the stage's parameters in the layout's parameter list.
    pub parameters: Range<usize>,
    /// Elements in the buffer: its parameters with the padding between them, rounded up to a
    /// multiple of `data_size * alignment` so that every rank's shard is equal and aligned.
    pub size: u64,
    /// Elements in each rank's shard: `size / data_size`, a multiple of the alignment.
    pub shard_size: u64,
}

/// The flat-buffer layout of a model's parameters.
///
/// Parameters are placed in list order, each at the next multiple of the alignment. A parameter's
/// offset does not depend on the data-parallel size; only the padding at the end of each stage does, so
/// layouts of one model for different data-parallel sizes describe the same parameters.
#[derive(Clone, Debug)]
pub struct Layout {
    config: LayoutConfig,
    parameters: Vec<PlacedParameter>,
    stages: Vec<Stage>,
    by_name: HashMap<String, usize>,
    num_elements: u64,
}

impl Layout {
    /// Places `parameters`, given in model order, or says which one cannot be placed.
    pub fn new(parameters: Vec<ParameterSpec>, config: LayoutConfig) -> Result<Self, LayoutError> {
        if config.data_size == 0 {
            return Err(LayoutError::ZeroDataSize);
        }
        if config.alignment == 0 {
            return Err(LayoutError::ZeroAlignment);
        }
        let mut builder = Builder {
            granule: config
                .alignment
                .checked_mul(u64::from(config.data_size))
                .ok_or(LayoutError::ShardAlignmentOverflow {
                    alignment: config.alignment,
                    data_size: config.data_size,
                })?,
            data_size: config.data_size,
            stages: Vec::new(),
            num_elements: 0,
        };
        let mut placed: Vec<PlacedParameter> = Vec::with_capacity(parameters.len());
        let mut by_name = HashMap::with_capacity(parameters.len());
        let mut stage_start = 0;
        let mut end = 0;
        for (index, spec) in parameters.into_iter().enumerate() {
            if let Some(&first) = by_name.get(&spec.name) {
                return Err(LayoutError::DuplicateName {
                    name: spec.name,
                    first,
                    second: index,
                });
            }
            let current = placed.last().map(|previous| previous.stage);
            if current != Some(spec.stage) {
                if let Some(previous) = current.filter(|&previous| spec.stage < previous) {
                    return Err(LayoutError::StageOutOfOrder {
                        name: spec.name,
                        index,
                        stage: spec.stage,
                        previous,
                    });
                }
                if let Some(stage) = current {
                    builder.finish_stage(stage, stage_start..index, end)?;
                }
                // Stages without parameters (all frozen, say) are empty buffers.
                while builder.stages.len() < spec.stage as usize {
                    builder.empty_stage(index);
                }
                stage_start = index;
                end = 0;
            }
            let overflow = LayoutError::Overflow { stage: spec.stage };
            let offset = end
                .checked_next_multiple_of(config.alignment)
                .ok_or(overflow.clone())?;
            end = offset.checked_add(spec.numel).ok_or(overflow)?;
            by_name.insert(spec.name.clone(), index);
            placed.push(PlacedParameter {
                name: spec.name,
                stage: spec.stage,
                offset,
                numel: spec.numel,
                weight_decay: spec.weight_decay,
            });
        }
        if let Some(last) = placed.last() {
            builder.finish_stage(last.stage, stage_start..placed.len(), end)?;
        }
        Ok(Self {
            config,
            parameters: placed,
            stages: builder.stages,
            by_name,
            num_elements: builder.num_elements,
        })
    }

    /// The same layout with empty stages appended up to `num_stages` (a model's stages past
    /// the last that holds one of these parameters).
    pub fn padded_to(mut self, num_stages: u32) -> Result<Self, LayoutError> {
        if (num_stages as usize) < self.stages.len() {
            return Err(LayoutError::StageOutOfRange {
                stage: self.stages.len() as u32 - 1,
                num_stages: num_stages as usize,
            });
        }
        let end = self.parameters.len();
        self.stages.resize(
            num_stages as usize,
            Stage {
                parameters: end..end,
                size: 0,
                shard_size: 0,
            },
        );
        Ok(self)
    }

    pub fn config(&self) -> LayoutConfig {
        self.config
    }

    /// Elements in all stage buffers together, padding included.
    pub fn num_elements(&self) -> u64 {
        self.num_elements
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    pub fn stage(&self, stage: u32) -> Result<&Stage, LayoutError> {
        self.stages
            .get(stage as usize)
            .ok_or(LayoutError::StageOutOfRange {
                stage,
                num_stages: self.stages.len(),
            })
    }

    pub fn parameters(&self) -> &[PlacedParameter] {
        &self.parameters
    }

    pub fn parameter(&self, index: usize) -> Result<&PlacedParameter, LayoutError> {
        self.parameters
            .get(index)
            .ok_or(LayoutError::ParameterOutOfRange {
                index,
                num_parameters: self.parameters.len(),
            })
    }

    pub fn parameter_index(&self, name: &str) -> Result<usize, LayoutError> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| LayoutError::UnknownParameter {
                name: name.to_owned(),
            })
    }

    /// The part of stage `stage` that rank `rank` owns.
    pub fn shard(&self, stage: u32, rank: u32) -> Result<Shard<'_>, LayoutError> {
        let stage_layout = self.stage(stage)?;
        self.check_rank(rank)?;
        let start = u64::from(rank) * stage_layout.shard_size;
        Ok(Shard::new(
            stage,
            &self.parameters[stage_layout.parameters.clone()],
            stage_layout.parameters.start,
            start..start + stage_layout.shard_size,
        ))
    }

    pub(crate) fn check_rank(&self, rank: u32) -> Result<(), LayoutError> {
        if rank < self.config.data_size {
            Ok(())
        } else {
            Err(LayoutError::RankOutOfRange {
                rank,
                data_size: self.config.data_size,
            })
        }
    }
}

/// Closes stages one after the other as `Layout::new` walks the parameters.
struct Builder {
    granule: u64,
    data_size: u32,
    stages: Vec<Stage>,
    num_elements: u64,
}

impl Builder {
    /// A stage without parameters, before the parameter at `index`.
    fn empty_stage(&mut self, index: usize) {
        self.stages.push(Stage {
            parameters: index..index,
            size: 0,
            shard_size: 0,
        });
    }

    /// Pads the stage whose last parameter ends at `end` and counts it in the total.
    fn finish_stage(
        &mut self,
        stage: u32,
        parameters: Range<usize>,
        end: u64,
    ) -> Result<(), LayoutError> {
        let overflow = LayoutError::Overflow { stage };
        let size = end
            .checked_next_multiple_of(self.granule)
            .ok_or(overflow.clone())?;
        self.num_elements = self.num_elements.checked_add(size).ok_or(overflow)?;
        self.stages.push(Stage {
            parameters,
            size,
            shard_size: size / u64::from(self.data_size),
        });
        Ok(())
    }
}
