//! The tokenizer as the text codec of character-level FIM.

use std::path::Path;

use fastllm_data::{FimSplit, TextCodec, Tokenizer};
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

struct TokenizerCodec(Tokenizer);

impl TextCodec for TokenizerCodec {
    // A failure means the dataset and the tokenizer do not belong together.
    fn decode(&self, tokens: &[u32]) -> Result<String, String> {
        self.0.decode(tokens).map_err(|error| {
            format!("the dataset's tokens do not decode with its tokenizer.json ({error})")
        })
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::new();
        self.0
            .encode(text, &mut ids)
            .map_err(|error| format!("decoded text does not encode again ({error})"))?;
        Ok(ids)
    }
}

/// The codec character-level FIM needs (none for token-level FIM).
pub fn codec(
    split: FimSplit,
    tokenizer: Option<&Path>,
) -> PyResult<Option<Box<dyn TextCodec + Send + Sync>>> {
    match (split, tokenizer) {
        (FimSplit::Token, _) => Ok(None),
        (FimSplit::Character, None) => Err(PyValueError::new_err(
            "character-level FIM needs the dataset's tokenizer",
        )),
        (FimSplit::Character, Some(path)) => {
            let tokenizer =
                Tokenizer::load(path).map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok(Some(Box::new(TokenizerCodec(tokenizer))))
        }
    }
}
