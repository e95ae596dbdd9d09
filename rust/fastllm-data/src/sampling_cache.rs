//! Saving and reusing sampling indices, so that every rank and every restart reads the index
//! instead of rebuilding it.
//!
//! File layout, all little-endian: the magic `FLLMSMPL`, ten u64 header fields (format version,
//! inputs hash, payload checksum, sequence length, sample count, seed, mode, document count,
//! order length, sample-start count), then u32 document lengths, u32 order, u64 start positions
//! and u32 start offsets.

use std::fs;
use std::io::{self, Write};
use std::path::Path;

use crate::atomic_file::write_atomically;
use crate::sampling::{checked_lengths, SamplingConfig, SamplingIndex, SamplingMode};
use crate::stable_hash::StableHasher;
use crate::{Cancel, DataError};

const MAGIC: &[u8; 8] = b"FLLMSMPL";
/// Bump when the file layout or the sampling algorithm changes: caches of other versions are
/// then rebuilt.
const FORMAT_VERSION: u64 = 1;
const HEADER_FIELDS: usize = 10;
const HEADER_LEN: usize = MAGIC.len() + 8 * HEADER_FIELDS;

/// Whether [`SamplingIndex::load_or_build`] found a valid cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheStatus {
    Reused,
    Built,
}

impl SamplingIndex {
    /// A hash of every input of the index (document lengths, configuration) and of the format
    /// version; the cache file name and header carry it.
    pub fn inputs_hash(&self) -> u64 {
        inputs_hash(&self.document_lengths, &self.config)
    }

    /// Writes the index to `path` atomically (temporary file, fsync, rename).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), DataError> {
        let config = &self.config;
        let header: [u64; HEADER_FIELDS] = [
            FORMAT_VERSION,
            self.inputs_hash(),
            self.payload_checksum(),
            config.sequence_length.into(),
            config.num_samples as u64,
            config.seed,
            mode_code(config.mode),
            self.document_lengths.len() as u64,
            self.order.len() as u64,
            self.start_positions.len() as u64,
        ];
        write_atomically(path.as_ref(), |w| {
            w.write_all(MAGIC)?;
            write_le(w, &header, u64::to_le_bytes)?;
            write_le(w, &self.document_lengths, u32::to_le_bytes)?;
            write_le(w, &self.order, u32::to_le_bytes)?;
            write_le(w, &self.start_positions, u64::to_le_bytes)?;
            write_le(w, &self.start_offsets, u32::to_le_bytes)
        })
    }

    /// Reads an index written by [`save`](Self::save), checking its format version, size, inputs
    /// hash and payload checksum, and that no sample of it reads out of bounds.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(DataError::io(path))?;
        let corrupt = |reason| DataError::CorruptCache {
            path: path.to_owned(),
            reason,
        };
        if bytes.len() < HEADER_LEN || &bytes[..MAGIC.len()] != MAGIC {
            return Err(corrupt("bad magic or truncated header"));
        }
        let header: Vec<u64> = read_le(&bytes[MAGIC.len()..HEADER_LEN], u64::from_le_bytes);
        let [version, inputs_hash, checksum, sequence_length, num_samples, seed, mode, documents, order, starts] =
            header[..]
        else {
            unreachable!("the header has {HEADER_FIELDS} fields")
        };
        if version != FORMAT_VERSION {
            return Err(corrupt("written by another format version"));
        }
        let expected_len = HEADER_LEN as u128
            + 4 * u128::from(documents)
            + 4 * u128::from(order)
            + 12 * u128::from(starts);
        if expected_len != bytes.len() as u128 {
            return Err(corrupt("file size does not match the header"));
        }
        let config = SamplingConfig {
            sequence_length: u32::try_from(sequence_length)
                .map_err(|_| corrupt("sequence length out of range"))?,
            num_samples: usize::try_from(num_samples)
                .map_err(|_| corrupt("sample count out of range"))?,
            seed,
            mode: mode_from_code(mode).ok_or_else(|| corrupt("unknown sampling mode"))?,
        };
        // The size check bounds every count by the file length.
        let (lengths_bytes, rest) = bytes[HEADER_LEN..].split_at(documents as usize * 4);
        let (order_bytes, rest) = rest.split_at(order as usize * 4);
        let (positions_bytes, offsets_bytes) = rest.split_at(starts as usize * 8);
        let index = Self {
            config,
            document_lengths: read_le(lengths_bytes, u32::from_le_bytes),
            order: read_le(order_bytes, u32::from_le_bytes),
            start_positions: read_le(positions_bytes, u64::from_le_bytes),
            start_offsets: read_le(offsets_bytes, u32::from_le_bytes),
        };
        if index.inputs_hash() != inputs_hash {
            return Err(corrupt("inputs do not match their hash"));
        }
        if index.payload_checksum() != checksum {
            return Err(corrupt("checksum mismatch"));
        }
        index.check_bounds().map_err(corrupt)?;
        Ok(index)
    }

    /// Reuses `cache_dir/sampling_HASH.bin` when it holds a valid index for exactly these
    /// inputs, and otherwise builds the index (unless `cancel` stops it) and saves it there.
    pub fn load_or_build<T: Copy + Into<i64>>(
        cache_dir: impl AsRef<Path>,
        document_lengths: &[T],
        config: SamplingConfig,
        cancel: &Cancel,
    ) -> Result<(Self, CacheStatus), DataError> {
        let cache_dir = cache_dir.as_ref();
        let lengths = checked_lengths(document_lengths)?;
        let path = cache_dir.join(format!(
            "sampling_{:016x}.bin",
            inputs_hash(&lengths, &config)
        ));
        // Any unreadable, corrupt or mismatched cache is simply rebuilt and replaced.
        if let Ok(index) = Self::load(&path) {
            if index.config == config && index.document_lengths == lengths {
                return Ok((index, CacheStatus::Reused));
            }
        }
        let index = Self::build_from(lengths, config, cancel)?;
        fs::create_dir_all(cache_dir).map_err(DataError::io(cache_dir))?;
        index.save(&path)?;
        Ok((index, CacheStatus::Built))
    }

    fn payload_checksum(&self) -> u64 {
        let mut hasher = StableHasher::new();
        hasher.write_all(&self.order);
        hasher.write_all(&self.start_positions);
        hasher.write_all(&self.start_offsets);
        hasher.finish()
    }
}

fn inputs_hash(document_lengths: &[u32], config: &SamplingConfig) -> u64 {
    let mut hasher = StableHasher::new();
    hasher.write_u64(FORMAT_VERSION);
    hasher.write_u64(config.sequence_length.into());
    hasher.write_u64(config.num_samples as u64);
    hasher.write_u64(config.seed);
    hasher.write_u64(mode_code(config.mode));
    hasher.write_all(document_lengths);
    hasher.finish()
}

fn mode_code(mode: SamplingMode) -> u64 {
    match mode {
        SamplingMode::Packed => 0,
        SamplingMode::Truncated => 1,
    }
}

fn mode_from_code(code: u64) -> Option<SamplingMode> {
    match code {
        0 => Some(SamplingMode::Packed),
        1 => Some(SamplingMode::Truncated),
        _ => None,
    }
}

/// Writes `values` little-endian, a block at a time rather than a value at a time.
fn write_le<T: Copy, const N: usize>(
    w: &mut impl Write,
    values: &[T],
    to_bytes: impl Fn(T) -> [u8; N],
) -> io::Result<()> {
    let mut block = Vec::with_capacity(4096 * N);
    for chunk in values.chunks(4096) {
        block.clear();
        for &value in chunk {
            block.extend_from_slice(&to_bytes(value));
        }
        w.write_all(&block)?;
    }
    Ok(())
}

fn read_le<T, const N: usize>(bytes: &[u8], from_bytes: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|chunk| from_bytes(chunk.try_into().expect("chunks_exact yields N bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache whose content reads out of bounds, yet with a valid checksum (as anyone can
    /// write one), is rebuilt, not trusted.
    #[test]
    fn a_cache_that_reads_out_of_bounds_is_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let lengths: Vec<u32> = (0..30).map(|d| 1 + d % 9).collect();
        for mode in [SamplingMode::Packed, SamplingMode::Truncated] {
            let config = SamplingConfig {
                sequence_length: 8,
                num_samples: 20,
                seed: 3,
                mode,
            };
            let (built, _) =
                SamplingIndex::load_or_build(dir.path(), &lengths, config, &Cancel::default())
                    .unwrap();
            let path = dir
                .path()
                .join(format!("sampling_{:016x}.bin", built.inputs_hash()));
            let mut damages: Vec<fn(&mut SamplingIndex)> =
                vec![|index| index.order[3] = 1000, |index| {
                    index.order.truncate(index.order.len() / 2)
                }];
            if mode == SamplingMode::Packed {
                damages.push(|index| index.start_offsets[5] = 10_000);
                damages.push(|index| index.start_positions[19] = u64::MAX);
                damages.push(|index| index.start_positions.swap(4, 12));
            }
            for damage in damages {
                let mut damaged = built.clone();
                damage(&mut damaged);
                damaged.save(&path).unwrap();
                assert!(matches!(
                    SamplingIndex::load(&path),
                    Err(DataError::CorruptCache { .. })
                ));
                let (index, status) =
                    SamplingIndex::load_or_build(dir.path(), &lengths, config, &Cancel::default())
                        .unwrap();
                assert_eq!(status, CacheStatus::Built);
                assert!(index == built);
            }
        }
    }
}
