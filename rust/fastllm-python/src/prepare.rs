//! `fastllm prepare` and the document reader, for Python: the work runs on Rust threads while
//! Python polls the progress (for its progress bar) and can cancel.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{SendTimeoutError, Sender};
use fastllm_data::{
    prepare, DocumentReader as Reader, FedBatch, FedKind, Feed, InputFormat, InputSpec,
    PreferenceFields, PrepareError, PrepareOptions, PrepareReport, Progress, TrainOn,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn input_spec(
    paths: Vec<String>,
    format: &str,
    field: String,
    extensions: Option<Vec<String>>,
) -> PyResult<InputSpec> {
    let format = match format {
        "auto" => InputFormat::Auto,
        "jsonl" => InputFormat::Jsonl,
        "chat" => InputFormat::Chat,
        "preference" => InputFormat::Preference,
        "parquet" => InputFormat::Parquet,
        "text" => InputFormat::Text,
        "files" => InputFormat::Files,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown input format {other:?}"
            )))
        }
    };
    Ok(InputSpec {
        paths,
        format,
        field,
        extensions,
        ..InputSpec::default()
    })
}

fn train_on(name: &str) -> PyResult<TrainOn> {
    match name {
        "assistant" => Ok(TrainOn::Assistant),
        "last_assistant" => Ok(TrainOn::LastAssistant),
        "all" => Ok(TrainOn::All),
        other => Err(PyValueError::new_err(format!("unknown train_on {other:?}"))),
    }
}

/// `OSError` when the machine could not write the output, `ValueError` for bad inputs or options.
fn prepare_error(error: PrepareError) -> PyErr {
    match error.is_write_failure() {
        true => PyOSError::new_err(error.to_string()),
        false => PyValueError::new_err(error.to_string()),
    }
}

type Outcome = Result<PrepareReport, PrepareError>;

/// Fed batches waiting for the reader: enough to keep it busy while Python makes the next.
const FED_BATCHES_QUEUED: usize = 4;

/// A `prepare` running on a background thread.
#[pyclass(frozen, module = "fastllm._native")]
pub struct PrepareJob {
    progress: Arc<Progress>,
    thread: Mutex<Option<JoinHandle<Outcome>>>,
    /// Where `feed` sends records, for a job started with `feed_inputs`, until `close_feed`.
    feed: Mutex<Option<Sender<FedBatch>>>,
}

#[pyfunction]
#[pyo3(signature = (*, paths, format, field, extensions, messages_field, loss_masking_spans, chat_template, train_on, tokenizer, eos_token, bos_token, add_eos, add_bos, output, shard_size_tokens, workers, strict, overwrite, prompt_text, chosen_text, rejected_text, max_pair_tokens, feed_inputs=None))]
#[allow(clippy::too_many_arguments)]
pub fn start_prepare(
    paths: Vec<String>,
    format: &str,
    field: String,
    extensions: Option<Vec<String>>,
    messages_field: String,
    loss_masking_spans: Option<String>,
    chat_template: Option<PathBuf>,
    train_on: &str,
    tokenizer: PathBuf,
    eos_token: Option<String>,
    bos_token: Option<String>,
    add_eos: bool,
    add_bos: bool,
    output: PathBuf,
    shard_size_tokens: u64,
    workers: usize,
    strict: bool,
    overwrite: bool,
    prompt_text: String,
    chosen_text: String,
    rejected_text: String,
    max_pair_tokens: Option<u64>,
    feed_inputs: Option<Vec<(PathBuf, u64)>>,
) -> PyResult<PrepareJob> {
    let (sender, feed) = match feed_inputs {
        None => (None, None),
        Some(inputs) => {
            let (sender, batches) = crossbeam_channel::bounded(FED_BATCHES_QUEUED);
            let format = match format {
                "jsonl" => InputFormat::Jsonl,
                "chat" => InputFormat::Chat,
                "preference" => InputFormat::Preference,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "fed records are jsonl, chat or preference, not {other:?}"
                    )))
                }
            };
            let feed = Feed {
                inputs,
                format,
                batches,
            };
            (Some(sender), Some(feed))
        }
    };
    let options = PrepareOptions {
        feed,
        input: InputSpec {
            messages_field,
            loss_masking_spans,
            preference_fields: PreferenceFields {
                prompt: prompt_text,
                chosen: chosen_text,
                rejected: rejected_text,
            },
            ..input_spec(paths, format, field, extensions)?
        },
        chat_template,
        train_on: self::train_on(train_on)?,
        tokenizer,
        eos_token,
        bos_token,
        add_eos,
        add_bos,
        output,
        shard_size_tokens,
        workers,
        strict,
        overwrite,
        max_pair_tokens,
    };
    let progress = Arc::new(Progress::new());
    let shared = Arc::clone(&progress);
    let thread = std::thread::spawn(move || prepare(&options, &shared));
    Ok(PrepareJob {
        progress,
        thread: Mutex::new(Some(thread)),
        feed: Mutex::new(sender),
    })
}

#[pymethods]
impl PrepareJob {
    /// Counters so far: documents, tokens, bytes_read, total_bytes, bad_records.
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counters = PyDict::new(py);
        counters.set_item("documents", self.progress.documents())?;
        counters.set_item("tokens", self.progress.tokens())?;
        counters.set_item("bytes_read", self.progress.bytes_read())?;
        counters.set_item("total_bytes", self.progress.total_bytes())?;
        counters.set_item("bad_records", self.progress.bad_records())?;
        Ok(counters)
    }

    /// What the job met that it leaves to the user, one line each (a staging directory of
    /// another machine's run, which it may not remove).
    fn warnings(&self) -> Vec<String> {
        self.progress.warnings()
    }

    /// Sends records of input `input` (read from `file`) to a job started with `feed_inputs`:
    /// `values` are texts (`kind` "text") or JSON objects ("json"), one per row of `rows`; a
    /// None value is a bad record whose reason is the next of `reasons`. Waits while the job
    /// is busy; returns False once the job has ended (its error, if any, is `wait`'s).
    #[pyo3(signature = (*, input, file, kind, rows, values, reasons, skipped, bytes))]
    #[allow(clippy::too_many_arguments)]
    fn feed(
        &self,
        py: Python<'_>,
        input: usize,
        file: PathBuf,
        kind: &str,
        rows: Vec<u64>,
        values: Vec<Option<String>>,
        reasons: Vec<String>,
        skipped: u64,
        bytes: u64,
    ) -> PyResult<bool> {
        let kind = match kind {
            "text" => FedKind::Text,
            "json" => FedKind::Json,
            other => return Err(PyValueError::new_err(format!("unknown kind {other:?}"))),
        };
        if rows.len() != values.len() {
            return Err(PyValueError::new_err("rows and values differ in length"));
        }
        self.send(
            py,
            FedBatch {
                input,
                file: Arc::<Path>::from(file),
                bytes,
                kind,
                rows,
                values,
                reasons,
                skipped,
            },
        )
    }

    /// Like `feed` for the texts of an Arrow string array (`large`: large_string), read from
    /// its buffers (validity bitmap, offsets, data) without Python strings: `length` rows
    /// from element `offset`, the first of them row `first_row`.
    #[pyo3(signature = (*, input, file, first_row, validity, offsets, data, offset, length, large, bytes))]
    #[allow(clippy::too_many_arguments)]
    fn feed_strings(
        &self,
        py: Python<'_>,
        input: usize,
        file: PathBuf,
        first_row: u64,
        validity: Option<PyBuffer<i8>>,
        offsets: PyBuffer<i8>,
        data: PyBuffer<i8>,
        offset: usize,
        length: usize,
        large: bool,
        bytes: u64,
    ) -> PyResult<bool> {
        let (values, reasons) = {
            let bytes_of = |buffer: &PyBuffer<i8>| {
                // SAFETY: the buffer stays exported (and Arrow's memory unchanged) while
                // `buffer` lives, which outlives this borrow.
                unsafe {
                    std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes())
                }
            };
            arrow_strings(
                validity.as_ref().map(bytes_of),
                bytes_of(&offsets),
                bytes_of(&data),
                offset,
                length,
                large,
            )
            .map_err(PyValueError::new_err)?
        };
        self.send(
            py,
            FedBatch {
                input,
                file: Arc::<Path>::from(file),
                bytes,
                kind: FedKind::Text,
                rows: (first_row..first_row + length as u64).collect(),
                values,
                reasons,
                skipped: 0,
            },
        )
    }

    /// Says that every record was sent: the job finishes once it has written them.
    fn close_feed(&self) {
        self.feed.lock().expect("not poisoned").take();
    }

    /// Ask the job to stop; it then fails, leaving no output behind.
    fn cancel(&self) {
        self.progress.cancel();
    }

    /// The report as JSON once the job has finished, or None if it is still running after
    /// `timeout` seconds. Raises the job's error.
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<String>> {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout.max(0.0));
        let finished = py.detach(|| loop {
            let done = self
                .thread
                .lock()
                .expect("not poisoned")
                .as_ref()
                .is_none_or(|t| t.is_finished());
            if done || Instant::now() >= deadline {
                return done;
            }
            std::thread::sleep(Duration::from_millis(20));
        });
        if !finished {
            return Ok(None);
        }
        let thread = self.thread.lock().expect("not poisoned").take();
        let Some(thread) = thread else {
            return Err(PyRuntimeError::new_err(
                "the prepare job was already waited for",
            ));
        };
        let report = thread
            .join()
            .map_err(|_| PyRuntimeError::new_err("the prepare thread panicked"))?;
        let report = report.map_err(prepare_error)?;
        serde_json::to_string(&report)
            .map(Some)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

impl PrepareJob {
    /// Queues `batch` for the job, waiting while it is busy; false once the job has ended.
    fn send(&self, py: Python<'_>, mut batch: FedBatch) -> PyResult<bool> {
        let Some(sender) = self.feed.lock().expect("not poisoned").clone() else {
            return Err(PyRuntimeError::new_err("the job takes no (more) records"));
        };
        Ok(py.detach(|| loop {
            match sender.send_timeout(batch, Duration::from_millis(20)) {
                Ok(()) => return true,
                Err(SendTimeoutError::Disconnected(_)) => return false,
                Err(SendTimeoutError::Timeout(back)) => {
                    let ended = self
                        .thread
                        .lock()
                        .expect("not poisoned")
                        .as_ref()
                        .is_none_or(|t| t.is_finished());
                    if ended {
                        return false;
                    }
                    batch = back;
                }
            }
        }))
    }
}

/// The texts of an Arrow string array from its buffers (Arrow's columnar layout): each value,
/// or None for a null or invalid UTF-8, whose reasons come in order.
fn arrow_strings(
    validity: Option<&[u8]>,
    offsets: &[u8],
    data: &[u8],
    offset: usize,
    length: usize,
    large: bool,
) -> Result<(Vec<Option<String>>, Vec<String>), String> {
    let width = if large { 8 } else { 4 };
    let position = |i: usize| -> Option<usize> {
        let at = (offset + i) * width;
        let raw = offsets.get(at..at + width)?;
        let value = match large {
            true => i64::from_le_bytes(raw.try_into().ok()?),
            false => i64::from(i32::from_le_bytes(raw.try_into().ok()?)),
        };
        usize::try_from(value).ok()
    };
    let (mut values, mut reasons) = (Vec::with_capacity(length), Vec::new());
    for i in 0..length {
        let bit = offset + i;
        let present =
            validity.is_none_or(|v| v.get(bit / 8).is_some_and(|b| b >> (bit % 8) & 1 == 1));
        if !present {
            values.push(None);
            reasons.push("null instead of a string".to_owned());
            continue;
        }
        let text = match (position(i), position(i + 1)) {
            (Some(start), Some(end)) => data.get(start..end),
            _ => None,
        }
        .ok_or_else(|| format!("string {i} of the array lies outside its buffers"))?;
        match String::from_utf8(text.to_vec()) {
            Ok(text) => values.push(Some(text)),
            Err(_) => {
                values.push(None);
                reasons.push("invalid UTF-8".to_owned());
            }
        }
    }
    Ok((values, reasons))
}

/// Documents of the same inputs `prepare` reads, in order, batch by batch (for training a
/// tokenizer on them).
#[pyclass(frozen, module = "fastllm._native")]
pub struct DocumentReader {
    inner: Mutex<Reader>,
}

#[pymethods]
impl DocumentReader {
    #[new]
    #[pyo3(signature = (*, paths, format, field, extensions))]
    fn new(
        paths: Vec<String>,
        format: &str,
        field: String,
        extensions: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let spec = input_spec(paths, format, field, extensions)?;
        let inner = Reader::open(&spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            inner: Mutex::new(inner),
        })
    }

    /// Each file to read, in order: (input path, format, file, bytes on disk).
    fn files(&self) -> Vec<(PathBuf, String, PathBuf, u64)> {
        let reader = self.inner.lock().expect("not poisoned");
        let mut files = Vec::new();
        for input in reader.inputs() {
            let format = serde_json::to_value(input.format).expect("formats serialize");
            let format = format.as_str().expect("a format is a string").to_owned();
            for (file, bytes) in input.files() {
                files.push((input.path.clone(), format.clone(), file.to_owned(), bytes));
            }
        }
        files
    }

    /// The next documents (about `max_bytes` of text) and the bad records met on the way
    /// ("file:line: reason"), or None at the end.
    fn next_batch(&self, py: Python<'_>, max_bytes: usize) -> Option<(Vec<String>, Vec<String>)> {
        let batch = py.detach(|| {
            self.inner
                .lock()
                .expect("not poisoned")
                .next_batch(max_bytes)
        })?;
        let documents = batch.documents.into_iter().map(|d| d.text).collect();
        let bad = batch.bad_records.iter().map(ToString::to_string).collect();
        Some((documents, bad))
    }
}
