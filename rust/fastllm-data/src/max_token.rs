//! The largest token id of a dataset that does not record it (a Megatron dataset made
//! elsewhere, or one prepared before `prepare` recorded it): found by one scan of `.bin`, then
//! cached, so that restarts and the other ranks read one number instead of the whole file.
//!
//! The cache file `max_token_HASH.txt` holds the id in decimal (or `none` for a dataset without
//! tokens); HASH covers the `.bin` path, size and modification time, so a dataset rewritten in
//! place is scanned again.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::atomic_file::write_atomically;
use crate::stable_hash::StableHasher;
use crate::{DataError, IndexedDataset};

impl IndexedDataset {
    /// The largest token id in `.bin` (`None` without tokens), from `cache_dir` when a scan of
    /// this very file is cached there; otherwise scans and caches it.
    pub fn cached_max_token_id(
        &self,
        cache_dir: impl AsRef<Path>,
    ) -> Result<Option<i64>, DataError> {
        let cache_dir = cache_dir.as_ref();
        let path = cache_path(self.bin_path(), cache_dir)?;
        // An unreadable or garbled cache is only rebuilt.
        if let Some(cached) = fs::read_to_string(&path).ok().and_then(|t| parse(&t)) {
            return Ok(cached);
        }
        let max = self.all_tokens().max();
        fs::create_dir_all(cache_dir).map_err(DataError::io(cache_dir))?;
        write_atomically(&path, |w| match max {
            Some(id) => writeln!(w, "{id}"),
            None => writeln!(w, "none"),
        })?;
        Ok(max)
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
    Ok(cache_dir.join(format!("max_token_{:016x}.txt", hasher.finish())))
}

/// `Some(max)` for a well-formed cache file, `None` otherwise.
fn parse(text: &str) -> Option<Option<i64>> {
    match text.trim() {
        "none" => Some(None),
        number => number.parse().ok().map(Some),
    }
}
