use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// How far a running [`prepare`](crate::prepare) is, readable from any thread, and the switch
/// that stops it.
#[derive(Debug, Default)]
pub struct Progress {
    documents: AtomicU64,
    tokens: AtomicU64,
    bytes_read: AtomicU64,
    total_bytes: AtomicU64,
    bad_records: AtomicU64,
    cancelled: AtomicBool,
    warnings: Mutex<Vec<String>>,
}

impl Progress {
    pub fn new() -> Self {
        Self::default()
    }

    /// Documents written.
    pub fn documents(&self) -> u64 {
        self.documents.load(Ordering::Relaxed)
    }

    /// Tokens written, EOS and BOS included.
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Input bytes read, as stored on disk (compressed).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Input bytes in all, as stored on disk; 0 until the inputs are listed.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes.load(Ordering::Relaxed)
    }

    pub fn bad_records(&self) -> u64 {
        self.bad_records.load(Ordering::Relaxed)
    }

    /// Makes `prepare` stop soon with [`PrepareError::Cancelled`](crate::PrepareError),
    /// leaving no output.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// What the run met that it leaves to the user (a staging directory it may not remove).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().expect("not poisoned").clone()
    }

    pub(super) fn warn(&self, warning: String) {
        self.warnings.lock().expect("not poisoned").push(warning);
    }

    pub(super) fn set_total_bytes(&self, bytes: u64) {
        self.total_bytes.store(bytes, Ordering::Relaxed);
    }

    pub(super) fn set_bytes_read(&self, bytes: u64) {
        self.bytes_read.store(bytes, Ordering::Relaxed);
    }

    pub(super) fn add_written(&self, documents: u64, tokens: u64, bad_records: u64) {
        self.documents.fetch_add(documents, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        self.bad_records.fetch_add(bad_records, Ordering::Relaxed);
    }
}
