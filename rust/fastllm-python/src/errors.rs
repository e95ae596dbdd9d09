//! Rust errors as Python exceptions: I/O and format problems become `OSError`/`ValueError`
//! with the crate's message, which already names the file.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::PyErr;

pub fn data_error(error: fastllm_data::DataError) -> PyErr {
    match error {
        fastllm_data::DataError::Io { .. } => PyOSError::new_err(error.to_string()),
        _ => PyValueError::new_err(error.to_string()),
    }
}
