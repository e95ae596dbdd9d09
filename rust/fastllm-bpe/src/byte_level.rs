//! GPT-2's byte-level alphabet: every byte is written as one printable char in the vocabulary.

/// The char standing for each byte (GPT-2's `bytes_to_unicode`).
pub(crate) fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next_unprintable = 256;
    for b in 0..=255u8 {
        chars[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            next_unprintable += 1;
            char::from_u32(next_unprintable - 1).expect("below the surrogate range")
        };
    }
    chars
}

/// Maps vocabulary strings back to the bytes they stand for.
pub(crate) struct ByteDecoder {
    /// Indexed by char code; the alphabet ends below 512.
    byte_of_char: Vec<Option<u8>>,
}

impl ByteDecoder {
    pub(crate) fn new() -> Self {
        let mut byte_of_char = vec![None; 512];
        for (b, c) in byte_chars().into_iter().enumerate() {
            byte_of_char[c as usize] = Some(b as u8);
        }
        Self { byte_of_char }
    }

    /// The bytes of a vocabulary token, or `None` when it holds a char outside the alphabet
    /// (such a token can never come out of byte-level BPE).
    pub(crate) fn token_bytes(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| self.byte_of_char.get(c as usize).copied().flatten())
            .collect()
    }
}
