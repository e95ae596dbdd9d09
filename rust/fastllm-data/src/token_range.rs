//! Token ids checked against a model's vocabulary before training, whatever `metadata.json`
//! says (a `.bin` changed after `prepare`, by a bad copy or a flipped bit, still matches its
//! metadata): the smallest and largest id, found by one scan of `.bin`, then cached, so that
//! restarts and the other ranks read two numbers instead of the whole file.
//!
//! The cache file `token_range_HASH.txt` holds the two ids in decimal (or `none` for a dataset
//! without tokens); HASH covers the `.bin` path, size and modification time, so a dataset
//! rewritten in place is scanned again. A cache file that lies is caught later all the same:
//! [`crate::SampleSource`] checks every token it copies into a batch.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::atomic_file::write_atomically;
use crate::stable_hash::StableHasher;
use crate::{DataError, IndexedDataset};

impl IndexedDataset {
    /// The smallest and largest token id in `.bin` (`None` without tokens), from `cache_dir`
    /// when a scan of this very file is cached there; otherwise scans and caches them.
    pub fn cached_token_range(
        &self,
        cache_dir: impl AsRef<Path>,
    ) -> Result<Option<(i64, i64)>, DataError> {
        let cache_dir = cache_dir.as_ref();
        let path = cache_path(self.bin_path(), cache_dir)?;
        // An unreadable or garbled cache is only rebuilt.
        if let Some(cached) = fs::read_to_string(&path).ok().and_then(|t| parse(&t)) {
            return Ok(cached);
        }
        let range = self.all_tokens().min_max();
        fs::create_dir_all(cache_dir).map_err(DataError::io(cache_dir))?;
        write_atomically(&path, |w| match range {
            Some((min, max)) => writeln!(w, "{min} {max}"),
            None => writeln!(w, "none"),
        })?;
        Ok(range)
    }

    /// Fails naming the first document that holds an id outside `0..vocab_size`; the range is
    /// read from `cache_dir` as [`cached_token_range`](Self::cached_token_range) says.
    pub fn check_token_range(
        &self,
        vocab_size: u64,
        cache_dir: impl AsRef<Path>,
    ) -> Result<(), DataError> {
        match self.cached_token_range(cache_dir)? {
            Some((min, max)) if min < 0 || max as u64 >= vocab_size => {
                self.first_beyond(vocab_size).map_or(Ok(()), Err)
            }
            _ => Ok(()),
        }
    }

    /// The error for the first token outside `0..vocab_size`, if any: a scan document by
    /// document, only once the range says there is one.
    fn first_beyond(&self, vocab_size: u64) -> Option<DataError> {
        (0..self.len()).find_map(|document| {
            let tokens = self.document(document).expect("a document of the dataset");
            let (_, token) = tokens.first_beyond(vocab_size)?;
            Some(DataError::BeyondVocabulary {
                path: self.bin_path().to_owned(),
                document,
                token,
                vocab_size,
            })
        })
    }
}

fn cache_path(bin: &Path, cache_dir: &Path) -> Result<PathBuf, DataError> {
    let metadata = fs::metadata(bin).map_err(DataError::io(bin))?;
    let modified = metadata
        .modified()
        .ok()
        .and_then(|time| time.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |since| since.as_nanos() as u64);
    let absolute = std::path::absolute(bin).map_err(DataError::io(bin))?;
    let mut hasher = StableHasher::new();
    hasher.write_all(absolute.as_os_str().as_encoded_bytes());
    hasher.write_u64(metadata.len());
    hasher.write_u64(modified);
    Ok(cache_dir.join(format!("token_range_{:016x}.txt", hasher.finish())))
}

/// `Some(range)` for a well-formed cache file, `None` otherwise.
fn parse(text: &str) -> Option<Option<(i64, i64)>> {
    match text.trim() {
        "none" => Some(None),
        numbers => {
            let (min, max) = numbers.split_once(' ')?;
            let (min, max) = (min.parse().ok()?, max.parse().ok()?);
            (min <= max).then_some(Some((min, max)))
        }
    }
}
