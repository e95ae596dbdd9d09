//! `fastllm._native.TokenDataset`: a memory-mapped Megatron indexed dataset.

use std::path::PathBuf;

use fastllm_data::IndexedDataset;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;

use crate::errors::data_error;

/// Tokens `begin..end` of a document.
type Span = (u32, u32);

#[pyclass(frozen, module = "fastllm._native")]
pub struct TokenDataset {
    inner: IndexedDataset,
}

#[pymethods]
impl TokenDataset {
    /// Open `prefix.bin` + `prefix.idx`, checking the header and the file sizes.
    #[new]
    fn open(py: Python<'_>, prefix: PathBuf) -> PyResult<Self> {
        let inner = py
            .detach(|| IndexedDataset::open(&prefix))
            .map_err(data_error)?;
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens()
    }

    /// The on-disk token dtype as a numpy name (`uint16`, `int32`, …).
    #[getter]
    fn dtype(&self) -> String {
        self.inner.dtype().to_string()
    }

    /// Raise TokenRangeError naming the first document with an id outside `0..vocab_size`:
    /// the id range of the `.bin` file is scanned once, then read from `cache_dir`.
    fn check_token_range(
        &self,
        py: Python<'_>,
        vocab_size: u64,
        cache_dir: PathBuf,
    ) -> PyResult<()> {
        py.detach(|| self.inner.check_token_range(vocab_size, &cache_dir))
            .map_err(data_error)
    }

    /// Token count of every document.
    fn document_lengths<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, self.inner.document_lengths())
    }

    /// Whether a `.spans` sidecar masks tokens from the loss.
    #[getter]
    fn has_loss_spans(&self) -> bool {
        self.inner.loss_spans().is_some()
    }

    /// The masked token ranges `(begin, end)` of document `index` (none without a sidecar).
    fn loss_spans(&self, index: usize) -> PyResult<Vec<(u32, u32)>> {
        if index >= self.inner.len() {
            return Err(PyIndexError::new_err(format!(
                "document {index} out of range ({} documents)",
                self.inner.len()
            )));
        }
        Ok(self.inner.loss_spans().map_or_else(Vec::new, |spans| {
            spans
                .document(index)
                .iter()
                .map(|&[begin, end]| (begin, end))
                .collect()
        }))
    }

    /// Whether a `.preference` sidecar says where each pair's answers lie.
    #[getter]
    fn is_preference(&self) -> bool {
        self.inner.preference_spans().is_some()
    }

    /// The chosen and rejected token spans `((begin, end), (begin, end))` of pair `index`
    /// (None without a sidecar).
    fn preference_spans(&self, index: usize) -> PyResult<Option<(Span, Span)>> {
        if index >= self.inner.len() {
            return Err(PyIndexError::new_err(format!(
                "document {index} out of range ({} documents)",
                self.inner.len()
            )));
        }
        Ok(self.inner.preference_spans().map(|spans| {
            let pair = spans.pair(index);
            let [chosen, rejected] = [pair.chosen, pair.rejected];
            ((chosen[0], chosen[1]), (rejected[0], rejected[1]))
        }))
    }

    /// The tokens of document `index` as int64.
    fn document<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let tokens = self.inner.document(index).map_err(data_error)?;
        let array = PyArray1::<i64>::zeros(py, tokens.len(), false);
        {
            let mut view = array.readwrite();
            tokens.copy_to(view.as_slice_mut().expect("a new array is contiguous"));
        }
        Ok(array)
    }
}
