//! A 64-bit hash fixed by this code alone (std's `DefaultHasher` may change between Rust
//! releases), for cache keys and checksums. It detects accidents, not adversaries.

use crate::random::mix;

pub(crate) struct StableHasher(u64);

impl StableHasher {
    pub(crate) fn new() -> Self {
        Self(0x6661_7374_6c6c_6d00)
    }

    pub(crate) fn write_u64(&mut self, value: u64) {
        // The added constant keeps runs of zeros from hashing to zero.
        self.0 = mix(self.0 ^ value).wrapping_add(0x9E37_79B9_7F4A_7C15);
    }

    /// Hashes the length first, so that concatenations of slices cannot collide trivially.
    pub(crate) fn write_all<T: Copy + Into<u64>>(&mut self, values: &[T]) {
        self.write_u64(values.len() as u64);
        for &value in values {
            self.write_u64(value.into());
        }
    }

    pub(crate) fn finish(&self) -> u64 {
        mix(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(values: &[u32]) -> u64 {
        let mut hasher = StableHasher::new();
        hasher.write_all(values);
        hasher.finish()
    }

    #[test]
    fn any_change_changes_the_hash() {
        let base = hash(&[0, 0, 0]);
        assert_ne!(base, hash(&[0, 0]));
        assert_ne!(base, hash(&[0, 0, 0, 0]));
        assert_ne!(base, hash(&[0, 1, 0]));
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_eq!(base, hash(&[0, 0, 0]));
    }
}
