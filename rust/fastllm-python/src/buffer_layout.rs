//! `fastllm._native.BufferLayout`: where each parameter lives in the per-stage flat buffers, and
//! which part of each stage every data-parallel rank owns.

use fastllm_memory::{LayoutConfig, LayoutError, ParameterSpec};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The flat-buffer layout of a model's parameters: one buffer per stage, each parameter a view
/// at an aligned offset, each stage split into equal aligned shards, one per data-parallel rank.
#[pyclass(frozen, module = "fastllm._native")]
pub struct BufferLayout {
    inner: fastllm_memory::Layout,
}

/// `(parameter_index, param_start, param_end, shard_start, shard_end)`.
type ShardPieceTuple = (usize, u64, u64, u64, u64);

/// A parameter named or counted in model order.
#[derive(FromPyObject)]
enum ParameterKey {
    Index(usize),
    Name(String),
}

#[pymethods]
impl BufferLayout {
    /// Lay out `parameters`, `(name, numel, stage, weight_decay)` in model order, each starting
    /// at a multiple of `alignment` elements, every stage split into `data_size` equal shards;
    /// stages without parameters are empty, up to `num_stages` when given.
    #[new]
    #[pyo3(signature = (parameters, alignment, data_size, num_stages=None))]
    fn new(
        parameters: Vec<(String, u64, u32, bool)>,
        alignment: u64,
        data_size: u32,
        num_stages: Option<u32>,
    ) -> PyResult<Self> {
        let parameters = parameters
            .into_iter()
            .map(|(name, numel, stage, weight_decay)| ParameterSpec {
                name,
                numel,
                stage,
                weight_decay,
            })
            .collect();
        let config = LayoutConfig {
            alignment,
            data_size,
        };
        let mut inner = fastllm_memory::Layout::new(parameters, config).map_err(layout_error)?;
        if let Some(num_stages) = num_stages {
            inner = inner.padded_to(num_stages).map_err(layout_error)?;
        }
        Ok(Self { inner })
    }

    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.config().alignment
    }

    #[getter]
    fn data_size(&self) -> u32 {
        self.inner.config().data_size
    }

    #[getter]
    fn num_stages(&self) -> usize {
        self.inner.stages().len()
    }

    #[getter]
    fn num_parameters(&self) -> usize {
        self.inner.parameters().len()
    }

    /// Elements in all stage buffers together, padding included.
    #[getter]
    fn num_elements(&self) -> u64 {
        self.inner.num_elements()
    }

    /// Elements in the stage's buffer, padding included; a multiple of `data_size * alignment`.
    fn stage_size(&self, stage: u32) -> PyResult<u64> {
        Ok(self.inner.stage(stage).map_err(layout_error)?.size)
    }

    /// Elements in each rank's shard of the stage.
    fn shard_size(&self, stage: u32) -> PyResult<u64> {
        Ok(self.inner.stage(stage).map_err(layout_error)?.shard_size)
    }

    /// `(start, end)` of the rank's shard within the stage's buffer.
    fn shard_range(&self, stage: u32, rank: u32) -> PyResult<(u64, u64)> {
        let range = self.inner.shard(stage, rank).map_err(layout_error)?.range();
        Ok((range.start, range.end))
    }

    /// `(stage, offset, numel)` of a parameter given by index or name.
    fn parameter(&self, key: ParameterKey) -> PyResult<(u32, u64, u64)> {
        let index = match key {
            ParameterKey::Index(index) => index,
            ParameterKey::Name(name) => self.inner.parameter_index(&name).map_err(layout_error)?,
        };
        let parameter = self.inner.parameter(index).map_err(layout_error)?;
        Ok((parameter.stage, parameter.offset, parameter.numel))
    }

    /// The parameter elements the rank's shard holds, in order, as
    /// `(parameter_index, param_start, param_end, shard_start, shard_end)`: elements
    /// `param_start..param_end` of the flattened parameter lie at `shard_start..shard_end` of
    /// the shard.
    fn shard_parameters(&self, stage: u32, rank: u32) -> PyResult<Vec<ShardPieceTuple>> {
        let shard = self.inner.shard(stage, rank).map_err(layout_error)?;
        Ok(shard
            .pieces()
            .into_iter()
            .map(|piece| {
                (
                    piece.parameter,
                    piece.parameter_range.start,
                    piece.parameter_range.end,
                    piece.shard_range.start,
                    piece.shard_range.end,
                )
            })
            .collect())
    }

    /// The rank's shard cut into maximal `(start, end, weight_decay)` runs, offsets within the
    /// shard, covering it exactly: one fused optimizer call each. Padding joins the run before it,
    /// so every boundary is aligned.
    fn decay_runs(&self, stage: u32, rank: u32) -> PyResult<Vec<(u64, u64, bool)>> {
        let shard = self.inner.shard(stage, rank).map_err(layout_error)?;
        Ok(shard
            .decay_runs()
            .into_iter()
            .map(|run| (run.range.start, run.range.end, run.weight_decay))
            .collect())
    }
}

fn layout_error(error: LayoutError) -> PyErr {
    PyValueError::new_err(error.to_string())
}
