use std::path::{Path, PathBuf};

/// Everything that can go wrong writing, committing or verifying a checkpoint.
///
/// Errors about a file name that file, so a message is enough to find the culprit.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("unknown safetensors dtype {0:?}")]
    UnknownDtype(String),

    #[error("{path}: tensor {name:?} has {actual} bytes but its dtype and shape need {expected}")]
    TensorSize {
        path: PathBuf,
        name: String,
        expected: u128,
        actual: usize,
    },

    #[error("{path}: tensor {name:?} appears twice")]
    DuplicateTensor { path: PathBuf, name: String },

    #[error("{path}: \"__metadata__\" is reserved by safetensors and cannot name a tensor")]
    ReservedTensorName { path: PathBuf },

    #[error("{directory}: {name:?} is not a plain file name")]
    BadFileName { directory: PathBuf, name: String },

    #[error("{directory}: file {name:?} is listed twice")]
    DuplicateFile { directory: PathBuf, name: String },

    #[error("{directory}: no manifest.json (the checkpoint was never committed)")]
    MissingManifest { directory: PathBuf },

    #[error("{path}: bad manifest: {reason}")]
    BadManifest { path: PathBuf, reason: String },

    #[error("{path}: {actual} bytes but the manifest says {expected} (truncated or overwritten)")]
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    #[error("{path}: checksum {actual} but the manifest says {expected} (corrupt)")]
    ChecksumMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("{path}: already exists; a committed checkpoint is never replaced")]
    AlreadyExists { path: PathBuf },

    #[error("{directory}: a checkpoint writer thread panicked")]
    WriterPanicked { directory: PathBuf },

    #[error("{root}: no valid checkpoint among the committed ones: {reasons}")]
    NoValidCheckpoint { root: PathBuf, reasons: String },
}

impl CheckpointError {
    /// For `map_err`: an I/O error about `path`.
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}
