//! Files read whole as one document: text files and the files of a source tree.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use super::record::{Content, Document, Location, Record};
use super::spec::InputFormat;

/// Reads `file` as one document. In a source tree (`Files`), binaries (not UTF-8, or holding a
/// NUL byte) are skipped; a `Text` file that is not UTF-8 is a bad record.
pub(super) fn read_whole_file(file: Arc<Path>, format: InputFormat) -> Record {
    let bytes = match fs::read(&file) {
        Ok(bytes) => bytes,
        Err(error) => return Record::bad(&file, 0, format!("cannot read: {error}")),
    };
    let skip_binaries = format == InputFormat::Files;
    if skip_binaries && bytes.contains(&0) {
        return Record::Skipped;
    }
    match String::from_utf8(bytes) {
        Ok(text) => Record::Document(Document {
            text,
            content: Content::Text,
            location: Location {
                file,
                line_or_row: 0,
            },
        }),
        Err(_) if skip_binaries => Record::Skipped,
        Err(_) => Record::bad(&file, 0, "invalid UTF-8"),
    }
}
