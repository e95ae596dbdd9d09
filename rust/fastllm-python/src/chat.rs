//! `fastllm._native.ChatTemplate`: a tokenizer's chat template, rendered as `prepare` renders
//! it, for prompts at generation time.

use std::path::PathBuf;

use fastllm_data::ChatTemplate as Template;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

#[pyclass(frozen, module = "fastllm._native")]
pub struct ChatTemplate {
    inner: Template,
}

#[pymethods]
impl ChatTemplate {
    /// The template of the tokenizer at `tokenizer` (file or directory), or the file `template`.
    #[new]
    #[pyo3(signature = (tokenizer, template=None))]
    fn new(tokenizer: PathBuf, template: Option<PathBuf>) -> PyResult<Self> {
        let inner =
            Template::load(&tokenizer, template.as_deref()).map_err(|error| match error {
                fastllm_data::ChatError::Io { .. } => PyOSError::new_err(error.to_string()),
                _ => PyValueError::new_err(error.to_string()),
            })?;
        Ok(Self { inner })
    }

    /// The text of `messages_json` (a JSON list of messages).
    #[pyo3(signature = (messages_json, *, add_generation_prompt))]
    fn render(&self, messages_json: &str, add_generation_prompt: bool) -> PyResult<String> {
        let messages: serde_json::Value = serde_json::from_str(messages_json)
            .map_err(|error| PyValueError::new_err(format!("messages: {error}")))?;
        self.inner
            .render(&messages, add_generation_prompt)
            .map_err(PyValueError::new_err)
    }
}
