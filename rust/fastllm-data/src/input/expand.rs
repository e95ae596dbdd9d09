//! From the paths of an [`InputSpec`] to the ordered list of files to read.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use walkdir::{DirEntry, WalkDir};

use super::jsonl::{sniff, Fields};
use super::spec::{InputFormat, InputSpec};
use crate::InputError;

/// One path of the spec after glob expansion (a file, or a directory with every file under it),
/// with what was read from it so far.
#[derive(Clone, Debug, Serialize)]
pub struct Input {
    pub path: PathBuf,
    /// How its files are read (never `Auto`).
    pub format: InputFormat,
    /// Size of its files on disk.
    pub bytes: u64,
    pub documents: u64,
    pub bad_records: u64,
    pub skipped_files: u64,
    #[serde(skip)]
    pub(super) files: Vec<(Arc<Path>, u64)>,
}

impl Input {
    /// Its files with their sizes, in reading order.
    pub fn files(&self) -> impl Iterator<Item = (&Path, u64)> {
        self.files.iter().map(|(file, size)| (&**file, *size))
    }
}

pub(super) fn expand(spec: &InputSpec) -> Result<Vec<Input>, InputError> {
    if spec.paths.is_empty() {
        return Err(InputError::NoInputs);
    }
    let extensions: Option<Vec<&str>> = spec
        .extensions
        .as_ref()
        .map(|list| list.iter().map(|e| e.trim_start_matches('.')).collect());
    let mut inputs = Vec::new();
    for pattern in &spec.paths {
        for path in matches(pattern)? {
            let input = input(path, spec, extensions.as_deref())?;
            if spec.loss_masking_spans.is_some() && input.format != InputFormat::Jsonl {
                return Err(InputError::SpansNeedJsonl {
                    path: input.path,
                    format: input.format,
                });
            }
            if input.format == InputFormat::Preference
                && input
                    .files
                    .iter()
                    .any(|(file, _)| matches!(format_of(file), Ok(InputFormat::Parquet)))
            {
                return Err(InputError::PreferenceNeedsJsonl { path: input.path });
            }
            if input.files.is_empty() {
                return Err(InputError::NothingMatches {
                    path: input.path.display().to_string(),
                });
            }
            inputs.push(input);
        }
    }
    let is_preference = |input: &&Input| input.format == InputFormat::Preference;
    if let (Some(pairs), Some(other)) = (
        inputs.iter().find(is_preference),
        inputs.iter().find(|input| !is_preference(input)),
    ) {
        return Err(InputError::MixedPreference {
            pairs: pairs.path.clone(),
            other: other.path.clone(),
            format: other.format,
        });
    }
    Ok(inputs)
}

/// The paths `pattern` stands for: itself, or its glob matches in sorted order.
fn matches(pattern: &str) -> Result<Vec<PathBuf>, InputError> {
    if !pattern.contains(['*', '?', '[']) {
        return Ok(vec![PathBuf::from(pattern)]);
    }
    let paths = glob::glob(pattern).map_err(|error| InputError::BadPattern {
        pattern: pattern.to_owned(),
        reason: error.to_string(),
    })?;
    // glob yields its matches in alphabetical order.
    let paths = paths
        .map(|path| {
            path.map_err(|error| InputError::Io {
                path: error.path().to_owned(),
                source: error.into(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if paths.is_empty() {
        return Err(InputError::NothingMatches {
            path: pattern.to_owned(),
        });
    }
    Ok(paths)
}

fn input(
    path: PathBuf,
    spec: &InputSpec,
    extensions: Option<&[&str]>,
) -> Result<Input, InputError> {
    let format = spec.format;
    let metadata = fs::metadata(&path).map_err(|source| InputError::Io {
        path: path.clone(),
        source,
    })?;
    let (format, files) = if metadata.is_dir() {
        let format = match format {
            InputFormat::Auto => InputFormat::Files,
            format => format,
        };
        (format, walk(&path, extensions)?)
    } else {
        let format = match format {
            // Only a regular file is sniffed: reading a pipe's first line here would take it
            // from the reader, and open the pipe a second time (which blocks for good once
            // its writer is gone).
            InputFormat::Auto => match format_of(&path)? {
                InputFormat::Jsonl if metadata.is_file() => sniff(&path, &fields(spec)),
                format => format,
            },
            format => format,
        };
        (format, vec![(Arc::from(path.as_path()), metadata.len())])
    };
    Ok(Input {
        bytes: files.iter().map(|(_, size)| size).sum(),
        path,
        format,
        documents: 0,
        bad_records: 0,
        skipped_files: 0,
        files,
    })
}

pub(super) fn fields(spec: &InputSpec) -> Fields {
    Fields {
        text: spec.field.clone(),
        messages: spec.messages_field.clone(),
        loss_masking_spans: spec.loss_masking_spans.clone(),
        preference: spec.preference_fields.clone(),
    }
}

fn format_of(path: &Path) -> Result<InputFormat, InputError> {
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let name = name
        .strip_suffix(".gz")
        .or_else(|| name.strip_suffix(".zst"))
        .unwrap_or(&name);
    if [".jsonl", ".json", ".ndjson"]
        .iter()
        .any(|e| name.ends_with(e))
    {
        Ok(InputFormat::Jsonl)
    } else if name.ends_with(".parquet") {
        Ok(InputFormat::Parquet)
    } else if name.ends_with(".txt") {
        Ok(InputFormat::Text)
    } else {
        Err(InputError::UnknownFormat {
            path: path.to_owned(),
        })
    }
}

/// Every regular file under `dir` with a wanted extension, depth first in name order. Hidden
/// entries (`.git`, `.env`) are skipped and symbolic links not followed.
fn walk(dir: &Path, extensions: Option<&[&str]>) -> Result<Vec<(Arc<Path>, u64)>, InputError> {
    let mut files = Vec::new();
    let entries = WalkDir::new(dir)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|entry| entry.depth() == 0 || !is_hidden(entry));
    for entry in entries {
        let entry = entry.map_err(|source| InputError::Walk {
            path: dir.to_owned(),
            source,
        })?;
        if !entry.file_type().is_file() || !has_extension(entry.path(), extensions) {
            continue;
        }
        let size = entry
            .metadata()
            .map_err(|source| InputError::Walk {
                path: dir.to_owned(),
                source,
            })?
            .len();
        files.push((Arc::from(entry.path()), size));
    }
    Ok(files)
}

fn is_hidden(entry: &DirEntry) -> bool {
    entry.file_name().as_encoded_bytes().starts_with(b".")
}

fn has_extension(path: &Path, extensions: Option<&[&str]>) -> bool {
    let Some(extensions) = extensions else {
        return true;
    };
    let name = path.file_name().unwrap_or_default().as_encoded_bytes();
    extensions.iter().any(|extension| {
        name.len() > extension.len()
            && name.ends_with(extension.as_bytes())
            && name[name.len() - extension.len() - 1] == b'.'
    })
}
