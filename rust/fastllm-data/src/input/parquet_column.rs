//! Parquet files: one document per row, from a string column read by name.

use std::collections::VecDeque;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::{get_typed_column_reader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::record::{Content, Document, Location, Record};

/// Rows decoded per call into the column reader.
const ROWS_PER_READ: usize = 1024;

pub(super) struct ParquetReader {
    file: Arc<Path>,
    reader: SerializedFileReader<File>,
    column: usize,
    /// Whether rows may be null (the column's maximum definition level).
    max_definition_level: i16,
    next_row_group: usize,
    column_reader: Option<ColumnReaderImpl<ByteArrayType>>,
    values: Vec<ByteArray>,
    definition_levels: Vec<i16>,
    records: VecDeque<Record>,
    rows_read: u64,
    /// Compressed bytes of the row groups opened so far.
    consumed: u64,
    finished: bool,
}

impl ParquetReader {
    /// Opens `file` and finds the string column `field`, or says why it cannot.
    pub(super) fn open(file: Arc<Path>, field: &str) -> Result<Self, String> {
        let handle = File::open(&file).map_err(|error| format!("cannot read: {error}"))?;
        let reader =
            SerializedFileReader::new(handle).map_err(|error| format!("cannot read: {error}"))?;
        let schema = reader.metadata().file_metadata().schema_descr_ptr();
        let column = schema
            .columns()
            .iter()
            .position(|column| column.path().string() == field)
            .ok_or_else(|| format!("no column \"{field}\""))?;
        let descriptor = schema.column(column);
        if descriptor.physical_type() != PhysicalType::BYTE_ARRAY {
            return Err(format!(
                "column \"{field}\" holds {}, not strings",
                descriptor.physical_type()
            ));
        }
        if descriptor.max_rep_level() > 0 {
            return Err(format!("column \"{field}\" is a list, not a string"));
        }
        Ok(Self {
            file,
            reader,
            column,
            max_definition_level: descriptor.max_def_level(),
            next_row_group: 0,
            column_reader: None,
            values: Vec::new(),
            definition_levels: Vec::new(),
            records: VecDeque::new(),
            rows_read: 0,
            consumed: 0,
            finished: false,
        })
    }

    pub(super) fn bytes_read(&self) -> u64 {
        self.consumed
    }

    /// The next row as a document or a bad record; `None` after the last row or after a read
    /// error (reported once, as a bad record).
    pub(super) fn next(&mut self) -> Option<Record> {
        while self.records.is_empty() && !self.finished {
            if let Err(error) = self.read_rows() {
                self.finished = true;
                let row = self.rows_read + 1;
                return Some(Record::bad(
                    &self.file,
                    row,
                    format!("cannot read: {error}"),
                ));
            }
        }
        self.records.pop_front()
    }

    /// Decodes up to [`ROWS_PER_READ`] rows into `records`, moving to the next row group when
    /// the current one is done.
    fn read_rows(&mut self) -> parquet::errors::Result<()> {
        let Some(column_reader) = &mut self.column_reader else {
            if self.next_row_group == self.reader.num_row_groups() {
                self.finished = true;
                return Ok(());
            }
            let row_group = self.reader.get_row_group(self.next_row_group)?;
            self.consumed += row_group.metadata().compressed_size() as u64;
            let column_reader = row_group.get_column_reader(self.column)?;
            self.column_reader = Some(get_typed_column_reader(column_reader));
            self.next_row_group += 1;
            return Ok(());
        };
        self.values.clear();
        self.definition_levels.clear();
        let (rows, _, _) = column_reader.read_records(
            ROWS_PER_READ,
            Some(&mut self.definition_levels),
            None,
            &mut self.values,
        )?;
        if rows == 0 {
            self.column_reader = None;
            return Ok(());
        }
        let mut values = self.values.drain(..);
        for row in 0..rows {
            self.rows_read += 1;
            let present = self.max_definition_level == 0
                || self.definition_levels[row] == self.max_definition_level;
            // `values` holds the non-null values only.
            let value = if present { values.next() } else { None };
            let record = match value {
                None => Record::bad(&self.file, self.rows_read, "null instead of a string"),
                Some(value) => match String::from_utf8(Vec::from(value.data())) {
                    Ok(text) => Record::Document(Document {
                        text,
                        content: Content::Text,
                        location: Location {
                            file: self.file.clone(),
                            line_or_row: self.rows_read,
                        },
                    }),
                    Err(_) => Record::bad(&self.file, self.rows_read, "invalid UTF-8"),
                },
            };
            self.records.push_back(record);
        }
        Ok(())
    }
}
