//! `fastllm._native.SampleSource`: training samples from prepared datasets (sampling index,
//! blending, FIM), written straight into numpy buffers that Python owns; `fastllm._native.Fim`:
//! the same FIM transform for samples made in Python (a data source's).

use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use fastllm_data::{
    Cancel, Fim, FimConfig, FimSplit, IndexedDataset, SampleSource as Source, SampleSourceConfig,
    SamplingMode,
};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::data_error;

/// How often a stoppable build looks at Python's signals and its `stop` callable.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Fill-in-the-middle settings with the special tokens already resolved to ids.
#[pyclass(frozen, module = "fastllm._native", from_py_object)]
#[derive(Clone)]
pub struct FimOptions {
    config: FimConfig,
}

#[pymethods]
impl FimOptions {
    #[new]
    #[pyo3(signature = (*, rate, spm_rate, max_middle_len, split, prefix, middle, suffix, pad, eos))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        rate: f64,
        spm_rate: f64,
        max_middle_len: Option<usize>,
        split: &str,
        prefix: u32,
        middle: u32,
        suffix: u32,
        pad: u32,
        eos: u32,
    ) -> PyResult<Self> {
        let split = match split {
            "token" => FimSplit::Token,
            "character" => FimSplit::Character,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown FIM split {other:?}"
                )))
            }
        };
        let config = FimConfig {
            rate,
            spm_rate,
            max_middle_len,
            split,
            prefix,
            middle,
            suffix,
            pad,
            eos,
        };
        Ok(Self { config })
    }
}

/// The FIM transform of [`SampleSource`], for samples made elsewhere: a sample gets the
/// transform its index and the seed give, wherever it is filled.
#[pyclass(frozen, name = "Fim", module = "fastllm._native")]
pub struct FimTransform {
    inner: Fim,
    seed: u64,
}

#[pymethods]
impl FimTransform {
    /// `tokenizer`: the tokenizer.json of the tokens, for character-level FIM.
    #[new]
    #[pyo3(signature = (options, *, seed, tokenizer=None))]
    fn new(
        py: Python<'_>,
        options: FimOptions,
        seed: u64,
        tokenizer: Option<PathBuf>,
    ) -> PyResult<Self> {
        let inner = py.detach(|| {
            let codec = crate::tokenizer::codec(options.config.split, tokenizer.as_deref())?;
            Fim::new(options.config, codec).map_err(data_error)
        })?;
        Ok(Self { inner, seed })
    }

    /// Transforms samples `first_sample, first_sample + 1, …` in place, laid end to end in flat
    /// contiguous buffers, sample `k` holding `real[k]` real tokens: the transformed tokens, the
    /// loss mask 1 on them, then padding (the pad token, one more document id, loss mask 0).
    fn fill(
        &self,
        py: Python<'_>,
        first_sample: u64,
        tokens: &Bound<'_, PyArray1<i64>>,
        document_ids: &Bound<'_, PyArray1<i32>>,
        loss_mask: &Bound<'_, PyArray1<u8>>,
        real: Vec<usize>,
    ) -> PyResult<()> {
        let mut tokens = tokens.try_readwrite()?;
        let mut document_ids = document_ids.try_readwrite()?;
        let mut loss_mask = loss_mask.try_readwrite()?;
        let (tokens, document_ids, loss_mask) = (
            tokens.as_slice_mut()?,
            document_ids.as_slice_mut()?,
            loss_mask.as_slice_mut()?,
        );
        py.detach(|| {
            self.inner.fill(
                self.seed,
                first_sample,
                tokens,
                document_ids,
                loss_mask,
                &real,
            )
        })
        .map_err(data_error)
    }
}

/// Runs `work` on another thread while this one, every [`STOP_POLL`], runs Python's signal
/// handlers and asks `stop`; once `stop` says so (or a handler raises, the error then being
/// returned) `work`'s flag is raised and its result, a `Cancelled` error, returned.
fn stoppable<T: Send>(
    py: Python<'_>,
    stop: &Bound<'_, PyAny>,
    work: impl FnOnce(&Cancel) -> PyResult<T> + Send,
) -> PyResult<T> {
    let cancel = Cancel::default();
    thread::scope(|scope| {
        let worker = scope.spawn(|| work(&cancel));
        let mut raised = None;
        while !worker.is_finished() {
            py.detach(|| thread::sleep(STOP_POLL));
            if cancel.is_cancelled() {
                continue;
            }
            match py.check_signals().and_then(|()| stop.call0()?.is_truthy()) {
                Ok(false) => {}
                Ok(true) => cancel.cancel(),
                Err(error) => {
                    cancel.cancel();
                    raised = Some(error);
                }
            }
        }
        let result = py
            .detach(|| worker.join())
            .map_err(|_| PyRuntimeError::new_err("the sampling thread panicked"))?;
        match raised {
            Some(error) => Err(error),
            None => result,
        }
    })
}

#[pyclass(frozen, module = "fastllm._native")]
pub struct SampleSource {
    inner: Source,
}

#[pymethods]
impl SampleSource {
    /// `prefixes`: the `.bin`/`.idx` prefixes of every dataset (shard) to draw from;
    /// `vocab_size`: the model's, when every token filled in must lie below it;
    /// `stop`: called every 50 ms while the indices are built (after Python's signal
    /// handlers ran): once it returns true the build stops with `Cancelled`.
    #[new]
    #[pyo3(signature = (prefixes, *, sequence_length, num_samples, seed, truncate, weights, cache_dir, threads=0, fim=None, tokenizer=None, vocab_size=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        prefixes: Vec<PathBuf>,
        sequence_length: u32,
        num_samples: usize,
        seed: u64,
        truncate: bool,
        weights: Option<Vec<f64>>,
        cache_dir: PathBuf,
        threads: usize,
        fim: Option<FimOptions>,
        tokenizer: Option<PathBuf>,
        vocab_size: Option<u64>,
        stop: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mode = if truncate {
            SamplingMode::Truncated
        } else {
            SamplingMode::Packed
        };
        let config = SampleSourceConfig {
            sequence_length,
            num_samples,
            seed,
            mode,
            weights,
            cache_dir,
            threads,
            vocab_size,
        };
        let build = |cancel: &Cancel| -> Result<Source, PyErr> {
            let datasets = prefixes
                .iter()
                .map(IndexedDataset::open)
                .collect::<Result<Vec<_>, _>>()
                .map_err(data_error)?;
            let fim = fim
                .map(|options| {
                    let codec =
                        crate::tokenizer::codec(options.config.split, tokenizer.as_deref())?;
                    Fim::new(options.config, codec).map_err(data_error)
                })
                .transpose()?;
            Source::new(datasets, config, fim, cancel).map_err(data_error)
        };
        let inner = match stop {
            None => py.detach(|| build(&Cancel::default()))?,
            Some(stop) => stoppable(py, &stop, build)?,
        };
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Samples of the datasets skipped for having no trained label.
    #[getter]
    fn skipped_samples(&self) -> u64 {
        self.inner.skipped_samples()
    }

    /// Whether the datasets hold preference pairs (`fill` then takes `parts`).
    #[getter]
    fn is_preference(&self) -> bool {
        self.inner.is_preference()
    }

    /// Preference pairs left out for being longer than the sequence.
    #[getter]
    fn skipped_pairs(&self) -> u64 {
        self.inner.skipped_pairs()
    }

    /// Tokens per sample: the sequence length plus one (inputs and shifted labels).
    #[getter]
    fn sample_length(&self) -> usize {
        self.inner.sample_length()
    }

    /// The dataset (its place in `prefixes`) and the pairs (its documents) of sample `sample`
    /// of preference pairs: pair `k` of the list is the sample's document `k`.
    fn sample_pairs(&self, sample: u64) -> PyResult<(usize, Vec<u32>)> {
        let sample = usize::try_from(sample).unwrap_or(usize::MAX);
        let (dataset, pairs) = self.inner.sample_pairs(sample).map_err(data_error)?;
        Ok((dataset, pairs.to_vec()))
    }

    /// Write samples `first_sample, first_sample + 1, …` into flat contiguous buffers of
    /// `count * sample_length` elements each; `parts` for preference pairs only.
    #[pyo3(signature = (first_sample, tokens, document_ids, loss_mask, parts=None))]
    fn fill(
        &self,
        py: Python<'_>,
        first_sample: u64,
        tokens: &Bound<'_, PyArray1<i64>>,
        document_ids: &Bound<'_, PyArray1<i32>>,
        loss_mask: &Bound<'_, PyArray1<u8>>,
        parts: Option<&Bound<'_, PyArray1<i8>>>,
    ) -> PyResult<()> {
        let mut tokens = tokens.try_readwrite()?;
        let mut document_ids = document_ids.try_readwrite()?;
        let mut loss_mask = loss_mask.try_readwrite()?;
        let mut parts = parts.map(|parts| parts.try_readwrite()).transpose()?;
        let (tokens, document_ids, loss_mask) = (
            tokens.as_slice_mut()?,
            document_ids.as_slice_mut()?,
            loss_mask.as_slice_mut()?,
        );
        let parts = parts
            .as_mut()
            .map(|parts| parts.as_slice_mut())
            .transpose()?;
        py.detach(|| {
            self.inner
                .fill(first_sample, tokens, document_ids, loss_mask, parts)
        })
        .map_err(data_error)
    }
}
