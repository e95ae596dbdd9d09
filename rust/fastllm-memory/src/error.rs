/// Everything that can go wrong building a layout or asking it a question.
///
/// Errors about a parameter name it, so a message is enough to find the culprit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("data-parallel size must be at least 1")]
    ZeroDataSize,

    #[error("alignment must be at least 1 element")]
    ZeroAlignment,

    #[error("parameter {name:?} appears twice (indices {first} and {second})")]
    DuplicateName {
        name: String,
        first: usize,
        second: usize,
    },

    #[error(
        "parameter {name:?} (index {index}) is in stage {stage} after a parameter of stage \
         {previous}: parameters must be listed in stage order"
    )]
    StageOutOfOrder {
        name: String,
        index: usize,
        stage: u32,
        previous: u32,
    },

    #[error("alignment {alignment} × data-parallel size {data_size} does not fit 64 bits")]
    ShardAlignmentOverflow { alignment: u64, data_size: u32 },

    #[error("the layout does not fit 64-bit element offsets (at stage {stage})")]
    Overflow { stage: u32 },

    #[error("stage {stage} out of range: the layout has {num_stages} stages")]
    StageOutOfRange { stage: u32, num_stages: usize },

    #[error("rank {rank} out of range: the data-parallel size is {data_size}")]
    RankOutOfRange { rank: u32, data_size: u32 },

    #[error("parameter index {index} out of range: the layout has {num_parameters} parameters")]
    ParameterOutOfRange { index: usize, num_parameters: usize },

    #[error("no parameter named {name:?}")]
    UnknownParameter { name: String },
}
