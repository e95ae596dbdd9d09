//! Rust errors as Python exceptions: I/O and format problems become `OSError`/`ValueError`
//! with the crate's message, which already names the file; a token id outside the model's
//! vocabulary is a `TokenRangeError`, which Python reports as bad input.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::PyErr;

create_exception!(
    fastllm._native,
    TokenRangeError,
    PyValueError,
    "A dataset holds a token id outside the model's vocabulary."
);

create_exception!(
    fastllm._native,
    Cancelled,
    PyException,
    "Work stopped at the caller's request before it finished; it left nothing behind."
);

pub fn data_error(error: fastllm_data::DataError) -> PyErr {
    match error {
        fastllm_data::DataError::Io { .. } => PyOSError::new_err(error.to_string()),
        fastllm_data::DataError::BeyondVocabulary { .. } => {
            TokenRangeError::new_err(error.to_string())
        }
        fastllm_data::DataError::Cancelled => Cancelled::new_err(error.to_string()),
        _ => PyValueError::new_err(error.to_string()),
    }
}
