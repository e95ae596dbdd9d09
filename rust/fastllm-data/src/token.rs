//! Token element types of the MMIDIDX format and zero-copy views of tokens in those types.

use std::fmt;
use std::ops::RangeInclusive;

// Token files are little-endian and are read in place, without byte swapping.
#[cfg(target_endian = "big")]
compile_error!(
    "fastllm-data reads little-endian token files in place; big-endian targets are not supported"
);

/// The integer types a `.bin` file may hold. Megatron also defines float codes (6, 7); they
/// cannot hold token ids and are rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    U16,
    I32,
    I64,
}

impl TokenDtype {
    /// The type we write for a vocabulary: uint16 while every id fits, else int32.
    pub fn for_vocab_size(vocab_size: u64) -> Self {
        if vocab_size <= 1 << 16 {
            Self::U16
        } else {
            Self::I32
        }
    }

    /// Megatron's code for this type in the `.idx` header.
    pub fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::U16 => 8,
        }
    }

    /// The integer type with Megatron's code `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::U8),
            2 => Some(Self::I8),
            3 => Some(Self::I16),
            4 => Some(Self::I32),
            5 => Some(Self::I64),
            8 => Some(Self::U16),
            _ => None,
        }
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    pub(crate) fn range(self) -> RangeInclusive<i64> {
        match self {
            Self::U8 => 0..=u8::MAX.into(),
            Self::I8 => i8::MIN.into()..=i8::MAX.into(),
            Self::I16 => i16::MIN.into()..=i16::MAX.into(),
            Self::U16 => 0..=u16::MAX.into(),
            Self::I32 => i32::MIN.into()..=i32::MAX.into(),
            Self::I64 => i64::MIN..=i64::MAX,
        }
    }
}

impl fmt::Display for TokenDtype {
    /// NumPy's name, as Megatron's Python side spells it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::U8 => "uint8",
            Self::I8 => "int8",
            Self::I16 => "int16",
            Self::U16 => "uint16",
            Self::I32 => "int32",
            Self::I64 => "int64",
        })
    }
}

/// Tokens borrowed straight from a memory-mapped `.bin` file, in the file's own type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenSlice<'a> {
    U8(&'a [u8]),
    I8(&'a [i8]),
    I16(&'a [i16]),
    U16(&'a [u16]),
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl<'a> TokenSlice<'a> {
    /// Views `bytes` as tokens of type `dtype`.
    ///
    /// Panics if `bytes` is not aligned to `dtype` or not a whole number of tokens; callers
    /// guarantee both from the validated index.
    pub(crate) fn from_bytes(dtype: TokenDtype, bytes: &'a [u8]) -> Self {
        match dtype {
            TokenDtype::U8 => Self::U8(bytes),
            TokenDtype::I8 => Self::I8(cast(bytes)),
            TokenDtype::I16 => Self::I16(cast(bytes)),
            TokenDtype::U16 => Self::U16(cast(bytes)),
            TokenDtype::I32 => Self::I32(cast(bytes)),
            TokenDtype::I64 => Self::I64(cast(bytes)),
        }
    }

    pub(crate) fn empty(dtype: TokenDtype) -> Self {
        match dtype {
            TokenDtype::U8 => Self::U8(&[]),
            TokenDtype::I8 => Self::I8(&[]),
            TokenDtype::I16 => Self::I16(&[]),
            TokenDtype::U16 => Self::U16(&[]),
            TokenDtype::I32 => Self::I32(&[]),
            TokenDtype::I64 => Self::I64(&[]),
        }
    }

    pub fn dtype(&self) -> TokenDtype {
        match self {
            Self::U8(_) => TokenDtype::U8,
            Self::I8(_) => TokenDtype::I8,
            Self::I16(_) => TokenDtype::I16,
            Self::U16(_) => TokenDtype::U16,
            Self::I32(_) => TokenDtype::I32,
            Self::I64(_) => TokenDtype::I64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::U8(t) => t.len(),
            Self::I8(t) => t.len(),
            Self::I16(t) => t.len(),
            Self::U16(t) => t.len(),
            Self::I32(t) => t.len(),
            Self::I64(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Widens every token into `out`.
    ///
    /// Panics if `out.len() != self.len()`, like `slice::copy_from_slice`.
    pub fn copy_to(&self, out: &mut [i64]) {
        assert_eq!(
            out.len(),
            self.len(),
            "destination length must equal the token count"
        );
        fn widen<T: Copy + Into<i64>>(tokens: &[T], out: &mut [i64]) {
            for (o, &t) in out.iter_mut().zip(tokens) {
                *o = t.into();
            }
        }
        match self {
            Self::U8(t) => widen(t, out),
            Self::I8(t) => widen(t, out),
            Self::I16(t) => widen(t, out),
            Self::U16(t) => widen(t, out),
            Self::I32(t) => widen(t, out),
            Self::I64(t) => out.copy_from_slice(t),
        }
    }

    /// The smallest and the largest token, or `None` when there are none.
    pub fn min_max(&self) -> Option<(i64, i64)> {
        fn bounds<T: Copy + Ord + Into<i64>>(tokens: &[T]) -> Option<(i64, i64)> {
            let first = *tokens.first()?;
            let (min, max) = tokens
                .iter()
                .fold((first, first), |(min, max), &t| (min.min(t), max.max(t)));
            Some((min.into(), max.into()))
        }
        match self {
            Self::U8(t) => bounds(t),
            Self::I8(t) => bounds(t),
            Self::I16(t) => bounds(t),
            Self::U16(t) => bounds(t),
            Self::I32(t) => bounds(t),
            Self::I64(t) => bounds(t),
        }
    }

    /// The position and value of the first token outside `0..vocab_size`, if any.
    pub fn first_beyond(&self, vocab_size: u64) -> Option<(usize, i64)> {
        fn find<T: Copy + Into<i64>>(tokens: &[T], vocab_size: u64) -> Option<(usize, i64)> {
            // A negative id wraps to a huge u64: one comparison covers both ends.
            tokens
                .iter()
                .map(|&t| t.into())
                .enumerate()
                .find(|&(_, t)| t as u64 >= vocab_size)
        }
        match self {
            Self::U8(t) => find(t, vocab_size),
            Self::I8(t) => find(t, vocab_size),
            Self::I16(t) => find(t, vocab_size),
            Self::U16(t) => find(t, vocab_size),
            Self::I32(t) => find(t, vocab_size),
            Self::I64(t) => find(t, vocab_size),
        }
    }

    pub fn to_vec(&self) -> Vec<i64> {
        let mut out = vec![0; self.len()];
        self.copy_to(&mut out);
        out
    }
}

/// Primitive integers: every bit pattern is a valid value.
///
/// # Safety
/// Implement only for types with no padding and no invalid bit patterns.
unsafe trait Plain: Copy {}
unsafe impl Plain for i8 {}
unsafe impl Plain for i16 {}
unsafe impl Plain for u16 {}
unsafe impl Plain for i32 {}
unsafe impl Plain for i64 {}

fn cast<T: Plain>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        bytes.as_ptr().align_offset(std::mem::align_of::<T>()) == 0 && bytes.len() % size == 0,
        "token bytes must be aligned and a whole number of tokens"
    );
    // SAFETY: the pointer is aligned for `T` and the length is a whole number of `T`s (checked
    // above), `T: Plain` accepts any bit pattern, and the result borrows `bytes`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_integer_code_round_trips_and_float_codes_are_rejected() {
        for dtype in [
            TokenDtype::U8,
            TokenDtype::I8,
            TokenDtype::I16,
            TokenDtype::U16,
            TokenDtype::I32,
            TokenDtype::I64,
        ] {
            assert_eq!(TokenDtype::from_code(dtype.code()), Some(dtype));
        }
        for code in [0, 6, 7, 9, 255] {
            assert_eq!(TokenDtype::from_code(code), None);
        }
    }

    #[test]
    fn vocabularies_up_to_65536_use_uint16() {
        assert_eq!(TokenDtype::for_vocab_size(65_536), TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab_size(65_537), TokenDtype::I32);
        assert_eq!(TokenDtype::for_vocab_size(32_000), TokenDtype::U16);
    }

    #[repr(align(8))]
    struct Aligned([u8; 16]);

    #[test]
    fn from_bytes_reads_little_endian_values() {
        let mut buffer = Aligned([0; 16]);
        for (chunk, value) in buffer
            .0
            .chunks_exact_mut(4)
            .zip([1i32, -2, 70_000, i32::MIN])
        {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
        let tokens = TokenSlice::from_bytes(TokenDtype::I32, &buffer.0);
        assert_eq!(tokens, TokenSlice::I32(&[1, -2, 70_000, i32::MIN]));
        assert_eq!(tokens.to_vec(), vec![1, -2, 70_000, i64::from(i32::MIN)]);
    }

    #[test]
    #[should_panic(expected = "aligned")]
    fn from_bytes_rejects_misaligned_bytes() {
        let buffer = Aligned([0; 16]);
        TokenSlice::from_bytes(TokenDtype::U16, &buffer.0[1..5]);
    }

    #[test]
    #[should_panic(expected = "whole number")]
    fn from_bytes_rejects_partial_tokens() {
        let buffer = Aligned([0; 16]);
        TokenSlice::from_bytes(TokenDtype::I64, &buffer.0[..12]);
    }
}
