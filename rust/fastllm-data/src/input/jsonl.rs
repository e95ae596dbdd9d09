//! JSON lines, plain or compressed: one document per line, the text in a named string field.

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::record::{Content, Document, Location, PreferencePair, Record};
use super::spec::{InputFormat, PreferenceFields};

const BUFFER_BYTES: usize = 1 << 20;

pub(super) struct JsonlReader {
    file: Arc<Path>,
    lines: Box<dyn BufRead + Send>,
    line_number: u64,
    /// Bytes taken from the file on disk, before decompression.
    consumed: Arc<AtomicU64>,
    finished: bool,
}

impl JsonlReader {
    pub(super) fn open(file: Arc<Path>) -> io::Result<Self> {
        let consumed = Arc::new(AtomicU64::new(0));
        let raw = CountingReader {
            inner: File::open(&file)?,
            count: consumed.clone(),
        };
        let name = file.as_os_str().as_encoded_bytes();
        let decoded: Box<dyn Read + Send> = if name.ends_with(b".gz") {
            // Multi-member, so concatenated gzip files (and bgzip) are read to the end.
            Box::new(flate2::read::MultiGzDecoder::new(raw))
        } else if name.ends_with(b".zst") {
            Box::new(zstd::Decoder::new(raw)?)
        } else {
            Box::new(raw)
        };
        Ok(Self {
            file,
            lines: Box::new(BufReader::with_capacity(BUFFER_BYTES, decoded)),
            line_number: 0,
            consumed,
            finished: false,
        })
    }

    pub(super) fn file(&self) -> &Arc<Path> {
        &self.file
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.consumed.load(Ordering::Relaxed)
    }

    /// Appends the next non-blank line to `lines` and returns its number and place there;
    /// `None` at the end of the file. A read error ends the file and is returned once.
    pub(super) fn next_line(
        &mut self,
        lines: &mut Vec<u8>,
    ) -> Option<Result<(u64, Range<usize>), Record>> {
        while !self.finished {
            let start = lines.len();
            match self.lines.read_until(b'\n', lines) {
                Ok(0) => self.finished = true,
                Ok(_) => {
                    self.line_number += 1;
                    if !lines[start..].iter().all(u8::is_ascii_whitespace) {
                        return Some(Ok((self.line_number, start..lines.len())));
                    }
                    lines.truncate(start);
                }
                Err(error) => {
                    self.finished = true;
                    lines.truncate(start);
                    let reason = format!("cannot read: {error}");
                    return Some(Err(Record::bad(&self.file, self.line_number + 1, reason)));
                }
            }
        }
        None
    }
}

/// The fields a JSON record is read from.
pub(super) struct Fields {
    pub text: String,
    pub messages: String,
    pub loss_masking_spans: Option<String>,
    pub preference: PreferenceFields,
}

/// Line `line_number` of `file`, read as `format` (JSON lines, chat or preference), as a
/// document or a bad record.
pub(super) fn parse_line(
    file: &Arc<Path>,
    line_number: u64,
    line: &[u8],
    fields: &Fields,
    format: InputFormat,
) -> Record {
    let Ok(line) = std::str::from_utf8(line) else {
        return Record::bad(file, line_number, "invalid UTF-8");
    };
    let parsed = match (format, &fields.loss_masking_spans) {
        (InputFormat::Chat, _) => {
            conversation(line, &fields.messages).map(|messages| (String::new(), messages))
        }
        (InputFormat::Preference, _) => {
            preference(line, &fields.preference).map(|pair| (String::new(), pair))
        }
        (_, Some(spans)) => text_with_spans(line, &fields.text, spans),
        (_, None) => text_field(line, &fields.text).map(|text| (text, Content::Text)),
    };
    match parsed {
        Ok((text, content)) => Record::Document(Document {
            text,
            content,
            location: Location {
                file: file.clone(),
                line_or_row: line_number,
            },
        }),
        Err(reason) => Record::bad(file, line_number, reason),
    }
}

/// What the first record of `file` holds: `Preference` when it has the chosen and rejected
/// fields, `Chat` when it has the messages field and not the text field, else `Jsonl`.
pub(super) fn sniff(file: &Path, fields: &Fields) -> InputFormat {
    let Ok(mut reader) = JsonlReader::open(Arc::from(file)) else {
        return InputFormat::Jsonl;
    };
    let mut line = Vec::new();
    let Some(Ok(_)) = reader.next_line(&mut line) else {
        return InputFormat::Jsonl;
    };
    let Ok(serde_json::Value::Object(record)) = serde_json::from_slice(&line) else {
        return InputFormat::Jsonl;
    };
    let has = |field: &String| record.contains_key(field);
    if has(&fields.preference.chosen) && has(&fields.preference.rejected) {
        InputFormat::Preference
    } else if has(&fields.messages) && !has(&fields.text) {
        InputFormat::Chat
    } else {
        InputFormat::Jsonl
    }
}

fn json_object(line: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(line) {
        Ok(serde_json::Value::Object(record)) => Ok(record),
        Ok(_) => Err("not a JSON object".to_owned()),
        Err(error) => Err(format!("invalid JSON: {error}")),
    }
}

fn conversation(line: &str, field: &str) -> Result<Content, String> {
    let mut record = json_object(line)?;
    record
        .remove(field)
        .map(Content::Conversation)
        .ok_or_else(|| format!("no field \"{field}\""))
}

fn preference(line: &str, fields: &PreferenceFields) -> Result<Content, String> {
    let mut record = json_object(line)?;
    let mut take = |field: &str| match record.remove(field) {
        None | Some(serde_json::Value::Null) => None,
        Some(value) => Some(value),
    };
    let prompt = take(&fields.prompt);
    let chosen = take(&fields.chosen).ok_or_else(|| format!("no field \"{}\"", fields.chosen))?;
    let rejected =
        take(&fields.rejected).ok_or_else(|| format!("no field \"{}\"", fields.rejected))?;
    Ok(Content::Preference(Box::new(PreferencePair {
        prompt,
        chosen,
        rejected,
    })))
}

fn text_with_spans(
    line: &str,
    field: &str,
    spans_field: &str,
) -> Result<(String, Content), String> {
    let mut record = json_object(line)?;
    let text = match record.remove(field) {
        Some(serde_json::Value::String(text)) => text,
        Some(_) => return Err(format!("field \"{field}\" is not a string")),
        None => return Err(format!("no field \"{field}\"")),
    };
    let spans = match record.remove(spans_field) {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(spans) => serde_json::from_value::<Vec<[u64; 2]>>(spans).map_err(|_| {
            format!("field \"{spans_field}\" is not a list of [begin, end] character positions")
        })?,
    };
    Ok((text, Content::TextWithSpans(spans)))
}

struct CountingReader<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The string `field` of the JSON object `line`, or why there is none. Only that field is
/// copied; the others are parsed and dropped.
fn text_field(line: &str, field: &str) -> Result<String, String> {
    let mut deserializer = serde_json::Deserializer::from_str(line);
    let text = ObjectField { field }
        .deserialize(&mut deserializer)
        .and_then(|text| deserializer.end().map(|()| text))
        .map_err(|error| match error.classify() {
            serde_json::error::Category::Data => error.to_string(),
            _ => format!("invalid JSON: {error}"),
        })?;
    text.ok_or_else(|| format!("no field \"{field}\""))
}

/// Deserializes a JSON object to its string field `field`, if present.
struct ObjectField<'a> {
    field: &'a str,
}

impl<'de> DeserializeSeed<'de> for ObjectField<'_> {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ObjectField<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON object with field \"{}\"", self.field)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut text = None;
        while let Some(is_field) = map.next_key_seed(KeyIs(self.field))? {
            if is_field {
                text = Some(map.next_value_seed(StringField(self.field))?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(text)
    }
}

/// Deserializes an object key to whether it is the wanted one, without allocating.
struct KeyIs<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

/// Deserializes the wanted field's value, which must be a string.
struct StringField<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for StringField<'_> {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        deserializer.deserialize_string(self)
    }
}

impl Visitor<'_> for StringField<'_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field \"{}\" to be a string", self.0)
    }

    fn visit_str<E>(self, text: &str) -> Result<String, E> {
        Ok(text.to_owned())
    }

    fn visit_string<E>(self, text: String) -> Result<String, E> {
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::text_field;

    #[test]
    fn takes_the_named_string_field_and_skips_the_rest() {
        let line = r#"{"id": 1, "meta": {"text": "no"}, "text": "a\nb \u00e9", "x": [1, {}]}"#;
        assert_eq!(text_field(line, "text").unwrap(), "a\nb é");
    }

    #[test]
    fn explains_each_kind_of_bad_line() {
        let reason = |line| text_field(line, "text").unwrap_err();
        assert_eq!(reason(r#"{"content": "x"}"#), "no field \"text\"");
        assert!(reason(r#"{"text": 5}"#).contains("expected field \"text\" to be a string"));
        assert!(reason(r#"{"text": null}"#).contains("invalid type: null"));
        assert!(reason(r#"["text"]"#).contains("expected a JSON object"));
        assert!(reason(r#"{"text": "x""#).starts_with("invalid JSON"));
        assert!(reason(r#"{"text": "x"} 1"#).starts_with("invalid JSON"));
    }
}
