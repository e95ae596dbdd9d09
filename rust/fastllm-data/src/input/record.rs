use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// Where a record came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub file: Arc<Path>,
    /// Line of a JSON-lines file or row of a Parquet file, counted from 1; 0 for a whole file.
    pub line_or_row: u64,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line_or_row {
            0 => write!(f, "{}", self.file.display()),
            line => write!(f, "{}:{line}", self.file.display()),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    /// The text; empty for a conversation.
    pub text: String,
    pub content: Content,
    pub location: Location,
}

/// What a document holds besides its text.
#[derive(Clone, Debug, PartialEq)]
pub enum Content {
    Text,
    /// Character spans `[begin, end]` (both included, as Fast-LLM's `loss_masking_spans`) of
    /// the text that are not trained on.
    TextWithSpans(Vec<[u64; 2]>),
    /// The `messages` of a chat record, not yet checked.
    Conversation(serde_json::Value),
    /// The parts of a preference record, not yet checked.
    Preference(Box<PreferencePair>),
}

/// A prompt with a chosen and a rejected answer: strings, or lists of messages (TRL's
/// conversational format). Without a prompt, the answers are whole conversations that share
/// their prompt (TRL's implicit prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct PreferencePair {
    pub prompt: Option<serde_json::Value>,
    pub chosen: serde_json::Value,
    pub rejected: serde_json::Value,
}

/// A record that could not be read as a document, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRecord {
    pub location: Location,
    pub reason: String,
}

impl fmt::Display for BadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.reason)
    }
}

/// One step of a file reader.
pub(super) enum Record {
    Document(Document),
    Bad(BadRecord),
    /// A binary file of a source tree.
    Skipped,
}

impl Record {
    pub(super) fn bad(file: &Arc<Path>, line_or_row: u64, reason: impl Into<String>) -> Self {
        Self::Bad(BadRecord {
            location: Location {
                file: file.clone(),
                line_or_row,
            },
            reason: reason.into(),
        })
    }
}
