use std::path::PathBuf;

/// Why a `tokenizer.json` could not be turned into a [`crate::ByteLevelBpe`].
#[derive(Debug, thiserror::Error)]
pub enum BpeError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a tokenizer.json: {0}")]
    Json(#[from] serde_json::Error),
    /// A valid tokenizer whose output this encoder does not reproduce exactly: encode it with
    /// the `tokenizers` crate instead.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// A tokenizer the `tokenizers` crate refuses to load as well.
    #[error("invalid tokenizer: {0}")]
    Invalid(String),
}
