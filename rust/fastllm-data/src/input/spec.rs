use serde::Serialize;

/// What to read: paths, how to read them, and where the text is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSpec {
    /// Files, directories or glob patterns, read in this order; glob matches and directory
    /// walks in sorted order. A directory stands for every file under it, hidden ones
    /// excepted, each read in `format` (`Auto`: `Files`).
    pub paths: Vec<String>,
    pub format: InputFormat,
    /// The field holding the text in JSON records and the column holding it in Parquet files
    /// (a nested column by its dotted path).
    pub field: String,
    /// Keeps only files with these extensions (`py` or `.py`) when walking a directory; files
    /// named explicitly are always read.
    pub extensions: Option<Vec<String>>,
    /// The field holding the conversation of a chat record.
    pub messages_field: String,
    /// The field of JSON records holding character spans not trained on (Fast-LLM's
    /// `loss_masking_spans`: `[[begin, end], …]`, both ends included).
    pub loss_masking_spans: Option<String>,
    /// The fields of a preference record: its prompt (absent: TRL's implicit prompt, the
    /// shared start of the two answers), chosen and rejected answers.
    pub preference_fields: PreferenceFields,
}

/// Where a preference record keeps its parts; TRL's names by default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreferenceFields {
    pub prompt: String,
    pub chosen: String,
    pub rejected: String,
}

impl Default for PreferenceFields {
    fn default() -> Self {
        Self {
            prompt: "prompt".to_owned(),
            chosen: "chosen".to_owned(),
            rejected: "rejected".to_owned(),
        }
    }
}

impl Default for InputSpec {
    fn default() -> Self {
        Self {
            paths: Vec::new(),
            format: InputFormat::Auto,
            field: "text".to_owned(),
            extensions: None,
            messages_field: "messages".to_owned(),
            loss_masking_spans: None,
            preference_fields: PreferenceFields::default(),
        }
    }
}

/// How files are turned into documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// By file name: `.jsonl`, `.json`, `.ndjson` (also `.gz`, `.zst`) are JSON lines,
    /// `.parquet` is Parquet, `.txt` is text; a directory is a source tree (`Files`). JSON
    /// lines whose first record has the messages field and not the text field are `Chat`;
    /// those whose first record has the chosen and rejected fields are `Preference`.
    Auto,
    /// One JSON object per line; compressed when the name ends in `.gz` or `.zst`.
    Jsonl,
    /// JSON lines, one conversation per line: a list of `{role, content}` messages.
    Chat,
    /// JSON lines, one preference pair per line: a prompt, a chosen and a rejected answer,
    /// each a string or a list of messages.
    Preference,
    /// One document per row, from a string column.
    Parquet,
    /// One document per file; a file that is not UTF-8 is a bad record.
    Text,
    /// One document per file of a source tree; files that are not UTF-8 or hold a NUL byte
    /// (binaries) are skipped and counted.
    Files,
}
