//! `fastllm._native.CheckpointWriter` and the checkpoint functions: safetensors files written on
//! background threads straight from numpy buffers, then committed, verified and found again.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use fastllm_checkpoint::{
    AsyncWriter, CheckpointError, Dtype, FileReport, FileToWrite, JobHandle, TensorRef, WriteJob,
};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Writes checkpoint files in the background, one job at a time.
#[pyclass(frozen, module = "fastllm._native")]
pub struct CheckpointWriter {
    writer: Mutex<AsyncWriter>,
}

/// `(name, array, dtype, shape)`: a C-contiguous numpy array of any element type (bf16 arrives as
/// a uint8 or int16 view) holding the tensor's bytes, its safetensors dtype (`"BF16"`) and shape.
type TensorArg<'py> = (String, Bound<'py, PyUntypedArray>, String, Vec<u64>);
/// `(file_name, tensors, metadata)`.
type FileArg<'py> = (String, Vec<TensorArg<'py>>, BTreeMap<String, String>);

#[pymethods]
impl CheckpointWriter {
    #[new]
    fn new() -> Self {
        Self {
            writer: Mutex::new(AsyncWriter::new()),
        }
    }

    /// Starts writing `files` into `directory` (created if missing) and returns at once, after
    /// waiting for the previous job if it still runs. The arrays are read in place: keep them
    /// unchanged until the job is done.
    fn submit(
        &self,
        py: Python<'_>,
        directory: PathBuf,
        files: Vec<FileArg<'_>>,
    ) -> PyResult<PendingWrite> {
        let files = files
            .into_iter()
            .map(|(file_name, tensors, metadata)| {
                let tensors = tensors
                    .into_iter()
                    .map(tensor_ref)
                    .collect::<PyResult<_>>()?;
                Ok(FileToWrite {
                    file_name,
                    tensors,
                    metadata,
                })
            })
            .collect::<PyResult<_>>()?;
        let job = WriteJob { directory, files };
        let handle = py.detach(|| self.writer.lock().expect("never poisoned").submit(job));
        Ok(PendingWrite {
            handle: Mutex::new(Some(handle)),
            outcome: OnceLock::new(),
        })
    }
}

fn tensor_ref((name, array, dtype, shape): TensorArg<'_>) -> PyResult<TensorRef> {
    let dtype: Dtype = dtype.parse().map_err(|error| to_py_err(&error))?;
    if !array.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "tensor {name:?}: the array is not C-contiguous"
        )));
    }
    let bytes = ArrayBytes {
        // SAFETY: a live numpy array object.
        data: unsafe { (*array.as_array_ptr()).fields.data } as *const u8,
        len: array.len() * array.dtype().itemsize(),
        _array: array.unbind(),
    };
    Ok(TensorRef::new(name, dtype, shape, Arc::new(bytes)))
}

/// A numpy array's bytes, which the writer threads read in place. Holding the array keeps them
/// alive however long the job outlives its Python handles.
struct ArrayBytes {
    data: *const u8,
    len: usize,
    _array: Py<PyUntypedArray>,
}

// SAFETY: the buffer lives as long as `_array`, numpy does not move the buffer of an array that
// others reference, and the writer threads only read it.
unsafe impl Send for ArrayBytes {}
unsafe impl Sync for ArrayBytes {}

impl AsRef<[u8]> for ArrayBytes {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` bytes of a C-contiguous array, alive as long as `self` (see above).
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

/// A submitted write: `wait()` for its file reports, or poll `done`.
#[pyclass(frozen, name = "WriteJob", module = "fastllm._native")]
pub struct PendingWrite {
    handle: Mutex<Option<JobHandle>>,
    outcome: OnceLock<Result<Vec<FileReport>, CheckpointError>>,
}

#[pymethods]
impl PendingWrite {
    /// Blocks, without the GIL, until every file is written and fsynced; returns one
    /// `{"file_name", "bytes", "checksum"}` dict per file, in submission order.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let outcome = py.detach(|| {
            self.outcome.get_or_init(|| {
                let handle = self.handle.lock().expect("never poisoned").take();
                handle.expect("taken only here, once").wait()
            })
        });
        let reports = outcome.as_ref().map_err(to_py_err)?;
        reports
            .iter()
            .map(|report| report_dict(py, report))
            .collect()
    }

    #[getter]
    fn done(&self) -> bool {
        self.outcome.get().is_some()
            || self
                .handle
                .lock()
                .expect("never poisoned")
                .as_ref()
                .is_some_and(JobHandle::is_finished)
    }
}

fn report_dict<'py>(py: Python<'py>, report: &FileReport) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("file_name", &report.file_name)?;
    dict.set_item("bytes", report.bytes)?;
    dict.set_item("checksum", &report.checksum)?;
    Ok(dict)
}

/// A file report as `WriteJob.wait()` returns it, possibly gathered from another rank.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct ReportArg {
    file_name: String,
    bytes: u64,
    checksum: String,
}

/// Writes `manifest.json` (the `manifest_json` object plus the files of `reports`), fsyncs and
/// renames `partial_dir` to `final_dir`, which must not exist.
#[pyfunction]
pub fn commit_checkpoint(
    py: Python<'_>,
    partial_dir: PathBuf,
    final_dir: PathBuf,
    manifest_json: &str,
    reports: Vec<ReportArg>,
) -> PyResult<()> {
    let manifest = serde_json::from_str(manifest_json)
        .map_err(|error| PyValueError::new_err(format!("manifest: {error}")))?;
    let reports: Vec<FileReport> = reports
        .into_iter()
        .map(|report| FileReport {
            file_name: report.file_name,
            bytes: report.bytes,
            checksum: report.checksum,
        })
        .collect();
    py.detach(|| fastllm_checkpoint::commit(&partial_dir, &final_dir, manifest, &reports))
        .map_err(|error| to_py_err(&error))
}

/// Checks the size and checksum of every file the manifest of `directory` lists; returns the
/// manifest as JSON.
#[pyfunction]
pub fn verify_checkpoint(py: Python<'_>, directory: PathBuf) -> PyResult<String> {
    let manifest = py
        .detach(|| fastllm_checkpoint::verify(&directory))
        .map_err(|error| to_py_err(&error))?;
    Ok(manifest.document.to_string())
}

/// `(step, directory, manifest_json, skipped)`.
type Latest = (u64, String, String, Vec<String>);

/// `(step, directory, manifest_json, skipped)` of the newest committed checkpoint under `root`
/// that verifies, `skipped` saying why each newer one was passed over; `None` if there is none.
#[pyfunction]
pub fn latest_checkpoint(py: Python<'_>, root: PathBuf) -> PyResult<Option<Latest>> {
    let latest = py
        .detach(|| fastllm_checkpoint::latest_valid(&root))
        .map_err(|error| to_py_err(&error))?;
    Ok(latest.map(|latest| {
        (
            latest.step,
            latest.directory.to_string_lossy().into_owned(),
            latest.manifest.document.to_string(),
            latest.skipped,
        )
    }))
}

/// File-system errors become `OSError` (its `FileNotFoundError` and `FileExistsError` where they
/// fit), bad contents `ValueError`; the message names the file.
fn to_py_err(error: &CheckpointError) -> PyErr {
    let message = error.to_string();
    match error {
        CheckpointError::Io { .. } => PyOSError::new_err(message),
        CheckpointError::MissingManifest { .. } => PyFileNotFoundError::new_err(message),
        CheckpointError::AlreadyExists { .. } => PyFileExistsError::new_err(message),
        CheckpointError::WriterPanicked { .. } => PyRuntimeError::new_err(message),
        _ => PyValueError::new_err(message),
    }
}
