//! Checkpoint files written on background threads while training goes on.

use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};

use crate::file_name::check_file_name;
use crate::{write_file, CheckpointError, FileReport, TensorRef};

/// Files to write into one directory, created if missing (ranks may race to create it).
pub struct WriteJob {
    pub directory: PathBuf,
    pub files: Vec<FileToWrite>,
}

/// One safetensors file of a [`WriteJob`].
pub struct FileToWrite {
    pub file_name: String,
    pub tensors: Vec<TensorRef>,
    pub metadata: BTreeMap<String, String>,
}

/// Runs one [`WriteJob`] at a time in the background, each file on its own thread.
#[derive(Default)]
pub struct AsyncWriter {
    in_flight: Option<JoinHandle<()>>,
}

impl AsyncWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts writing `job` and returns at once, unless the previous job is still running: then
    /// it first waits for that one, so that jobs never compete for the disk.
    ///
    /// The tensors' bytes must stay unchanged until the returned handle reports the job finished.
    pub fn submit(&mut self, job: WriteJob) -> JobHandle {
        if let Some(previous) = self.in_flight.take() {
            // Never an error: the job thread catches panics and hands every outcome to its handle.
            let _ = previous.join();
        }
        let state = Arc::new(JobState::default());
        let finish = Arc::clone(&state);
        self.in_flight = Some(thread::spawn(move || {
            let outcome =
                panic::catch_unwind(AssertUnwindSafe(|| run(&job))).unwrap_or_else(|_| {
                    Err(CheckpointError::WriterPanicked {
                        directory: job.directory.clone(),
                    })
                });
            finish.set(outcome);
        }));
        JobHandle { state }
    }
}

/// The outcome of a submitted [`WriteJob`].
pub struct JobHandle {
    state: Arc<JobState>,
}

impl JobHandle {
    /// Blocks until every file is written and fsynced; the reports come in the job's file order.
    pub fn wait(self) -> Result<Vec<FileReport>, CheckpointError> {
        let mut outcome = self.state.outcome.lock().expect("never poisoned");
        loop {
            match outcome.take() {
                Some(result) => return result,
                None => outcome = self.state.finished.wait(outcome).expect("never poisoned"),
            }
        }
    }

    pub fn is_finished(&self) -> bool {
        self.state.outcome.lock().expect("never poisoned").is_some()
    }
}

type Outcome = Result<Vec<FileReport>, CheckpointError>;

#[derive(Default)]
struct JobState {
    outcome: Mutex<Option<Outcome>>,
    finished: Condvar,
}

impl JobState {
    fn set(&self, outcome: Outcome) {
        *self.outcome.lock().expect("never poisoned") = Some(outcome);
        self.finished.notify_all();
    }
}

fn run(job: &WriteJob) -> Outcome {
    let mut names: Vec<&str> = Vec::with_capacity(job.files.len());
    for file in &job.files {
        check_file_name(&job.directory, &file.file_name)?;
        if names.contains(&file.file_name.as_str()) {
            return Err(CheckpointError::DuplicateFile {
                directory: job.directory.clone(),
                name: file.file_name.clone(),
            });
        }
        names.push(&file.file_name);
    }
    std::fs::create_dir_all(&job.directory).map_err(CheckpointError::io(&job.directory))?;
    thread::scope(|scope| {
        let writers: Vec<_> = job
            .files
            .iter()
            .map(|file| {
                let path = job.directory.join(&file.file_name);
                scope.spawn(move || write_file(&path, &file.tensors, &file.metadata))
            })
            .collect();
        writers
            .into_iter()
            .map(|writer| {
                writer
                    .join()
                    .unwrap_or_else(|panic| panic::resume_unwind(panic))
            })
            .collect()
    })
}
