use std::fmt;
use std::str::FromStr;

use crate::CheckpointError;

/// Element types of safetensors, under their safetensors names.
///
/// Declared in the order of safetensors' own enum, whose reverse orders tensors in a file (widest
/// first, so every tensor lies aligned): files come out byte for byte as the reference writes them.
/// Sub-byte types (F4, F6) are left out: nothing here stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    const ALL: [Dtype; 17] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::F8E5M2 | Dtype::F8E4M3 | Dtype::F8E8M0 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// The name in a safetensors header (`F32`, `BF16`, …).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = CheckpointError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Dtype::ALL
            .into_iter()
            .find(|dtype| dtype.name() == name)
            .ok_or_else(|| CheckpointError::UnknownDtype(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for dtype in Dtype::ALL {
            assert_eq!(dtype.name().parse::<Dtype>().unwrap(), dtype);
        }
        assert!("float32".parse::<Dtype>().is_err());
    }
}
